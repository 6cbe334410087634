"""SimTrainerRank (`trainer.backend=sim`): TrainerRank's interface
(asyncrl.interfaces.TrainerRankInterface) with a cost model in place of megatron-core. One
actor stands for the whole trainer (tensor x pipeline x data parallel ranks): a step takes, in
simulated seconds (trainer.sim; asyncrl.clock),

    tokens x train_per_token_s / dp  (+ tokens x logprob_per_token_s / dp per forward-only pass)
    + optimizer_s per optimizer update,

where tokens are the prompt and response tokens of the step's trained samples (a prompt counts
engine.sim.prompt_tokens when set, as the simulated engines prefill it; a response token is a
block of engine.sim.token_block tokens), times trainer.sim.trained_share (the share a real run
would train: simulated rewards carry no signal, so no group is filtered). The weight broadcast
takes weight_bytes / broadcast_bytes_per_s. Samples, staleness and the policy lag are
accounted for exactly as the real trainer does; the weights themselves do not exist.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.clock import Clock
from asyncrl.messages import StagedWeights, TrainerSetupInfo, TrainStepResult
from asyncrl.trainer.batch import TrainSample, build_samples
from asyncrl.trainer.policy_lag import PolicyLag
from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_checkpoint_json
from asyncrl.trainer.settings import TrainerSettings
from asyncrl.types import staleness


def staleness_metrics(samples: list[TrainSample], policy_version: int, max_staleness: int) -> dict[str, float]:
    """The real trainer's staleness metrics over these samples' trained tokens."""
    ages = [staleness(policy_version, v) for s in samples for v, m in zip(s.versions, s.mask) if m]
    count = collections.Counter(ages)
    n = max(1, len(ages))
    out = {"train/staleness_mean": sum(ages) / n, "train/staleness_max": float(max(ages, default=0))}
    out.update({f"train/staleness_share_{s}_mean": count[s] / n for s in range(max_staleness + 1)})
    return out


class SimTrainerRank:
    def __init__(self, settings: TrainerSettings, rank: int, world_size: int):
        self.settings = settings
        self.advantage_plan = AdvantagePlan.of(settings.algorithm)  # the real trainer's: the same passes
        self.sim = settings.trainer.sim
        self.clock = Clock(settings.time_scale)
        self.step = 0
        self._lag = PolicyLag(settings.algorithm.policy_lag)  # staged versions: no weights to keep

    def node_id(self) -> str:
        return ""

    def world_address(self, member_nodes: list[str]) -> tuple[str, int]:
        return "127.0.0.1", 0

    def setup(self, master_addr: str, master_port: int, secret: str) -> TrainerSetupInfo:
        self.clock.sleep(self.sim.setup_s)
        if self.settings.algorithm.policy_lag:  # the base policy is version 0 of the engines' lagged weights
            self._lag.stage(0, None)
        t = self.settings.trainer
        return TrainerSetupInfo(setup_s=self.sim.setup_s, params_this_rank=0, transformer_engine=False,
                                tp=t.tensor_parallel_size, pp=t.pipeline_parallel_size, dp=t.data_parallel_size,
                                weight_bytes=self.sim.weight_bytes, weight_buckets=0, cpu_cores=[])

    def step_s(self, tokens: int, updates: int) -> float:
        """Simulated seconds of one step over `tokens` with `updates` optimizer updates."""
        s, dp = self.sim, self.settings.trainer.data_parallel_size
        per_token = s.train_per_token_s + self.advantage_plan.forward_passes(updates) * s.logprob_per_token_s
        return tokens * per_token / dp + updates * s.optimizer_s

    def train_step(self, groups: list, policy_version: int) -> TrainStepResult:
        t0 = self.clock.now()
        batch = build_samples(groups, self.advantage_plan)
        prompt, block = self.settings.sim_engine.prompt_tokens, self.settings.sim_engine.token_block
        tokens = sum((prompt or s.prompt_len) + s.num_response * block for s in batch.samples)
        trained = sum(sum(s.mask) for s in batch.samples)
        updates = min(self.settings.trainer.mini_batches_per_step, len(batch.samples))
        self.clock.sleep(self.step_s(round(tokens * self.sim.trained_share), updates))
        self.step += 1
        metrics = {**staleness_metrics(batch.samples, policy_version, self.settings.algorithm.max_staleness),
                   **{f"batch/{k}": v for k, v in batch.stats.items()},
                   "train/tokens": float(trained), "train/step_s": self.clock.now() - t0, "train/step": self.step}
        return TrainStepResult(metrics, staleness_max=round(metrics["train/staleness_max"]), tokens=trained,
                               filtered=batch.filtered)

    # -- weights out: only their time --------------------------------------------------

    def adapter_config(self) -> None:
        return None  # simulated syncs carry whole weights

    def weight_plan(self) -> list:
        return []

    def weight_group_address(self, member_nodes: list[str]) -> tuple[str, int]:
        return "127.0.0.1", 0  # no group: nothing is bound

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, secret: str) -> None:
        pass

    def stage_weights(self, version: int, newest: bool = False) -> StagedWeights:
        """The version a sync sends: with algorithm.policy_lag the one that many versions back."""
        staged, _ = self._lag.stage(version, None, newest)
        return StagedWeights(0.0, {}, staged)

    def broadcast_weights(self) -> float:
        seconds = self.sim.weight_bytes / self.sim.broadcast_bytes_per_s
        self.clock.sleep(seconds)
        return seconds

    def export_hf(self, out_dir: str) -> str:
        """No weights to write: a note saying so."""
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "SIMULATED").write_text("trainer.backend=sim: this run trained no weights\n")
        return out_dir

    def save_checkpoint(self, ckpt_dir: str) -> str:
        path = Path(ckpt_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sim_trainer_state.json").write_text(json.dumps({"step": self.step}))
        return str(path)

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> int:
        state = read_checkpoint_json(Path(ckpt_dir) / "sim_trainer_state.json")  # a regular file, finite numbers
        if not (isinstance(state, dict) and type(state.get("step")) is int and state["step"] >= 0):
            raise CheckpointRefused(f"checkpoint {ckpt_dir}/sim_trainer_state.json refused: expected {{\"step\": N}}")
        self.step = state["step"]
        self._lag.clear()
        return self.step

    def shutdown(self) -> None:
        pass

"""The driver: the one module that knows every actor. It reads like DESIGN.md's picture.

    prompts --admit--> RolloutWorkers --generate--> EngineActors
                           | finished groups
                           v
                      MessageQueue --get(B)--> Trainer ranks --broadcast--> EngineActors

setup():   Ray (embedded, or the running cluster under `ray job submit`), a placement
           group, the engines, the queue, the rollout workers, the trainer ranks, the
           weight-sync group; the base policy's held-out accuracy.
train():   admit prompts (staleness control) -> take B groups -> train step -> every k
           steps a weight sync (interrupt -> pause -> broadcast -> load -> resume ->
           resume interrupted loops) -> evaluate / checkpoint / log.
cleanup(): final evaluation, HF export, summary.json, every actor stopped (also on
           errors and Ctrl-C), the prompt ledger checked.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from asyncrl import actors
from asyncrl.agents.registry import build_agents
from asyncrl.config.schema import Config
from asyncrl.evaluation import EvalResult, evaluate_with_workers
from asyncrl.messages import EngineActivity, QueueState, WorkerStats
from asyncrl.monitoring.run_log import RunLog
from asyncrl.rollout.admission import PromptLedger, StalenessController
from asyncrl.sync.weight_sync import WeightSync
from asyncrl.trainer.batch import group_filter_reason
from asyncrl.trainer.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run that cannot go on (an actor died, an invariant broke); the message says why."""


@dataclass
class RunState:
    """The driver's own part of a checkpoint (run_state.json; the trainer saves its state, the
    queue its contents, the ledger its prompts beside it)."""

    step: int
    version: int
    samples: int
    admitted: int
    problem_stream: dict[str, Any]  # WeightedMultiTask.state()
    base_eval: EvalResult

    @classmethod
    def from_json(cls, text: str) -> RunState:
        d = json.loads(text)
        base = d.pop("base_eval")
        base["pass_at_k"] = {int(k): v for k, v in base["pass_at_k"].items()}  # JSON keys are strings
        return cls(**d, base_eval=EvalResult(**base))


class Driver:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.version = 0  # policy version: weight syncs so far
        self.step = 0
        self.samples = 0
        self.train_s = 0.0  # seconds in the training loop so far
        self.engines: list = []
        self.workers: list = []
        self.queue = None
        self.trainer: TrainerGroup | None = None
        self.sync: WeightSync | None = None
        self.placement = actors.Placement()
        self.base_eval: EvalResult | None = None
        self.final_eval: EvalResult | None = None
        self.log: RunLog | None = None
        self._started_ray = False
        a = cfg.algorithm
        self.staleness = StalenessController(a.max_staleness, a.prompts_per_step, a.sync_every_steps)
        self.ledger = PromptLedger()

    # == setup =========================================================================

    def setup(self) -> None:
        t0 = time.monotonic()
        cfg = self.cfg
        self.log = RunLog(cfg, self.run_dir)
        self._start_ray()
        self.placement = actors.place(cfg)
        logger.info("starting %d engine(s), %d rollout worker(s), %d trainer rank(s)", cfg.engine.num_engines,
                    cfg.rollout.num_workers, actors.trainer_world_size(cfg))
        self.engines = actors.create_engines(cfg, self.placement.engine)
        engine_start = [e.start.remote() for e in self.engines]
        self.trainer = actors.create_trainer(cfg, self.placement.trainer)
        trainer_info = self.trainer.setup()  # the trainer loads while the engines start
        for i, info in enumerate(ray.get(engine_start)):
            logger.info("engine-%d: vLLM started in %.0fs, %.2f GiB resident, on cores %s, processes %s", i,
                        info.start_s, info.rss_gib, info.cpu_cores, info.vllm_processes)
        self.queue = actors.create_queue(cfg)
        self.workers = actors.create_rollout_workers(cfg, self.engines, self.queue, self.placement.worker)
        self.sync = actors.create_weight_sync(cfg, self.trainer, self.engines)
        self.sync.connect()

        self.agents = build_agents(cfg)  # the environments: problems (mixed by weight) and evaluation
        self.heldout = self.agents.heldout(cfg.eval.num_problems)
        if cfg.run.resume_from:
            self._resume(Path(cfg.run.resume_from))
            return
        logger.info("ready in %.0fs (trainer: %s); evaluating the base policy", time.monotonic() - t0, trainer_info)
        self.base_eval = self._evaluate(with_pass_k=True)
        logger.info("base policy: %s", self.base_eval.summary())
        self.log.log(0, {**self._eval_metrics(self.base_eval), "setup_s": time.monotonic() - t0})

    def _start_ray(self) -> None:
        address = self.cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
        if ray.is_initialized():
            return
        if address:  # `ray job submit` or an explicit cluster: join it
            ray.init(address=address, log_to_driver=True)
        else:  # "local": a cluster of our own, even where `ray start` left one running
            ray.init(address="local", num_cpus=self.cfg.cluster.num_cpus, num_gpus=self.cfg.cluster.num_gpus or None,
                     include_dashboard=self.cfg.cluster.dashboard, log_to_driver=True)
            self._started_ray = True

    # == train =========================================================================

    def train(self) -> None:
        cfg = self.cfg
        t = cfg.trainer
        self._admit()
        last_time, last_activity, last_rollout = time.monotonic(), self._engine_activity(), {}
        started = last_time
        for step in range(self.step + 1, t.total_steps + 1):
            if cfg.run.max_train_s and time.monotonic() - started >= cfg.run.max_train_s:
                logger.info("run.max_train_s=%g reached after %d steps", cfg.run.max_train_s, self.step)
                break
            self.step = step
            t_wait = time.monotonic()
            groups, dropped = self._next_batch()
            waited = time.monotonic() - t_wait
            result = self.trainer.train_step(groups, self.version)
            self._check_staleness(result.staleness_max)
            metrics: dict[str, Any] = dict(result.metrics)
            for g in groups:
                reason = group_filter_reason(g, cfg.algorithm.loss)
                self.ledger.finish(g.prompt_id, "filtered" if reason else "trained", reason or "")
            step_samples = sum(len(g.trajectories) for g in groups)
            if len(self.agents.weights) > 1:  # the multi-task mix as trained
                metrics.update({f"batch/groups/{env}": n for env, n in
                                collections.Counter(g.env_id for g in groups).items()})
            self.samples += step_samples
            if step % cfg.algorithm.sync_every_steps == 0:
                metrics.update(self._sync())
            self._admit()
            now, activity, rollout = time.monotonic(), self._engine_activity(), self._rollout_metrics()
            elapsed = now - last_time
            engine_s = elapsed * len(self.engines)
            metrics.update({
                "policy/version": self.version, "batch/dropped_stale": dropped,
                "throughput/samples_per_s": step_samples / elapsed,
                "throughput/step_s": elapsed, "idle/trainer": waited / elapsed,
                "idle/engines": 1 - min(1.0, (activity.busy_s - last_activity.busy_s) / engine_s),
                "util/engines": min(1.0, (activity.request_s - last_activity.request_s)
                                    / (engine_s * actors.engine_concurrency(cfg))),
                "progress/samples": self.samples, "progress/admitted": self.staleness.admitted,
                **rollout, **tool_call_validity(rollout, last_rollout), **ray.get(self.queue.stats.remote()).metrics(),
            })
            last_time, last_activity, last_rollout = now, activity, rollout
            self.train_s = time.monotonic() - started
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < t.total_steps:
                metrics.update(self._eval_metrics(self._evaluate(with_pass_k=cfg.eval.periodic_pass_k)))
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
                self.save_checkpoint()
            self.log.log(step, metrics)
            self.queue.report.remote(_gauges(metrics))

    def _next_batch(self) -> tuple[list, int]:
        """B groups from the queue; groups staler than eta are dropped (counted) so that no
        trained token ever exceeds the bound."""
        b = self.cfg.algorithm.prompts_per_step
        timeout = self.cfg.trainer.dist_timeout_s
        try:
            groups = ray.get(self.queue.get.remote(b, self.version, timeout))
        except (TimeoutError, ray.exceptions.RayTaskError) as e:
            if not isinstance(e, TimeoutError) and not isinstance(getattr(e, "cause", None), TimeoutError):
                raise
            raise TrainingError(f"waited {timeout:g}s (trainer.dist_timeout_s) for {b} trajectory groups; "
                                f"rollout: {self._rollout_metrics()}") from None
        fresh = []
        for g in groups:
            if self.staleness.is_fresh(g, self.version):
                fresh.append(g)
            else:
                self.ledger.finish(g.prompt_id, "filtered", "stale")
        return fresh, len(groups) - len(fresh)

    def _check_staleness(self, staleness_max: int) -> None:
        eta = self.cfg.algorithm.max_staleness
        if staleness_max > eta:
            raise TrainingError(f"invariant broken: a trained token is {staleness_max} versions old, "
                                f"algorithm.max_staleness={eta}")

    def _admit(self) -> None:
        """Start as many new prompts as staleness control allows, spread over the workers."""
        room = self.staleness.admissible(self.version)
        all_rejected = 0
        while room > 0:
            problems = [self.agents.next_problem() for _ in range(room)]
            shares = [problems[i::len(self.workers)] for i in range(len(self.workers))]
            accepted = sum(ray.get([w.submit.remote(s) for w, s in zip(self.workers, shares) if s]))
            rejected = self._rejected_prompts()
            for p in problems:
                self.ledger.admit(p.prompt_id)
                if p.prompt_id in rejected:
                    self.ledger.finish(p.prompt_id, "failed", rejected[p.prompt_id].code)
            self.staleness.on_admitted(accepted, self.version)
            room = self.staleness.admissible(self.version)
            all_rejected = all_rejected + 1 if accepted == 0 else 0
            if all_rejected == 3:  # the data (or the config) cannot produce a single usable prompt
                reasons = collections.Counter(f.code for f in rejected.values())
                raise TrainingError(f"the rollout workers rejected every prompt of 3 admissions in a row "
                                    f"({dict(reasons)}); e.g. {next(iter(rejected.values()), '')}")

    def _worker_stats(self) -> list[WorkerStats]:
        return ray.get([w.get_stats.remote() for w in self.workers])

    def _rejected_prompts(self) -> dict[str, Any]:
        """prompt id -> Failure, for every row a worker refused."""
        return {pid: f for stats in self._worker_stats() for pid, f in stats.failed_prompts.items()}

    def _sync(self) -> dict[str, float]:
        """interrupt loops -> pause engines -> broadcast -> load -> resume -> resume loops."""
        a = self.cfg.algorithm
        if not a.partial_rollout:  # finish what is generating under the old weights first
            ray.get([w.drain.remote() for w in self.workers])
        if a.pause_mode == "abort":
            ray.get([w.interrupt.remote() for w in self.workers])
        metrics = self.sync.sync(self.version + 1, a.pause_mode).metrics()
        self.version += 1
        if a.pause_mode == "abort":
            metrics["sync/resumed_loops"] = sum(ray.get([w.resume_interrupted.remote() for w in self.workers]))
        return metrics

    def _engine_activity(self) -> EngineActivity:
        each = ray.get([e.activity.remote() for e in self.engines])
        return EngineActivity(sum(a.busy_s for a in each), sum(a.request_s for a in each))

    def _rollout_metrics(self) -> dict[str, Any]:
        stats = self._worker_stats()
        keys = ("generated_tokens", "interruptions", "resumes", "trajectories_finished", "running_loops", "snapshots")
        out: dict[str, Any] = {f"rollout/{k}": sum(getattr(s, k) for s in stats) for k in keys}
        failures: collections.Counter[str] = collections.Counter()
        tool_errors: collections.Counter[str] = collections.Counter()
        for s in stats:
            failures.update(s.failures)
            tool_errors.update(s.tool_errors)
        out["rollout/failures"] = dict(failures)
        out["rollout/tool_calls"] = sum(s.tool_calls for s in stats)
        out.update({f"rollout/tool_errors/{reason}": n for reason, n in tool_errors.items()})
        return out

    def _evaluate(self, with_pass_k: bool) -> EvalResult:
        return evaluate_with_workers(self.cfg, self.workers, self.agents, self.heldout, with_pass_k=with_pass_k)

    @staticmethod
    def _eval_metrics(result: EvalResult) -> dict[str, float]:
        out = {"eval/greedy_accuracy": result.greedy_accuracy, "eval/seconds": result.seconds}
        out.update({f"eval/pass@{k}": v for k, v in result.pass_at_k.items()})
        if len(result.per_env) > 1:
            out.update({f"eval/{env}/{k}": v for env, m in result.per_env.items() for k, v in m.items()})
        return out

    # == checkpoints and the end ===========================================================

    def save_checkpoint(self) -> str:
        """Trainer state (megatron dist checkpoint), queue contents, prompt ledger, the driver's state."""
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        queue_state: QueueState = ray.get(self.queue.state.remote())
        state = RunState(step=self.step, version=self.version, samples=self.samples,
                         admitted=self.staleness.admitted, problem_stream=self.agents.state(), base_eval=self.base_eval)
        self.trainer.save_checkpoint(str(path))
        self.trainer.export_hf(str(path / "hf"))  # `asyncrl eval CHECKPOINT` reads this
        (path / "run_state.json").write_text(json.dumps(asdict(state)))
        (path / "queue.json").write_text(json.dumps(queue_state.to_dict()))
        (path / "ledger.json").write_text(json.dumps({"states": self.ledger.states,
                                                      "reasons": dict(self.ledger.reasons)}))
        logger.info("checkpoint: %s", path)
        return str(path)

    def _resume(self, path: Path) -> None:
        """Continue a run from `save_checkpoint`'s directory. Prompts that were generating when
        it was saved (neither queued nor finished) start again from their prompt."""
        state = RunState.from_json((path / "run_state.json").read_text())
        trainer_step = self.trainer.load_checkpoint(str(path))
        if trainer_step != state.step:
            raise TrainingError(f"{path}: the trainer's state is of step {trainer_step}, the run's of {state.step}")
        self.step, self.version, self.samples = state.step, state.version, state.samples
        self.staleness.admitted = state.admitted
        self.agents.restore(state.problem_stream)
        self.base_eval = state.base_eval
        queue_state = QueueState.from_dict(json.loads((path / "queue.json").read_text()))
        ray.get(self.queue.restore.remote(queue_state))
        ledger = json.loads((path / "ledger.json").read_text())
        self.ledger = PromptLedger(ledger["states"], collections.Counter(ledger["reasons"]))
        self.sync.sync(self.version, self.cfg.algorithm.pause_mode)  # the engines get the restored weights
        queued = {g.prompt_id for g in queue_state.groups}
        restart = [self.agents.problem_by_id(p) for p in sorted(self.ledger.running() - queued)]
        if restart:
            ray.get([w.submit.remote(restart[i::len(self.workers)]) for i, w in enumerate(self.workers)])
        logger.info("resumed from %s: step %d, version %d, %d groups queued, %d prompts restarted",
                    path, self.step, self.version, len(queued), len(restart))

    def finish(self, wall_start: float) -> dict[str, Any]:
        """Final evaluation (with pass@k), HF export, summary.json."""
        self.final_eval = self._evaluate(with_pass_k=True)
        self.log.log(self.step, self._eval_metrics(self.final_eval))
        export = self.trainer.export_hf(str(self.run_dir / "final_policy"))
        if self.cfg.trainer.checkpoint_every:
            self.save_checkpoint()
        summary = {
            "recipe": self.cfg.recipe.name, "base_accuracy": self.base_eval.greedy_accuracy,
            "final_accuracy": self.final_eval.greedy_accuracy,
            "base_pass_at_k": self.base_eval.pass_at_k, "final_pass_at_k": self.final_eval.pass_at_k,
            "wall_s": time.monotonic() - wall_start, "train_s": self.train_s, "steps": self.step,
            "samples": self.samples,
            "policy_version": self.version, "final_policy": export, "metrics": str(self.log.path),
            "prompts": self.ledger_counts(), "max_staleness": self.cfg.algorithm.max_staleness,
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def ledger_counts(self) -> dict[str, int]:
        """Every admitted prompt in exactly one state; running ones are where the workers and queue say."""
        counts = self.ledger.counts()
        running = self.ledger.running()
        # Workers first, then the queue: a group moving from one to the other meanwhile is
        # then seen twice rather than missed (it leaves a worker only once it is queued).
        in_workers = {p for ps in ray.get([w.pending_prompts.remote() for w in self.workers]) for p in ps}
        in_queue = set(ray.get(self.queue.prompt_ids.remote()))
        unaccounted = running - in_queue - in_workers
        if unaccounted:
            raise TrainingError(f"invariant broken: {len(unaccounted)} running prompts are neither queued nor in "
                                f"a worker, e.g. {sorted(unaccounted)[:3]}")
        counts.update({"queued": len(running & in_queue), "in_workers": len(running - in_queue),
                       "admitted": len(self.ledger.states)})
        return counts

    def cleanup(self) -> None:
        """Stop every actor we started (rollout workers, then engines: their vLLM processes), then
        Ray if embedded."""
        if self.log is not None:
            self.log.close()
        if not ray.is_initialized():
            return
        # The run is over: loops still generating would only fail, one traceback each, as their engine goes.
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception as err:  # a dead engine cannot shut down; it is killed below
                logger.warning("engine shutdown: %s", err)
        if self.trainer is not None:
            self.trainer.shutdown()
        for actor in [*self.engines, *([self.queue] if self.queue else [])]:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        actors.remove_placement(self.placement)
        if self._started_ray:
            ray.shutdown()


def tool_call_validity(rollout: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """The share of the tool calls finished since `before` (both `_rollout_metrics`, whose tool
    counts are totals) that had no error; nothing when no call finished."""
    def errors(m: dict[str, Any]) -> int:
        return sum(v for k, v in m.items() if k.startswith("rollout/tool_errors/"))

    calls = rollout["rollout/tool_calls"] - before.get("rollout/tool_calls", 0)
    if calls <= 0:
        return {}
    return {"rollout/tool_call_validity": 1 - (errors(rollout) - errors(before)) / calls}


def _gauges(m: dict[str, Any]) -> dict[str, float]:
    return {"asyncrl_policy_version": m.get("policy/version"), "asyncrl_staleness_max": m.get("train/staleness_max"),
            "asyncrl_samples_per_s": m.get("throughput/samples_per_s"),
            "asyncrl_trainer_idle_ratio": m.get("idle/trainer"), "asyncrl_engine_idle_ratio": m.get("idle/engines"),
            "asyncrl_engine_utilization": m.get("util/engines"),
            "asyncrl_reward_mean": m.get("batch/reward_mean")}


def run_training(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """setup -> train -> finish, with cleanup on success, on errors and on Ctrl-C."""
    wall_start = time.monotonic()
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        driver.train()
        return driver.finish(wall_start)
    finally:
        driver.cleanup()

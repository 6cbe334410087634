"""`asyncrl eval`: a policy's accuracy on the held-out problems of every agent of a recipe.

    asyncrl eval recipe=arith                                 # the recipe's base model
    asyncrl eval runs/arith/2026-11-21_10-00-00 recipe=arith  # a run's final policy
    asyncrl eval RUN_DIR/checkpoints/step_000020 recipe=arith # a checkpoint (its hf/ export)
    asyncrl eval recipe=arith eval.endpoint=http://127.0.0.1:8000/v1   # any OpenAI-compatible server
    python -m asyncrl.evaluate recipe=arith                   # the same as the first

Each agent runs its own loop (tool calls, multi-turn, remote env servers) through vLLM in
this process (no Ray). Prints greedy accuracy and unbiased pass@k (eval.n_samples samples
per problem at eval.temperature), per env when there are several, and writes them to
eval.json in the run directory.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from asyncrl.agents.api import EvaluationResponse
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.agents.registry import build_agents
from asyncrl.config import CONF_DIR, Config, validate_or_exit
from asyncrl.engine.gateway import InferenceGateway
from asyncrl.engine.inference import Endpoint, InferenceInterface
from asyncrl.tasks import Problem
from asyncrl.types import GenerationResult, SamplingSpec

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """Greedy accuracy and pass@k over the training envs' held-out problems, and every env's
    own metrics (evaluation-only envs included) in `per_env`."""

    model: str
    num_problems: int
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    n_samples: int
    temperature: float
    mean_response_tokens: float
    seconds: float
    per_env: dict[str, dict[str, float]] = field(default_factory=dict)

    def summary(self) -> str:
        ks = "  ".join(f"pass@{k} {v:.1%}" for k, v in self.pass_at_k.items())
        envs = "" if len(self.per_env) < 2 else "\n" + "\n".join(
            f"  {env}: greedy {m.get('greedy_accuracy', 0):.1%}" + "".join(
                f"  {k} {v:.1%}" for k, v in m.items() if k.startswith("pass@"))
            for env, m in self.per_env.items())
        return (f"held-out accuracy (greedy) {self.greedy_accuracy:.1%}  {ks}  "
                f"[{self.num_problems} problems, n={self.n_samples}, T={self.temperature}, {self.seconds:.0f}s]{envs}")


def eval_result(cfg: Config, model: str, responses: list[EvaluationResponse], train_envs: set[str],
                t0: float) -> EvalResult:
    """The run-level result from each env's evaluation: headline figures over the training envs."""
    pass_k = list(cfg.eval.pass_k)
    pooled = EvaluationResponse("train", [r for resp in responses if resp.env_id in train_envs
                                          for r in resp.results], pass_k, cfg.eval.temperature)
    m = pooled.metrics()
    n = min((len(r.sampled_rewards) for r in pooled.results), default=0)
    return EvalResult(
        model=model, num_problems=len(pooled.results), greedy_accuracy=m.get("greedy_accuracy", 0.0),
        pass_at_k={k: m[f"pass@{k}"] for k in pass_k if f"pass@{k}" in m}, n_samples=n,
        temperature=cfg.eval.temperature, mean_response_tokens=m.get("mean_response_tokens", 0.0),
        seconds=time.time() - t0, per_env={resp.env_id: resp.metrics() for resp in responses})


def evaluate_with_workers(cfg: Config, workers: list, agents: WeightedMultiTask, problems: list[Problem],
                          with_pass_k: bool = True) -> EvalResult:
    """Evaluation during training, through the rollout workers: every problem runs its agent's
    loop (tool calls included; remote agents on their server) on the running engines, once
    greedily and, with `with_pass_k`, eval.n_samples times at eval.temperature."""
    import ray

    t0 = time.time()
    n = cfg.eval.n_samples if with_pass_k else 0
    shares = [problems[i::len(workers)] for i in range(len(workers))]
    per_worker = ray.get([w.evaluate.remote(share, n, cfg.eval.temperature, list(cfg.eval.pass_k))
                          for w, share in zip(workers, shares) if share])
    return eval_result(cfg, "policy in training", _merge(per_worker), set(agents.weights), t0)


def _merge(per_worker: list[list[EvaluationResponse]]) -> list[EvaluationResponse]:
    """One response per env from the workers' shares."""
    merged: dict[str, EvaluationResponse] = {}
    for responses in per_worker:
        for r in responses:
            if r.env_id in merged:
                merged[r.env_id].results += r.results
            else:
                merged[r.env_id] = r
    return list(merged.values())


def evaluate(cfg: Config) -> EvalResult:
    """Greedy accuracy and pass@k of `cfg.model.path` (or of `eval.endpoint`) on the first
    `eval.num_problems` held-out problems of every agent, without Ray: vLLM runs in this process."""
    agents = build_agents(cfg)
    return asyncio.run(_evaluate(cfg, agents, agents.heldout(cfg.eval.num_problems)))


async def _evaluate(cfg: Config, agents: WeightedMultiTask, problems: list[Problem]) -> EvalResult:
    t0 = time.time()
    tokenizer = next(iter(agents.agents.values())).tokenizer
    engine = None
    if cfg.eval.endpoint:
        remote = OpenAIInference(Endpoint(cfg.eval.endpoint, cfg.eval.endpoint_model or cfg.model.path),
                                 tokenizer=tokenizer)
        pick, model = (lambda: remote), cfg.eval.endpoint
    else:
        from asyncrl.engine.engine_actor import EngineActor

        engine = EngineActor(0, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device,
                             stream_outputs=False)  # never paused
        await engine.start()
        pick, model = (lambda: _InProcessEngine(engine)), cfg.model.path
    gateway = InferenceGateway(pick, tokenizer)
    try:
        if any(agents.agent_for(p).remote for p in problems):
            await gateway.serve()  # their env servers generate through the gateway
        responses = await agents.evaluate(problems, gateway, cfg.eval.n_samples, cfg.eval.temperature,
                                          list(cfg.eval.pass_k))
    finally:
        await gateway.stop()
        if engine is not None:
            await engine.shutdown()
    return eval_result(cfg, model, responses, set(agents.weights), t0)


class _InProcessEngine(InferenceInterface):
    """An EngineActor used as a plain object (no Ray) for standalone evaluation."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        return await self.engine.generate(prompt_token_ids, sampling, request_id)


def resolve_checkpoint(path: str) -> str:
    """The Hugging Face directory behind what a user calls a checkpoint: an HF directory, a run
    directory (its final_policy), or a checkpoint directory (RUN_DIR/checkpoints/step_N: its hf/)."""
    p = Path(path)
    for candidate in (p, p / "final_policy", p / "hf"):
        if (candidate / "config.json").is_file():
            return str(candidate.resolve())
    raise ValueError(f"{path!r} is not a checkpoint: expected a Hugging Face directory (config.json), a run "
                     "directory with final_policy/, or RUN_DIR/checkpoints/step_N with hf/")


@hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
def _hydra_main(dict_cfg: DictConfig) -> None:
    cfg = validate_or_exit(dict_cfg)
    result = evaluate(cfg)
    out = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir) / "eval.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(result), indent=2) + "\n")
    print(result.summary())
    print(f"results: {out}")


def main() -> None:
    # `asyncrl eval CHECKPOINT key=value ...`: the first argument, when it is not an override or a
    # flag, is the policy to evaluate.
    if len(sys.argv) > 1 and "=" not in sys.argv[1] and not sys.argv[1].startswith("-"):
        try:
            model = resolve_checkpoint(sys.argv[1])
        except ValueError as e:
            sys.exit(f"asyncrl eval: {e}")
        sys.argv = [sys.argv[0], *sys.argv[2:], f"model.path={model}"]
    _hydra_main()


if __name__ == "__main__":
    main()

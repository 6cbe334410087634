"""Evaluation: a policy's greedy accuracy and pass@k on the held-out problems of every agent.

Two ways in, one result (`EvalResult`):
  - `evaluate_with_workers`: during training, through the running rollout workers (every
    problem runs its agent's loop on the engines in training);
  - `evaluate`: standalone (`asyncrl eval`), without Ray: vLLM in this process, or any
    OpenAI-compatible endpoint (`eval.endpoint`).
Greedy accuracy and unbiased pass@k are pooled over the training envs; every env's own
metrics (evaluation-only envs included) are in `EvalResult.per_env`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.agents.api import EvaluationResponse
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.agents.registry import build_agents
from asyncrl.config import Config
from asyncrl.config.schema import EvalConfig
from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.rollout.chat_sessions import ChatSettings
from asyncrl.rollout.gateway import InferenceGateway
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
    # the policy versions its samples' tokens carry, as the engines tagged them (empty: not recorded,
    # e.g. `asyncrl eval`); an evaluation of one policy has exactly one
    versions: list[int] = field(default_factory=list)

    def summary(self) -> str:
        ks = "  ".join(f"pass@{k} {v:.1%}" for k, v in self.pass_at_k.items())
        envs = "" if len(self.per_env) < 2 else "\n" + "\n".join(
            f"  {env}: greedy {m.get('greedy_accuracy', 0):.1%}" + "".join(
                f"  {k} {v:.1%}" for k, v in m.items() if k.startswith("pass@"))
            for env, m in self.per_env.items())
        return (f"held-out accuracy (greedy) {self.greedy_accuracy:.1%}  {ks}  "
                f"[{self.num_problems} problems, n={self.n_samples}, T={self.temperature}, {self.seconds:.0f}s]{envs}")


def eval_result(e: EvalConfig, model: str, responses: list[EvaluationResponse], train_envs: set[str],
                t0: float) -> EvalResult:
    """The run-level result from each env's evaluation: headline figures over the training envs."""
    pass_k = list(e.pass_k)
    pooled = EvaluationResponse("train", [r for resp in responses if resp.env_id in train_envs
                                          for r in resp.results], pass_k, e.temperature)
    m = pooled.metrics()
    n = min((len(r.sampled_rewards) for r in pooled.results if r.sampled_rewards), default=0)
    return EvalResult(
        model=model, num_problems=len(pooled.results), greedy_accuracy=m.get("greedy_accuracy", 0.0),
        pass_at_k={k: m[f"pass@{k}"] for k in pass_k if f"pass@{k}" in m}, n_samples=n,
        temperature=e.temperature, mean_response_tokens=m.get("mean_response_tokens", 0.0),
        seconds=time.time() - t0, per_env={resp.env_id: resp.metrics() for resp in responses},
        versions=sorted({v for resp in responses for v in resp.versions}))


def evaluate_with_workers(e: EvalConfig, workers: list, agents: WeightedMultiTask, problems: list[Problem],
                          with_pass_k: bool = True) -> EvalResult:
    """Evaluation during training, through the rollout workers: every problem runs its agent's
    loop (tool calls included; remote agents on their server) on the running engines, once
    greedily and, with `with_pass_k`, eval.n_samples times at eval.temperature."""
    return PendingEvaluation(e, workers, problems, with_pass_k).result(agents, block=True)


class PendingEvaluation:
    """An evaluation through the rollout workers that runs while the caller goes on (beside
    training: each worker sends at most eval.max_concurrent of its requests at once)."""

    def __init__(self, e: EvalConfig, workers: list, problems: list[Problem], with_pass_k: bool = True,
                 beside_training: bool = False, greedy_only: list[Problem] | None = None):
        """`problems`: greedily and (`with_pass_k`) eval.n_samples times each; `greedy_only`: greedily."""
        self.eval, self.t0 = e, time.time()
        limit = e.max_concurrent if beside_training else 0
        self.refs = []
        for part, n in ((problems, e.n_samples if with_pass_k else 0), (greedy_only or [], 0)):
            shares = [part[i::len(workers)] for i in range(len(workers))]
            self.refs += [w.evaluate.remote(share, n, e.temperature, list(e.pass_k), limit)
                          for w, share in zip(workers, shares) if share]

    def result(self, agents: WeightedMultiTask, block: bool = False) -> EvalResult | None:
        """The result once every worker answered (`block`: wait for it); None while it runs."""
        import ray

        if not block and len(ray.wait(self.refs, num_returns=len(self.refs), timeout=0)[0]) < len(self.refs):
            return None
        return eval_result(self.eval, "policy in training", _merge(ray.get(self.refs)), set(agents.weights),
                           self.t0)


def _merge(per_worker: list[list[EvaluationResponse]]) -> list[EvaluationResponse]:
    """One response per env from the workers' shares."""
    merged: dict[str, EvaluationResponse] = {}
    for responses in per_worker:
        for r in responses:
            if r.env_id in merged:
                merged[r.env_id].results += r.results
                merged[r.env_id].versions = sorted(set(merged[r.env_id].versions) | set(r.versions))
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
        from asyncrl.actors import create_local_engine

        engine = create_local_engine(cfg, stream=False)  # never paused
        await engine.start()
        pick, model = (lambda: _InProcessEngine(engine)), cfg.model.path
    gateway = InferenceGateway(pick, tokenizer,  # agent processes' episodes talk chat to it
                               chat=ChatSettings(cfg.tools.parser, cfg.engine.max_model_len, cfg.reward.max_abs))
    try:
        if any(agents.agent_for(p).remote for p in problems):
            await gateway.serve()  # their env servers generate through the gateway
        responses = await agents.evaluate(problems, gateway, cfg.eval.n_samples, cfg.eval.temperature,
                                          list(cfg.eval.pass_k))
    finally:
        await gateway.stop()
        if engine is not None:
            await engine.shutdown()
    return eval_result(cfg.eval, model, responses, set(agents.weights), t0)


class _InProcessEngine(InferenceInterface):
    """An EngineActor used as a plain object (no Ray) for standalone evaluation."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        return await self.engine.generate(prompt_token_ids, sampling, request_id)

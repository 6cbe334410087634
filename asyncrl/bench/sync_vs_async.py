"""`asyncrl bench sync-vs-async`: the same recipe and resources, trained synchronously and
fully asynchronously for the same wall time, in one invocation.

    asyncrl bench sync-vs-async recipe=arith bench.train_s=180

(a) sync: algorithm.max_staleness=0, no partial rollout (generation drains before every
    weight sync: the trainer and the engines take turns);
(b) async: the recipe's algorithm settings as configured (default: eta = 1, partial
    rollout with abort and resume).
Each trains for `bench.train_s` seconds (set-up and the final evaluation not counted),
then evaluates on the held-out split. samples/s = trained samples / training seconds;
idle ratios are time-weighted over the steps. Last line: one JSON object.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.config import Config
from asyncrl.monitoring.run_log import read_metrics


def _mode_config(cfg: Config, mode: str, run_dir: Path) -> Config:
    algorithm = cfg.algorithm
    if mode == "sync":
        algorithm = replace(algorithm, max_staleness=0, partial_rollout=False)
    return replace(
        cfg, algorithm=algorithm,
        run=replace(cfg.run, output_dir=str(run_dir), max_train_s=cfg.bench.train_s, resume_from=""),
        trainer=replace(cfg.trainer, total_steps=max(cfg.trainer.total_steps, 100_000), checkpoint_every=0),
        eval=replace(cfg.eval, every_steps=0),
        logging=replace(cfg.logging, progress_bar=False))


def _idle(run_dir: Path) -> dict[str, float]:
    steps = [r for r in read_metrics(run_dir) if "idle/trainer" in r]
    total = sum(r["throughput/step_s"] for r in steps) or 1.0
    return {k: sum(r[f"idle/{k}"] * r["throughput/step_s"] for r in steps) / total for k in ("trainer", "engines")}


def run_sync_vs_async_bench(cfg: Config) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from asyncrl.driver import run_training

    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    results: dict[str, dict[str, Any]] = {}
    for mode in ("sync", "async"):
        run_dir = root / mode
        summary = run_training(_mode_config(cfg, mode, run_dir), run_dir)
        results[mode] = {**summary, **_idle(run_dir), "samples_per_s": summary["samples"] / summary["train_s"]}
    s, a = results["sync"], results["async"]
    return {
        "bench": "sync_vs_async", "recipe": cfg.recipe.name, "train_s": cfg.bench.train_s,
        "sync_samples_per_s": s["samples_per_s"], "async_samples_per_s": a["samples_per_s"],
        "speedup": a["samples_per_s"] / s["samples_per_s"],
        "async_trainer_idle": a["trainer"], "async_engine_idle": a["engines"],
        "sync_trainer_idle": s["trainer"], "sync_engine_idle": s["engines"],
        "sync_accuracy": s["final_accuracy"], "async_accuracy": a["final_accuracy"],
        "base_accuracy": s["base_accuracy"], "sync_steps": s["steps"], "async_steps": a["steps"],
        "async_max_staleness": cfg.algorithm.max_staleness, "runs": str(root),
    }

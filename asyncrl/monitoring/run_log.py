"""Where a run's metrics go: always `metrics.jsonl` in the run directory, wandb (offline
unless the user configured it), and a progress bar in the terminal."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from asyncrl.config.schema import Config

logger = logging.getLogger(__name__)

# What the progress bar shows: (label, metric key, format).
PROGRESS_FIELDS = (("reward", "batch/reward_mean", "{:.3f}"), ("acc", "eval/greedy_accuracy", "{:.1%}"),
                   ("samples/s", "throughput/samples_per_s", "{:.1f}"), ("stale", "train/staleness_max", "{:.0f}"),
                   ("v", "policy/version", "{:.0f}"))


class RunLog:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self._wandb = self._start_wandb(cfg, run_dir)
        self._bar = None
        self._shown: dict[str, str] = {}
        if cfg.logging.progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=cfg.trainer.total_steps, desc=f"asyncrl {cfg.recipe.name}", unit="step",
                             file=sys.stderr, dynamic_ncols=True)

    @staticmethod
    def _start_wandb(cfg: Config, run_dir: Path):
        w = cfg.logging.wandb
        if not w.enabled or w.mode == "disabled":
            return None
        import wandb

        mode = w.mode
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists()):
            logger.warning("logging.wandb.mode=online but no WANDB_API_KEY or ~/.netrc: logging offline instead")
            mode = "offline"
        from dataclasses import asdict

        return wandb.init(project=w.project, entity=w.entity or None, mode=mode, dir=str(run_dir),
                          name=run_dir.name, config=asdict(cfg), reinit="finish_previous")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
        if self._bar is not None:
            for label, key, fmt in PROGRESS_FIELDS:
                if isinstance(metrics.get(key), (int, float)):
                    self._shown[label] = fmt.format(metrics[key])
            self._bar.set_postfix(self._shown, refresh=False)
            self._bar.n = step
            self._bar.refresh()

    def records(self) -> list[dict[str, Any]]:
        """Everything logged so far (metrics.jsonl, read back)."""
        return read_metrics(self.run_dir)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def eval_overlap(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """What evaluations beside training cost the rollouts: the median samples/s of the steps an
    evaluation overlapped (after the step it started at, up to the one that logged it) and of
    the others, and their ratio. None without both kinds of step."""
    overlapped: set[int] = set()
    for r in records:
        if r.get("eval/started_step") is not None:
            overlapped.update(range(int(r["eval/started_step"]) + 1, int(r["step"]) + 1))
    rates = {r["step"]: r["throughput/samples_per_s"] for r in records
             if isinstance(r.get("throughput/samples_per_s"), (int, float))}
    during = [v for s, v in rates.items() if s in overlapped]
    others = [v for s, v in rates.items() if s not in overlapped]
    if not during or not others:
        return None
    a, b = statistics.median(during), statistics.median(others)
    return {"steps": len(during), "samples_per_s": a, "samples_per_s_other_steps": b, "ratio": a / b}


def _plain(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v

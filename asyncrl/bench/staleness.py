"""`asyncrl bench staleness`: what staleness does to learning, per loss, on the real stack.

    asyncrl bench staleness recipe=arith                              # 5 staleness x 3 losses x 2 seeds
    asyncrl bench staleness recipe=arith "bench.seeds=[1]"            # one seed: ~32 min here (both: 68)
    asyncrl bench staleness recipe=arith "bench.pause_modes=[abort,keep]"   # + free-running runs

Controlled runs: for each seed, loss in `bench.losses` and k in `bench.staleness`, the recipe
trains `bench.steps` steps of B x n samples with the staleness held at exactly k
(algorithm.max_staleness = algorithm.policy_lag = k, no partial rollout: every trained token
is k versions old once k versions exist; k = 0 is synchronous on-policy training). With one
mini-batch a step, every loss takes the same gradient at k = 0 (all ratios are 1), so k = 0
runs once per seed, with the config's loss, and is every loss's baseline; with
trainer.mini_batches_per_step > 1 it runs per loss.
Free-running runs (`bench.pause_modes`): for each k > 0 and pause mode, the config's loss with
max_staleness = k, no lag and partial rollout: the staleness this machine's speed gives, and in
`keep` mode requests that span a sync (tokens of mixed versions).

Each run evaluates greedily every `bench.eval_every` steps (the engines' policy: k versions
behind the trainer in a controlled run; the curve is drawn against that policy's version) and
the trainer's final policy at the end. Reported per run: the accuracy curve, final accuracy,
area under the curve (mean accuracy over the evaluated policy versions, trapezoids), mean mismatch
KL(mu || pi), clip and importance-weight truncation fractions, mean staleness, and the mean
response length of what was trained and of what finished (stale-dropped and filtered groups
included). Writes `runs.json`, `table.md` and `accuracy.png` (one panel per loss) into the
run directory; the last line is a JSON object of the final accuracies.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from asyncrl.bench.config import BenchConfig
from asyncrl.config import Config
from asyncrl.metrics import LENGTH_BIN_TOKENS
from asyncrl.monitoring.run_log import read_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Arm:
    """One run of the grid: `mode` is "controlled" or the pause mode of a free-running run;
    `shared`: the synchronous run that is every loss's k = 0."""

    mode: str
    loss: str
    staleness: int
    seed: int
    shared: bool = False

    @property
    def name(self) -> str:
        return f"sync_s{self.seed}" if self.shared else f"{self.mode}_{self.loss}_k{self.staleness}_s{self.seed}"

    @property
    def row(self) -> str:
        return self.loss if self.mode == "controlled" else f"{self.loss}, free, {self.mode}"


def arms(cfg: Config, bench: BenchConfig) -> list[Arm]:
    """Every run of the grid, seed by seed (a partial grid is still a usable table)."""
    shared_sync = cfg.trainer.mini_batches_per_step == 1
    out = []
    for seed in bench.seeds:
        if (shared_sync or not bench.losses) and 0 in bench.staleness:
            out.append(Arm("controlled", cfg.algorithm.loss.type, 0, seed, shared=True))
        for loss in bench.losses:
            out += [Arm("controlled", loss, k, seed) for k in bench.staleness if k or not shared_sync]
        out += [Arm(mode, cfg.algorithm.loss.type, k, seed) for mode in bench.pause_modes
                for k in bench.staleness if k]
    return out


def arm_config(cfg: Config, bench: BenchConfig, arm: Arm, run_dir: Path) -> Config:
    controlled = arm.mode == "controlled"
    algorithm = replace(
        cfg.algorithm, max_staleness=arm.staleness, policy_lag=arm.staleness if controlled else 0,
        partial_rollout=not controlled and arm.staleness > 0, pause_mode=arm.mode if not controlled else "abort",
        loss=replace(cfg.algorithm.loss, type=arm.loss))
    return replace(
        cfg, algorithm=algorithm,
        run=replace(cfg.run, output_dir=str(run_dir), seed=arm.seed, resume_from="", max_train_s=0),
        engine=replace(cfg.engine, seed=arm.seed),
        trainer=replace(cfg.trainer, total_steps=bench.steps, checkpoint_every=0),
        # greedy accuracy is the figure; one sample at T gives pass@1 for little
        # each evaluation measures one policy version exactly: training waits for it
        eval=replace(cfg.eval, every_steps=bench.eval_every, n_samples=1, pass_k=[1], periodic_pass_k=False,
                     beside_training=False),
        logging=replace(cfg.logging, progress_bar=False))


def run_figures(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures from its metrics.jsonl."""
    records = read_metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    curve = sorted({int(r["eval/policy_version"]): r["eval/greedy_accuracy"]
                    for r in records if "eval/greedy_accuracy" in r}.items())

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in train) if train else 0.0

    def hist_mean(key: str) -> float:
        counts: dict[int, int] = {}
        for r in train:
            for b, n in (r.get(key) or {}).items():
                counts[int(b)] = counts.get(int(b), 0) + n
        total = sum(counts.values())
        # a bin's middle stands for its lengths
        return sum((b + LENGTH_BIN_TOKENS / 2) * n for b, n in counts.items()) / total if total else 0.0

    return {"curve": curve, "auc": area_under_curve(curve),
            "mismatch_kl": mean("train/mismatch_kl_mean"), "clip_fraction": mean("train/clip_fraction_mean"),
            "truncated_fraction": mean("train/is_weight_truncated_mean"),
            "staleness_mean": mean("train/staleness_mean"),
            "trained_length": hist_mean("length/trained_hist"), "finished_length": hist_mean("length/finished_hist")}


def area_under_curve(curve: list[tuple[int, float]]) -> float:
    """Mean accuracy over the evaluated policy versions' span: trapezoids between them."""
    if len(curve) < 2:
        return curve[0][1] if curve else 0.0
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in zip(curve, curve[1:]))
    return area / (curve[-1][0] - curve[0][0])


def run_staleness_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from asyncrl.config import validate
    from asyncrl.driver import run_training

    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    grid = arms(cfg, bench)
    for i, arm in enumerate(grid, 1):
        run_dir = root / arm.name
        logger.info("staleness bench: run %d of %d, %s", i, len(grid), arm.name)
        run_cfg = validate(asdict(arm_config(cfg, bench, arm, run_dir)))
        summary = run_training(run_cfg, run_dir)
        results.append({**asdict(arm), **run_figures(run_dir), "base_accuracy": summary["base_accuracy"],
                        "final_accuracy": summary["final_accuracy"], "wall_s": summary["wall_s"]})
        # after every run: a grid stopped early still leaves its table
        (root / "runs.json").write_text(json.dumps(results, indent=1) + "\n")
        (root / "table.md").write_text(markdown_table(results, bench))
        plot = plot_curves(results, root / "accuracy.png")
    final = {row: {k: mean_over_seeds(results, row, k, "final_accuracy") for k in bench.staleness}
             for row in _rows(results)}
    return {"bench": "staleness", "recipe": cfg.recipe.name, "steps": bench.steps, "seeds": bench.seeds,
            "samples_per_run": bench.steps * cfg.algorithm.prompts_per_step * cfg.algorithm.n_samples_per_prompt,
            "final_accuracy": final, "table": str(root / "table.md"), "plot": str(plot), "runs": str(root)}


def _row(r: dict[str, Any]) -> str:
    return Arm(r["mode"], r["loss"], r["staleness"], r["seed"]).row


def _rows(results: list[dict[str, Any]]) -> list[str]:
    """The table's rows; only the synchronous run so far (the grid's first): a row of its own."""
    rows = list(dict.fromkeys(_row(r) for r in results if not r["shared"]))
    if not rows and results:
        return ["synchronous"]
    return rows


def _matching(results: list[dict[str, Any]], row: str, k: int) -> list[dict[str, Any]]:
    """The runs of a table cell; k = 0 of a row is the shared synchronous run, if one ran."""
    own = [r for r in results if not r["shared"] and _row(r) == row and r["staleness"] == k]
    if own or k:
        return own
    return [r for r in results if r["shared"]]


def mean_over_seeds(results: list[dict[str, Any]], row: str, k: int, figure: str) -> float | None:
    runs = _matching(results, row, k)
    return statistics.fmean(r[figure] for r in runs) if runs else None


def markdown_table(results: list[dict[str, Any]], bench: BenchConfig) -> str:
    """Final accuracy and area under the curve per loss x staleness (means over seeds), then
    each cell's mismatch KL, clip / truncation fractions and trained vs finished lengths."""
    ks = sorted({r["staleness"] for r in results})

    def cell(row: str, k: int, figure: str, fmt: str) -> str:
        v = mean_over_seeds(results, row, k, figure)
        return "" if v is None else format(v, fmt)

    head = "| loss | " + " | ".join(f"k={k}" for k in ks) + " |\n|---|" + "---:|" * len(ks) + "\n"
    lines = ["Final held-out greedy accuracy (%), area under the curve in brackets:\n", head]
    for row in _rows(results):
        cells = [f"{cell(row, k, 'final_accuracy', '.1%')[:-1]} ({cell(row, k, 'auc', '.1%')[:-1]})"
                 if mean_over_seeds(results, row, k, "final_accuracy") is not None else "" for k in ks]
        lines.append(f"| {row} | " + " | ".join(cells) + " |\n")
    lines.append("\nPer run (means over steps and seeds): mismatch KL(mu || pi), clipped share, truncated "
                 "importance weights share, staleness, response tokens trained / finished:\n\n")
    lines.append("| loss | k | mismatch KL | clipped | truncated | staleness | length trained / finished |\n"
                 "|---|---:|---:|---:|---:|---:|---:|\n")
    for row in _rows(results):
        for k in ks:
            if mean_over_seeds(results, row, k, "mismatch_kl") is None:
                continue
            figures = [cell(row, k, f, fmt) for f, fmt in (
                ("mismatch_kl", ".2e"), ("clip_fraction", ".3f"), ("truncated_fraction", ".3f"),
                ("staleness_mean", ".2f"))]
            lengths = f"{cell(row, k, 'trained_length', '.1f')} / {cell(row, k, 'finished_length', '.1f')}"
            lines.append(f"| {row} | {k} | " + " | ".join(figures) + f" | {lengths} |\n")
    seeds = len({r["seed"] for r in results})
    lines.append(f"\n{len(results)} runs, {seeds} seed(s), {bench.steps} steps each.\n")
    return "".join(lines)


def plot_curves(results: list[dict[str, Any]], out: Path) -> Path:
    """Accuracy against policy version, one panel per table row, one line per staleness."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(results)
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False, sharey=True)
    for ax, row in zip(axes[0], rows):
        for k in sorted({r["staleness"] for r in results}):
            runs = _matching(results, row, k)
            if not runs:
                continue
            versions = sorted({v for r in runs for v, _ in r["curve"]})
            ys = [statistics.fmean(dict(r["curve"]).get(v, float("nan")) for r in runs) for v in versions]
            ax.plot(versions, [100 * y for y in ys], marker="o", label=f"k={k}")
        ax.set_title(row)
        ax.set_xlabel("policy version (trainer steps)")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("held-out greedy accuracy (%)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out

"""`asyncrl plot RUN_DIR`: PNG curves of a run from its metrics.jsonl.

Writes RUN_DIR/plots.png with a panel each for reward and held-out accuracy, throughput,
staleness, the trainer's and engines' idle ratios and the engines' utilization (mean
requests running over their concurrency: it sees an engine that serves one straggler),
in runs whose loops call tools, the share of tool calls without an error and the errors by
reason, and in runs of MoE models the routers' health: agreement with the engine's routes,
load balance (a panel with nothing to draw is left out).
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncrl.monitoring.run_log import read_metrics

PANELS = (
    ("reward and held-out accuracy",
     (("batch/reward_mean", "train reward"), ("eval/greedy_accuracy", "held-out greedy"))),
    ("throughput", (("throughput/samples_per_s", "samples/s"),)),
    ("staleness (versions)", (("train/staleness_mean", "mean"), ("train/staleness_max", "max"))),
    ("idle and utilization", (("idle/trainer", "trainer idle"), ("idle/engines", "engines idle"),
                              ("util/engines", "engine utilization"))),
    ("tool calls", (("rollout/tool_call_validity", "calls without error (share)"),)),
    ("tool errors so far, by reason", (("rollout/tool_errors/", ""),)),  # a prefix: one line per key
    ("MoE: trainer top-k = engine's (share)", (("moe/router_agreement", "all layers"),)),
    ("MoE load balance (1 = balanced)", (("moe/max_load", "busiest expert / mean"),
                                         ("moe/aux_loss", "aux loss E x sum f P"))),
)


def plot_run(run_dir: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    panels = []  # (title, [(label, xs, ys)]): e.g. no tool panels for a run whose loops call no tools
    for title, series in PANELS:
        lines = []
        for key, label in _expand(series, records):
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            if points:
                lines.append((label, *zip(*points)))
        if lines:
            panels.append((title, lines))
    rows = max(1, -(-len(panels) // 3))
    fig, axes = plt.subplots(rows, 3, figsize=(15, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, (title, lines) in zip(axes.flat, panels):
        for label, xs, ys in lines:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("train step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = run_dir / "plots.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _expand(series: tuple[tuple[str, str], ...], records: list[dict]) -> list[tuple[str, str]]:
    """A key ending in "/" stands for every key of the run that starts with it, labelled by the rest."""
    out = []
    for key, label in series:
        if key.endswith("/"):
            out += [(k, k[len(key):]) for k in sorted({k for r in records for k in r if k.startswith(key)})]
        else:
            out.append((key, label))
    return out


def main() -> None:
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "metrics.jsonl").is_file():
        print("usage: asyncrl plot RUN_DIR   (a run directory holding metrics.jsonl)", file=sys.stderr)
        raise SystemExit(2)
    print(plot_run(sys.argv[1]))


if __name__ == "__main__":
    main()

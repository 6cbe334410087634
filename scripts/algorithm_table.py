"""The comparison of docs/algorithms.md: `asyncrl train` once per advantage/loss and staleness,
held-out greedy accuracy along the way, one seed each.

    python scripts/algorithm_table.py                       # every arm at staleness 0 and 4
    python scripts/algorithm_table.py --arms gae,grpo --staleness 4 --steps 30

Each run is `asyncrl train recipe=<recipe> <the arm's overrides> <the staleness's overrides>
trainer.total_steps=<steps> eval.periodic_pass_k=false run.output_dir=<out>/<arm>_s<staleness>`
(printed before it starts); a run that exists already (its summary.json) is read, not run again.
Prints a Markdown table, then a JSON line with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ARMS = {
    "grpo": ["recipe=arith"],
    "gae": ["recipe=arith", "algorithm.advantage=gae"],
    "rloo": ["recipe=arith", "algorithm.advantage=rloo"],
    "reinforce_pp": ["recipe=arith", "algorithm.advantage=reinforce_pp", "algorithm.loss.filter_uniform_groups=false"],
    "gspo": ["recipe=arith", "algorithm.loss.type=gspo", "algorithm.loss.aggregation=sequence"],
    "cispo": ["recipe=arith", "algorithm.loss.type=cispo"],
    "icepop": ["recipe=arith", "algorithm.loss.type=icepop"],
    "grpo_moe": ["recipe=arith_moe"],
    "gspo_moe": ["recipe=arith_moe", "algorithm.loss.type=gspo", "algorithm.loss.aggregation=sequence"],
}
STALENESS = {
    0: ["algorithm.max_staleness=0", "algorithm.partial_rollout=false"],  # synchronous on-policy
    4: ["algorithm.max_staleness=4"],  # fully asynchronous, partial rollouts
}
QUIET = ["logging.wandb.enabled=false", "logging.progress_bar=false", "cluster.dashboard=false",
         "eval.periodic_pass_k=false"]


def command(arm: str, staleness: int, steps: int, out: Path) -> list[str]:
    return ["asyncrl", "train", *ARMS[arm], *STALENESS[staleness], f"trainer.total_steps={steps}", *QUIET,
            f"run.output_dir={out}"]


def figures(run_dir: Path, wall_s: float | None) -> dict:
    """Accuracy before, at each evaluation beside training (by the step it started at; it measured
    one policy version, which trails the step by the syncs deferred for evaluations), at the end."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = {int(r["eval/started_step"]): r["eval/greedy_accuracy"] for r in records if "eval/started_step" in r}
    staleness = [r["train/staleness_mean"] for r in records if "train/staleness_mean" in r]
    train_s = [r["progress/train_s"] for r in records if "progress/train_s" in r]
    return {"base": summary["base_accuracy"], "curve": dict(sorted(curve.items())), "final": summary["final_accuracy"],
            "steps": summary["steps"], "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "train_s": train_s[-1] if train_s else None, "wall_s": wall_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", default="grpo,gae,rloo,reinforce_pp,gspo,cispo,icepop")
    p.add_argument("--staleness", default="0,4")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="build/algorithms")
    args = p.parse_args()
    results = {}
    for arm in args.arms.split(","):
        for s in (int(x) for x in args.staleness.split(",")):
            out = Path(args.out) / f"{arm}_s{s}"
            wall = None
            if not (out / "summary.json").is_file():
                cmd = command(arm, s, args.steps, out)
                print(" ".join(cmd), flush=True)
                t0 = time.monotonic()
                done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if done.returncode != 0:
                    print(f"{arm} staleness {s}: failed\n{done.stderr[-3000:]}", file=sys.stderr, flush=True)
                    continue
                wall = time.monotonic() - t0
            results[f"{arm}_s{s}"] = figures(out, wall)
    steps = _steps(results)
    # (the runs' seconds are in the JSON line only: on a shared machine they compare nothing)
    print("| arm | staleness | mean staleness | base | " + " | ".join(f"step {v}" for v in steps) + " | final |")
    print("|---|---:|---:|---:|" + "---:|" * len(steps) + "---:|")
    for name, r in results.items():
        arm, s = name.rsplit("_s", 1)
        cells = [f"{100 * r['curve'][v]:.1f}" if v in r["curve"] else "" for v in steps]
        print(f"| {arm} | {s} | {r['staleness_mean']:.2f} | {100 * r['base']:.1f} | " + " | ".join(cells)
              + f" | {100 * r['final']:.1f} |")
    print(json.dumps(results))


def _steps(results: dict) -> list[int]:
    return sorted({v for r in results.values() for v in r["curve"]})


if __name__ == "__main__":
    main()

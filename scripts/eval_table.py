"""The table of docs/evaluation.md from finished runs: per run, the evaluations beside training
(due, run, skipped), the steps each started and was logged at, the versions each spans, their
seconds, the syncs deferred for them, how long training waited, the `eval_overlap` ratio, the
final accuracy. Evaluations are due every 10 steps (eval.every_steps' default), but at the last.

    python scripts/eval_table.py NAME=RUN_DIR [NAME=RUN_DIR ...]     # (split at the last "=")

Prints a Markdown table, then a JSON line with the same figures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def figures(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    cfg = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    every = cfg.get("eval", {}).get("every_steps", 10)
    steps = summary["steps"]
    evals = [r for r in records if r.get("eval/started_step") is not None]
    trained = [r for r in records if "policy/syncs_deferred" in r]
    overlap = summary.get("eval_overlap") or {}
    return {
        "due": sum(1 for s in range(1, steps) if every and s % every == 0),
        "run": len(evals), "skipped": max((r.get("eval/skipped", 0) for r in records), default=0),
        "started_logged": [[int(r["eval/started_step"]), int(r["step"])] for r in evals],
        "versions_spanned": sorted({len(r["eval/sample_versions"]) for r in evals}),
        "seconds": [round(r["eval/seconds"], 1) for r in evals],
        "syncs_deferred": trained[-1]["policy/syncs_deferred"] if trained else 0,
        "waited_s": round(sum(r.get("eval/waited_s", 0.0) for r in records), 3),
        "eval_overlap": round(overlap["ratio"], 2) if overlap else None,
        "final_accuracy": summary["final_accuracy"], "steps": steps,
    }


def main() -> None:
    runs = {name: figures(Path(path)) for name, path in (a.rsplit("=", 1) for a in sys.argv[1:])}
    print("| run | evaluations during training | started -> logged at step | versions each spans | seconds each "
          "| syncs deferred | training waited | `eval_overlap` ratio | final accuracy |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for name, f in runs.items():
        spans = ", ".join(f"{a}->{b}" for a, b in f["started_logged"])
        seconds = f"{min(f['seconds']):.1f}-{max(f['seconds']):.1f}" if f["seconds"] else ""
        print(f"| {name} | {f['run']} of {f['due']} due ({f['skipped']} skipped) | {spans} | "
              f"{'/'.join(map(str, f['versions_spanned']))} | {seconds} | {f['syncs_deferred']} | {f['waited_s']} s | "
              f"{f['eval_overlap']} | {100 * f['final_accuracy']:.1f} % |")
    print(json.dumps(runs))


if __name__ == "__main__":
    main()

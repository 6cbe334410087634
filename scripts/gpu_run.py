"""The JSON line of each part of scripts/gpu_run.sh (the whole run on one GPU), from what the
part left: the training run's summary.json and metrics.jsonl, the benchmark's last line.

    python scripts/gpu_run.py train RUN_DIR MIN_GAIN     # base/final accuracy, prompts lost, trained
                                                         # twice, mismatch KL per step; exit 1 if it fails
    python scripts/gpu_run.py rollout LOG MIN_RATIO      # the bench's figures; exit 1 if below MIN_RATIO
    python scripts/gpu_run.py transport                  # the same-GPU weight transport the installed
                                                         # asyncrl offers: one JSON line

Standard library only: it reads files.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut off when the run died
            continue
    return out


def train_line(run_dir: Path, min_gain: float) -> dict:
    """The training part's figures, and ok: the held-out greedy accuracy rose by at least
    `min_gain` (a fraction), no prompt lost, none trained twice, every step trained."""
    line: dict = {"part": "train", "run_dir": str(run_dir)}
    summary_path = run_dir / "summary.json"
    records = _records(run_dir)
    steps = {}
    for r in records:
        if "train/loss" in r:
            steps[int(r["step"])] = r.get("train/mismatch_kl_mean")
    kl = [steps[s] for s in sorted(steps)]
    line["mismatch_kl_per_step"] = [None if v is None else round(float(v), 6) for v in kl]
    known = [float(v) for v in kl if v is not None]
    line["mismatch_kl_mean"] = statistics.fmean(known) if known else None
    line["eval_curve"] = sorted({(int(r["eval/policy_version"]), round(float(r["eval/greedy_accuracy"]), 4))
                                 for r in records if "eval/greedy_accuracy" in r and "eval/policy_version" in r})
    if not summary_path.is_file():
        line.update(ok=False, error=f"no summary.json in {run_dir}: the run did not finish"
                    + (f" ({len(steps)} steps logged)" if steps else ""))
        return line
    s = json.loads(summary_path.read_text())
    base, final = s.get("base_accuracy"), s.get("final_accuracy")
    lost = (s.get("prompts") or {}).get("lost")
    twice = s.get("prompts_trained_twice")
    line.update(steps=s.get("steps"), base_accuracy=base, final_accuracy=final,
                gain_points=None if base is None or final is None else round(100 * (final - base), 1),
                prompts_lost=lost, prompts_trained_twice=twice, samples=s.get("samples"),
                wall_s=round(s.get("wall_s", 0.0), 1), train_s=round(s.get("train_s", 0.0), 1))
    failures = []
    if base is None or final is None or final - base < min_gain:
        failures.append(f"accuracy rose by less than {100 * min_gain:.0f} points")
    if lost != 0:
        failures.append(f"{lost} prompts lost")
    if twice != 0:
        failures.append(f"{twice} prompts trained twice")
    if line["mismatch_kl_mean"] is None:
        failures.append("no mismatch KL logged")
    line["ok"] = not failures
    if failures:
        line["failed"] = failures
    return line


def rollout_line(log: Path, min_ratio: float) -> dict:
    """The rollout benchmark's last JSON object, and ok: framework / raw vLLM >= min_ratio."""
    line: dict = {"part": "rollout"}
    found = None
    if log.is_file():
        for text in log.read_text(errors="replace").splitlines():
            text = text.strip()
            if text.startswith("{") and '"bench"' in text:
                try:
                    found = json.loads(text)
                except ValueError:
                    continue
    if found is None:
        line.update(ok=False, error=f"no benchmark line in {log}")
        return line
    line.update({k: found[k] for k in ("raw_tok_s", "framework_tok_s", "ratio", "pause_resume_s") if k in found})
    line["bench"] = found
    ratio = found.get("ratio")
    line["ok"] = isinstance(ratio, (int, float)) and ratio >= min_ratio
    if not line["ok"]:
        line["failed"] = [f"framework / raw vLLM {ratio} < {min_ratio}"]
    return line


def transport() -> dict:
    """Which weight transport the installed asyncrl has for an engine on trainer rank 0's GPU:
    the config key, its values, and whether one of them moves weights within a GPU (CUDA IPC;
    NCCL refuses two ranks on one device, so the broadcast cannot)."""
    import dataclasses

    from asyncrl.config import schema

    fields = {f.name for f in dataclasses.fields(schema.TrainerConfig)}
    shared: list[str] = []
    try:
        from asyncrl.sync import shared_buckets

        shared = list(getattr(shared_buckets, "SHARED", ()))
    except Exception:  # not there yet, or it needs what is not installed here
        pass
    key = "weight_sync_transport" in fields
    return {"key": "trainer.weight_sync_transport" if key else None,
            "values": list(getattr(schema, "WEIGHT_SYNC_TRANSPORTS", ())), "shared": shared,
            "same_gpu": key and "cuda_ipc" in shared}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    if argv[0] == "train":
        line = train_line(Path(argv[1]), float(argv[2]))
    elif argv[0] == "rollout":
        line = rollout_line(Path(argv[1]), float(argv[2]))
    elif argv[0] == "transport":
        print(json.dumps(transport()))
        return 0
    else:
        print(f"gpu_run.py: unknown part {argv[0]!r}", file=sys.stderr)
        return 2
    print(json.dumps(line), flush=True)
    return 0 if line["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

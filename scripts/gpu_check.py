"""The GPU path in one run, for a bare GPU machine (scripts/gpu_check.sh installs what it lacks first;
docs/gpu.md records what it printed). Prints one JSON line and exits 1 if any part failed:

  step       a megatron-core train step of the tiny model (recipes/arith/base_model) with the
             project's loss, in bf16 on CUDA (trainer=megatron_gpu: Transformer Engine layers if
             installed, local ones otherwise), against the same step in fp32 on CPU: the loss and
             the gradient norm agree within STEP_TOLERANCE (each side in a process of its own: one
             torch.distributed world each);
  export     the trainer's HF export from the GPU, before the step: every tensor equals the HF
             checkpoint's rounded to bf16 (mbridge's gather and renaming, exact);
  broadcast  the weight broadcast's GPU path: the trainer's buckets packed on the GPU, sent through
             the cupy NCCL backend (asyncrl.sync.collective.CupyNcclGroup) with the trainer's own
             `broadcast_weights`, and each tensor's checksum taken from the packed buckets on the GPU
             (`bucket_checksums`' running sum) equal to the one taken as it was packed. With one GPU
             the communicator has one rank; with two or more, a second process receives on the
             second GPU (`receive_buckets`) and its checksums must equal the sender's.

    python scripts/gpu_check.py                   # everything (needs a CUDA device)
    python scripts/gpu_check.py --step cpu        # one part alone: the fp32 CPU step, as JSON
    python scripts/gpu_check.py --scale           # the trainer at real sizes: `asyncrl bench trainer` on
                                                  # random Qwen3-0.6B and -1.7B shapes at 1K and 16K tokens
                                                  # (SCALE_CASES), one JSON line each, then a summary line
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# bf16 against fp32 on one step of the tiny model. The policy loss sums terms of both signs
# (advantages +-1), so its relative error is far above a token's: the same step in bf16 on CPU
# (same packed attention) gave 0.3335 against fp32's 0.3478, 4.1 %. Its per-token logprobs were
# off by 0.029 on average (|logp| 4.0), 0.079 at most. A broken path (a sequence seeing another or
# its future, a wrong layout or scale, garbage weights) is off by far more, per token above all.
STEP_TOLERANCE = {"loss": 0.05, "grad_norm": 0.05}  # relative
LOGPROB_TOLERANCE = {"mean": 0.05, "max": 0.25}  # absolute, per response token, before the step
STEP_TIMEOUT_S = 240


def overrides(device: str) -> list[str]:
    """The same trainer settings on both devices; only the device (and so the dtype) differs."""
    # the trainer reads no data here (fixed_groups feeds it): a one-row file keeps validation from
    # needing reasoning-gym, which the bare GPU machine lacks
    rows = Path(tempfile.gettempdir()) / "asyncrl-gpu-check.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    return ["recipe=arith", "trainer=megatron_gpu", f"cluster.device={device}", "trainer.micro_batch_size=4",
            "data.source=file", f"data.path={rows}", "data.prompt_template='{question}'"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_trainer(device: str):
    from asyncrl.config import compose, validate
    from asyncrl.sync.group_store import new_group_secret
    from asyncrl.trainer.settings import TrainerSettings
    from asyncrl.trainer.trainer_rank import TrainerRank

    cfg = validate(compose(overrides(device)))
    rank = TrainerRank(TrainerSettings.of(cfg), 0, 1)
    rank.setup("127.0.0.1", free_port(), new_group_secret())  # rank 0 of 1 binds its world's store itself
    return cfg, rank


def fixed_groups(model_path: str) -> list:
    from transformers import AutoTokenizer

    from tests.trainer_data import make_groups

    return make_groups(AutoTokenizer.from_pretrained(model_path), n_groups=4, n=4, seed=0)


def run_step(device: str, checks: bool) -> dict[str, Any]:
    """One train step on `device`; with `checks`, the export check before it and the broadcast
    check after it (on CPU they run with gloo: the harness's own test, tests/test_gpu_check.py)."""
    import torch

    from asyncrl.sync.collective import broadcast_backend

    cfg, rank = build_trainer(device)
    out: dict[str, Any] = {"device": device, "dtype": str(rank.dtype).removeprefix("torch."),
                           "transformer_engine": bool(getattr(rank, "use_te", False))}
    if checks:
        out["export"] = check_export(rank, cfg.model.path)
    groups = fixed_groups(cfg.model.path)
    out["logprobs"] = logprobs(rank, groups, cfg)
    result = rank.train_step(groups, policy_version=0)
    out["loss"] = float(result.metrics["train/loss"])
    out["grad_norm"] = float(result.metrics["train/grad_norm"])
    if checks:
        out["broadcast"] = check_broadcast_one_rank(rank, broadcast_backend(device))
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    rank.shutdown()
    return out


def logprobs(rank, groups: list, cfg) -> list[float]:
    """The trainer's logprob of every response token of `groups`, packed as a train step packs them."""
    import torch

    from asyncrl.algorithm.plan import AdvantagePlan
    from asyncrl.trainer.batch import build_samples

    samples = build_samples(groups, AdvantagePlan.of(cfg.algorithm)).samples
    batches = [b for update in rank._packed_updates(samples) for b in update]
    return torch.cat([rank._logprobs(rank.model, b) for b in batches]).tolist()


def check_export(rank, model_path: str) -> dict[str, Any]:
    """The HF export before any step: each tensor is the checkpoint's, rounded to the trainer's dtype."""
    import safetensors.torch

    original: dict = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        original.update(safetensors.torch.load_file(f))
    with tempfile.TemporaryDirectory() as d:
        rank.export_hf(d)
        exported: dict = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            exported.update(safetensors.torch.load_file(f))
    missing = sorted(set(original) - set(exported))
    extra = sorted(set(exported) - set(original))
    diffs = {n: float((exported[n].float() - original[n].to(exported[n].dtype).float()).abs().max())
             for n in original if n in exported and exported[n].shape == original[n].shape}
    shapes = [n for n in original if n in exported and exported[n].shape != original[n].shape]
    ok = not missing and not extra and not shapes and max(diffs.values(), default=1.0) == 0.0
    return {"ok": ok, "tensors": len(exported), "max_abs_diff": max(diffs.values(), default=None),
            "missing": missing[:5], "extra": extra[:5], "wrong_shape": shapes[:5]}


def check_broadcast_one_rank(rank, backend: str) -> dict[str, Any]:
    """Pack on the trainer's device, send through a one-rank group of `backend` (the trainer's own
    calls; on CUDA the cupy communicator), and checksum the packed buckets on that device against
    the checksums taken while packing."""
    import torch

    from asyncrl.sync.collective import CupyNcclGroup, bucket_checksums
    from asyncrl.sync.group_store import new_group_secret

    rank.init_weight_group("127.0.0.1", free_port(), 1, backend, new_group_secret())
    group = rank._weight_group
    staged = rank.stage_weights(version=1)
    buffers = list(rank._staged)  # broadcast_weights lets go of them
    seconds = rank.broadcast_weights()
    received: dict[str, int] = {}
    for buffer, bucket in zip(buffers, rank.plan.buckets):
        scratch = torch.empty(buffer.numel() // 8 + 1, dtype=torch.int64, device=buffer.device)
        received.update(zip((s.name for s in bucket), bucket_checksums(buffer, bucket, scratch)))
    bad = [n for n, c in staged.checksums.items() if received.get(n) != c]
    right_group = isinstance(group, CupyNcclGroup) == (backend == "cupy")
    if isinstance(group, CupyNcclGroup):
        group.close()
    return {"ok": not bad and len(received) == len(staged.checksums) and right_group,
            "backend": backend, "group": type(group).__name__, "ranks": 1, "buckets": len(buffers),
            "bytes": int(sum(b.numel() for b in buffers)), "seconds": round(seconds, 4), "mismatched": bad[:5]}


# -- two GPUs: a real broadcast between processes ----------------------------------------------

def two_gpu_member(rank: int, port: int, specs: list, result_path: str) -> None:
    """Rank 0 packs seeded tensors on cuda:0 and sends; rank 1 receives on cuda:1 into reused
    buffers; each writes its per-tensor checksums."""
    import torch

    from asyncrl.sync.collective import (
        BucketPlan,
        ReceiveBuffers,
        byte_checksum,
        create_group,
        pack_buckets,
        receive_buckets,
        send_buckets,
    )

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    plan = BucketPlan.build(specs, bucket_bytes=1 << 20, alone_bytes=1 << 19)
    group = create_group("127.0.0.1", port, rank, 2, "cupy", os.environ[GROUP_SECRET_ENV], timeout_s=120)
    sums: dict[str, int] = {}
    if rank == 0:
        gen = torch.Generator(device="cpu").manual_seed(0)
        tensors = [(n, torch.randn(shape, generator=gen).to(device)) for n, _, shape in specs]
        sums = {n: byte_checksum(t) for n, t in tensors}
        send_buckets(group, pack_buckets(plan, tensors, device))
    else:
        for tensors, _, bucket_sums in receive_buckets(group, plan, device, ReceiveBuffers(device)):
            sums.update(zip((n for n, _ in tensors), bucket_sums))
    torch.cuda.synchronize()
    group.close()
    Path(result_path).write_text(json.dumps(sums))


GROUP_SECRET_ENV = "ASYNCRL_GPU_CHECK_GROUP_SECRET"


def check_broadcast_two_gpus() -> dict[str, Any]:
    specs = [(f"t{i}", "float32", [257, 129 + i]) for i in range(12)] + [("big", "float32", [1024, 1024])]
    from asyncrl.sync.group_store import new_group_secret

    port = free_port()
    env = {**os.environ, GROUP_SECRET_ENV: new_group_secret()}  # the group's secret, not on a command line
    with tempfile.TemporaryDirectory() as d:
        procs = [subprocess.Popen([sys.executable, __file__, "--two-gpu-member", str(r), str(port), f"{d}/{r}.json",
                                   json.dumps(specs)], env=env) for r in (0, 1)]
        codes = [p.wait(timeout=STEP_TIMEOUT_S) for p in procs]
        if any(codes):
            return {"ok": False, "ranks": 2, "exit_codes": codes}
        sent, got = (json.loads(Path(f"{d}/{r}.json").read_text()) for r in (0, 1))
    bad = [n for n in sent if got.get(n) != sent[n]]
    return {"ok": not bad and len(sent) == len(specs), "ranks": 2, "tensors": len(sent), "mismatched": bad[:5]}


# -- the trainer at real sizes -------------------------------------------------------------------

# (shape, tokens per trajectory, groups, trajectories per group, timed steps), most wanted first
SCALE_CASES = [
    ("qwen3_1.7b", 1024, 16, 8, 2),
    ("qwen3_0.6b", 16384, 1, 8, 2),
    ("qwen3_0.6b", 1024, 16, 8, 2),
    ("qwen3_1.7b", 16384, 1, 8, 2),
]
SCALE_CASE_TIMEOUT_S = 150
SCALE_BUDGET_S = 470  # a case starts only with at least a minute of this left
# What the trainer-scale issue asks of the H200 (docs/trainer.md): MFU of 1.7B at 1K, tokens/s of
# 0.6B at 16K, weight staging GB/s of 1.7B.
SCALE_TARGETS = {"mfu_1.7b_1k": 0.35, "tokens_per_s_0.6b_16k": 12000.0, "staging_gb_per_s_1.7b": 100.0}


def run_scale_case(shape: str, seq_len: int, groups: int, n: int, steps: int, device: str) -> dict[str, Any]:
    from asyncrl.bench.config import BenchConfig
    from asyncrl.bench.trainer import run_trainer_bench
    from asyncrl.config import compose, validate

    cfg = validate(compose([o for o in overrides(device) if not o.startswith("trainer.micro_batch_size")]))
    bench = BenchConfig(model_shape=shape, seq_len=seq_len, train_groups=groups, n_samples=n, trainer_steps=steps)
    return run_trainer_bench(cfg, bench)


def main_scale(device: str, only: list[str] | None = None) -> int:
    t0 = time.monotonic()
    results = {}
    for shape, seq_len, groups, n, steps in SCALE_CASES:
        key = f"{shape.removeprefix('qwen3_')}_{seq_len // 1024}k"
        if only and key not in only:
            continue
        argv = ["--scale-case", shape, str(seq_len), str(groups), str(n), str(steps), device]
        left = SCALE_BUDGET_S - (time.monotonic() - t0)
        if left < 60:
            results[key] = {"error": f"not run: {left:.0f} s of the {SCALE_BUDGET_S} s budget left"}
        else:
            results[key] = run_part(argv, timeout_s=min(SCALE_CASE_TIMEOUT_S, left))
        print(json.dumps({"case": key, **results[key]}), flush=True)
    got = {"mfu_1.7b_1k": results.get("1.7b_1k", {}).get("mfu_measured_peak"),  # the target: vs the measured peak
           "tokens_per_s_0.6b_16k": results.get("0.6b_16k", {}).get("tokens_per_s"),
           "staging_gb_per_s_1.7b": results.get("1.7b_1k", {}).get("staging_gb_per_s")}
    met = {k: (v is not None and v >= SCALE_TARGETS[k]) for k, v in got.items()}
    print(json.dumps({"check": "gpu_scale", "commit": _commit(), "targets": SCALE_TARGETS, "got": got, "met": met,
                      "seconds": round(time.monotonic() - t0, 1)}))
    return 0 if all("error" not in r for r in results.values()) else 1


# -- the whole check ---------------------------------------------------------------------------

def compare_steps(cpu: dict[str, Any], gpu: dict[str, Any]) -> dict[str, Any]:
    """The step part's verdict: relative differences of loss and gradient norm against the tolerances."""
    out: dict[str, Any] = {"tolerance": STEP_TOLERANCE}
    ok = True
    for key, tol in STEP_TOLERANCE.items():
        a, b = cpu.get(key), gpu.get(key)
        if not isinstance(a, float) or not isinstance(b, float) or a != a or b != b:
            out[f"{key}_rel_diff"] = None
            ok = False
            continue
        rel = abs(a - b) / max(abs(a), 1e-12)
        out[f"{key}_rel_diff"] = rel
        ok = ok and rel <= tol
    a, b = cpu.get("logprobs"), gpu.get("logprobs")
    if a is not None or b is not None:  # per token, where both sides report them
        if not a or not b or len(a) != len(b):
            out["logprob_abs_diff"] = None
            ok = False
        else:
            diffs = [abs(x - y) for x, y in zip(a, b)]
            mean, top = sum(diffs) / len(diffs), max(diffs)
            out["logprob_abs_diff"] = {"mean": mean, "max": top, "tokens": len(diffs),
                                       "tolerance": LOGPROB_TOLERANCE}
            ok = ok and mean <= LOGPROB_TOLERANCE["mean"] and top <= LOGPROB_TOLERANCE["max"]
    out["ok"] = ok
    return out


def run_part(argv: list[str], timeout_s: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    """Run `gpu_check.py argv` in a process of its own; its last stdout line is its JSON."""
    try:
        done = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                              timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"{' '.join(argv)}: no result within {timeout_s}s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-8:]
        return {"error": f"{' '.join(argv)}: exit {done.returncode}", "stderr_tail": tail}
    return json.loads(lines[-1])


def verdict(parts: dict[str, Any]) -> bool:
    """Every part ran and held; a part missing or in error fails the check (never a skip)."""
    needed = ("step", "export", "broadcast")
    return all(isinstance(parts.get(k), dict) and parts[k].get("ok") is True for k in needed) and \
        all(p.get("ok") is True for k, p in parts.items() if isinstance(p, dict) and "ok" in p)


def main_check() -> int:
    import torch

    t0 = time.monotonic()
    report: dict[str, Any] = {"check": "gpu", "python": platform.python_version(), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "commit": _commit()}
    try:
        import cupy

        report["cupy"] = cupy.__version__
    except ImportError as e:
        report["cupy"] = f"missing: {e}"
    if not torch.cuda.is_available():
        report.update(ok=False, error="no CUDA device visible: this check runs on a GPU machine")
        print(json.dumps(report))
        return 1
    report["gpus"] = torch.cuda.device_count()
    gpu = run_part(["--step", "cuda"])
    cpu = run_part(["--step", "cpu"])
    parts: dict[str, Any] = {}
    if "error" in gpu or "error" in cpu:
        parts["step"] = {"ok": False, "cuda": gpu, "cpu": cpu}
    else:
        parts["step"] = {**compare_steps(cpu, gpu), "loss": {"cpu_fp32": cpu["loss"], "cuda_bf16": gpu["loss"]},
                         "grad_norm": {"cpu_fp32": cpu["grad_norm"], "cuda_bf16": gpu["grad_norm"]},
                         "transformer_engine": gpu.get("transformer_engine")}
        report["gpu_name"] = gpu.get("gpu")
    parts["export"] = gpu.get("export", {"ok": False, "error": "the CUDA step did not get to it"})
    parts["broadcast"] = gpu.get("broadcast", {"ok": False, "error": "the CUDA step did not get to it"})
    if report["gpus"] >= 2:
        parts["broadcast_two_gpus"] = check_broadcast_two_gpus()
    report.update(parts)
    report["ok"] = verdict(parts)
    report["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


def _commit() -> str:
    # "-dirty" when the tree is not its HEAD's (a copied working tree: name the commit it matches)
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=REPO).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", choices=["cpu", "cuda"], help="run one side's train step and print its JSON")
    parser.add_argument("--checks", action="store_true", help="with --step cpu: the export and broadcast checks too "
                        "(gloo; on cuda they always run)")
    parser.add_argument("--two-gpu-member", nargs=4, metavar=("RANK", "PORT", "RESULT", "SPECS"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--scale", nargs="?", const="cuda", choices=["cuda", "cpu"],
                        help="the trainer at real sizes (SCALE_CASES), on cuda unless given")
    parser.add_argument("--cases", help="with --scale: only these cases, e.g. 1.7b_1k,0.6b_16k")
    parser.add_argument("--scale-case", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.scale:
        return main_scale(args.scale, args.cases.split(",") if args.cases else None)
    if args.scale_case:
        shape, seq_len, groups, n, steps, device = args.scale_case
        try:
            print(json.dumps(run_scale_case(shape, int(seq_len), int(groups), int(n), int(steps), device)))
        except Exception:  # noqa: BLE001  (the parent reports the tail of this)
            traceback.print_exc()
            return 1
        return 0
    if args.two_gpu_member:
        rank, port, result, specs = args.two_gpu_member
        two_gpu_member(int(rank), int(port), json.loads(specs), result)
        return 0
    if args.step:
        try:
            print(json.dumps(run_step(args.step, checks=args.checks or args.step == "cuda")))
        except Exception:  # noqa: BLE001  (the parent reports the tail of this)
            traceback.print_exc()
            return 1
        return 0
    return main_check()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())

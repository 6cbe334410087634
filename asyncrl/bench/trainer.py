"""`asyncrl bench trainer`: the trainer alone at a model size, against the device's own matmul peak
and its rated one.

    asyncrl bench trainer recipe=arith bench.model_shape=tiny bench.seq_len=1024
    asyncrl bench trainer recipe=arith trainer=megatron_gpu cluster.device=cuda \
        bench.model_shape=qwen3_1.7b bench.seq_len=1024 bench.train_groups=16

Builds a random model of the shape (HF's own Qwen3 config class, saved as a checkpoint the
trainer loads through mbridge as any other), then trains `bench.trainer_steps` steps (after one
untimed warm-up step) on synthetic groups of `bench.train_groups` x `bench.n_samples`
trajectories of `bench.seq_len` tokens (prompt 1/8, response 7/8) with the project's own
`TrainerRank` and loss, in this process (one rank; no Ray). Prints:

    tokens_per_s     tokens trained per second of train step (median step)
    model_tflops     training FLOPs per second: 6 x matmul parameters (output layer included) per
                     token, plus causal attention 6 x layers x (heads x head_dim) x seq_len per token
                     (QK^T and AV, 2 FLOPs a multiply-add, x3 for forward and backward, a token
                     attending to seq_len / 2 positions on average)
    measured_peak_tflops  a plain matmul on the same device in the same run (bf16 8192^3 on CUDA,
                     fp32 2048^3 on CPU): the baseline this machine reaches
    mfu_measured_peak     model_tflops / measured_peak_tflops
    rated_peak_tflops     the device's rated dense bf16 peak from its datasheet (RATED_BF16_DENSE;
                     rated_peak_source names it; null for a device not listed, and on CPU)
    mfu_rated_peak        model_tflops / rated_peak_tflops: the figure peers publish as MFU
    peak_memory_gb   CUDA: max allocated by torch; CPU: the process's peak RSS
    host_share       CUDA: the share of a step in which the GPU ran no kernel (host work, launches,
                     synchronisations): 1 - (kernel time of a profiled step) / (median unprofiled
                     step); null on CPU. host_top_ms: the profiled step's host operations by CPU time
    staging_gb_per_s the weights packed into broadcast buckets with their checksums (`stage_weights`)
"""

from __future__ import annotations

import dataclasses
import logging
import random
import resource
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncrl.bench.config import SHAPES, BenchConfig
from asyncrl.config.schema import Config
from asyncrl.types import Segment, Trajectory, TrajectoryGroup

logger = logging.getLogger(__name__)

# Qwen3's published shapes (config.json of Qwen/Qwen3-*), and a tiny one for CPU tests.


def build_random_model(shape: str, out_dir: str, seq_len: int) -> Path:
    """A random Qwen3 checkpoint of `shape` in `out_dir` (bf16; built on the GPU where there is one)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    hf_config = Qwen3Config(**SHAPES[shape], max_position_embeddings=max(4096, seq_len), rope_theta=1e6,
                      torch_dtype="bfloat16")
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)
    del model
    return Path(out_dir)


def synthetic_groups(n_groups: int, n: int, seq_len: int, vocab: int, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of `n` trajectories of `seq_len` random tokens each; rewards alternate (no group is uniform)."""
    rng = random.Random(seed)
    prompt_len = max(1, seq_len // 8)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        trajs = []
        for i in range(n):
            response = [rng.randrange(vocab) for _ in range(seq_len - prompt_len)]
            trajs.append(Trajectory(prompt_id=f"p{g}", group_id=f"g{g}", prompt_token_ids=prompt,
                                    segments=[Segment.from_policy(response, [-2.0] * len(response), 0)],
                                    reward=float(i % 2)))
        groups.append(TrajectoryGroup(f"g{g}", f"p{g}", trajs))
    return groups


def flops_per_token(shape: dict[str, Any], seq_len: int) -> float:
    """Training FLOPs per token (the formula in the module docstring)."""
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    d = shape["head_dim"]
    attn_params = h * d * (shape["num_attention_heads"] * 2 + shape["num_key_value_heads"] * 2)  # q, o, k, v
    matmul_params = layers * (attn_params + 3 * h * f) + h * shape["vocab_size"]
    return 6.0 * matmul_params + 6.0 * layers * shape["num_attention_heads"] * d * seq_len


# Rated dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, by a marker in torch's device name; the
# first marker found wins (PCIe and NVL before the SXM H100).
RATED_BF16_DENSE: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756.0, "NVIDIA H100 datasheet, PCIe: 1,513 TFLOPS bf16 with sparsity, 756 dense"),
    ("H100 NVL", 835.0, "NVIDIA H100 datasheet, NVL: 1,671 TFLOPS bf16 with sparsity, 835 dense"),
    ("H100", 989.0, "NVIDIA H100 datasheet, SXM: 1,979 TFLOPS bf16 with sparsity, 989 dense"),
    ("H200", 989.0, "NVIDIA H200 datasheet: 1,979 TFLOPS bf16 with sparsity, 989 dense"),
    ("A100", 312.0, "NVIDIA A100 datasheet: 624 TFLOPS bf16 with sparsity, 312 dense"),
    ("L40S", 362.0, "NVIDIA L40S datasheet: 733 TFLOPS bf16 with sparsity, 362 dense"),
)


def rated_peak(device_name: str) -> tuple[float | None, str]:
    """The device's rated dense bf16 peak (TFLOP/s) and where the figure comes from."""
    for marker, tflops, source in RATED_BF16_DENSE:
        if marker in device_name:
            return tflops, source
    return None, f"no rated bf16 figure listed for {device_name!r} (asyncrl/bench/trainer.py RATED_BF16_DENSE)"


def matmul_peak_tflops(device: torch.device) -> float:
    """A plain matmul's FLOP rate on `device` (bf16 8192^3 on CUDA, fp32 2048^3 on CPU), best of a few."""
    n, dtype, reps = (8192, torch.bfloat16, 20) if device.type == "cuda" else (2048, torch.float32, 3)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(3):
        a @ b
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * n**3 / best / 1e12


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gpu_busy_profile(rank, groups: list, version: int) -> tuple[float, list[list]]:
    """One profiled train step: the seconds in which at least one CUDA kernel ran, and the host
    operations that took the most CPU time of their own ([name, ms], a diagnosis of host work)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        rank.train_step(groups, version)
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")  # the union of the kernels' intervals (streams may overlap)
    for start, stop in kernels:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:10]
    return busy / 1e6, [[e.key, round(e.self_cpu_time_total / 1e3, 1)] for e in host]


def run_trainer_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from asyncrl.sync.group_store import new_group_secret
    from asyncrl.trainer.settings import TrainerSettings
    from asyncrl.trainer.trainer_rank import TrainerRank

    shape = SHAPES[bench.model_shape]
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-trainer-") as tmp:
        t0 = time.monotonic()
        path = build_random_model(bench.model_shape, tmp, bench.seq_len)
        build_s = time.monotonic() - t0
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(path), tokenizer_path=""))
        rank = TrainerRank(TrainerSettings.of(cfg), 0, 1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        info = rank.setup("127.0.0.1", port, new_group_secret())  # rank 0 of 1 binds its world's store itself
        device = rank.device
        groups = synthetic_groups(bench.train_groups, bench.n_samples, bench.seq_len, shape["vocab_size"])
        tokens_per_step = bench.train_groups * bench.n_samples * bench.seq_len
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rank.train_step(groups, 0)  # warm-up: allocator, kernels' first use
        steps = []
        for v in range(bench.trainer_steps):
            _sync(device)
            t = time.perf_counter()
            metrics = rank.train_step(groups, v + 1).metrics
            _sync(device)
            steps.append(time.perf_counter() - t)
        peak_mem = (torch.cuda.max_memory_allocated() if device.type == "cuda"
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        host_share, host_top = None, None
        if device.type == "cuda":
            try:
                busy_s, host_top = gpu_busy_profile(rank, groups, bench.trainer_steps + 1)
                # the kernels' time against an unprofiled step's wall time (profiling slows the host)
                host_share = max(0.0, 1.0 - busy_s / statistics.median(steps))
            except Exception as e:  # noqa: BLE001  (a profiler that cannot run costs this figure, not the bench)
                logger.warning("host share not measured: the profiled step failed: %s", e)
        staging = []
        for v in range(3):
            _sync(device)
            t = time.perf_counter()
            rank.stage_weights(100 + v)
            _sync(device)
            staging.append(time.perf_counter() - t)
        rank._staged = None
        rank.shutdown()
    step_s = statistics.median(steps)
    tokens_per_s = tokens_per_step / step_s
    tflops = tokens_per_s * flops_per_token(shape, bench.seq_len) / 1e12
    peak = matmul_peak_tflops(device)
    name = _device_name(device)
    rated, rated_source = rated_peak(name) if device.type == "cuda" else (None, "none for CPUs")
    from asyncrl.trainer.attention import varlen_kernel

    return {
        "bench": "trainer", "model_shape": bench.model_shape, "device": name,
        "dtype": str(rank.dtype).removeprefix("torch."), "seq_len": bench.seq_len,
        "trajectories": bench.train_groups * bench.n_samples, "tokens_per_step": tokens_per_step,
        "max_tokens_per_micro_batch": cfg.trainer.max_tokens_per_micro_batch, "recompute": cfg.trainer.recompute,
        "attention": ("transformer_engine" if info.transformer_engine
                      else varlen_kernel() if device.type == "cuda" else "sdpa"),
        "params": info.params_this_rank, "step_s": [round(s, 3) for s in steps],
        "tokens_per_s": round(tokens_per_s, 1), "model_tflops": round(tflops, 2),
        "measured_peak_tflops": round(peak, 2), "mfu_measured_peak": round(tflops / peak, 4),
        "rated_peak_tflops": rated, "rated_peak_source": rated_source,
        "mfu_rated_peak": None if rated is None else round(tflops / rated, 4),
        "peak_memory_gb": round(peak_mem / 2**30, 2),
        "host_share": None if host_share is None else round(host_share, 4), "host_top_ms": host_top,
        "staging_gb_per_s": round(info.weight_bytes / min(staging) / 1e9, 2),
        "weight_gb": round(info.weight_bytes / 1e9, 3),
        "loss": metrics["train/loss"], "model_build_s": round(build_s, 1),
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"

"""Every workaround that lets megatron-core 0.16 and mbridge train on a CPU with gloo.

megatron-core assumes CUDA in a handful of places. `apply_cpu_patches()` replaces each
of them, once per process, and only when the trainer runs on CPU; on GPUs nothing here
runs. Each patch says in one line what it fixes. What cannot work on CPU at all (the
distributed optimizer, sequence parallelism, Transformer Engine layers) is refused by
config validation instead of being patched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_applied = False


class CpuRNGStatesTracker:
    """Megatron's model-parallel RNG tracker, backed by the CPU generator.

    Megatron forks named RNG states around dropout and weight init (`tracker.fork()`);
    its own tracker stores CUDA generator states. This one swaps the CPU state instead.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} or seed {seed} already added")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def seed_cpu_model_parallel_rng(seed: int, tp_rank: int, ep_rank: int = 0) -> None:
    """The CPU twin of megatron's `model_parallel_cuda_manual_seed` (which asserts CUDA)."""
    from megatron.core.tensor_parallel import random as mp_random

    tracker = CpuRNGStatesTracker()
    # Same seed offsets as megatron: TP ranks differ, DP ranks share the data-parallel seed.
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + tp_rank)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    torch.manual_seed(seed)


def _grad_norm_fp32_cpu(grads_for_norm, norm_type=2, grad_stats_parallel_group=None) -> float:
    if isinstance(grads_for_norm, torch.Tensor):
        grads_for_norm = [grads_for_norm]
    norm_type = float(norm_type)
    if norm_type == float("inf"):
        total = torch.tensor([max((g.abs().max().item() for g in grads_for_norm), default=0.0)])
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=grad_stats_parallel_group)
        return total.item()
    total = torch.zeros(1)
    for g in grads_for_norm:
        total += torch.linalg.vector_norm(g.float(), norm_type) ** norm_type
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=grad_stats_parallel_group)
    return total.item() ** (1.0 / norm_type)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False) -> None:
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    for p in parameters:
        grad = p.decoupled_grad if use_decoupled_grad else p.grad
        if grad is not None:
            grad.detach().mul_(clip_coeff)


class _TorchOnCpu:
    """The torch module, except that factories asked for device="cuda" allocate on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


def apply_cpu_patches() -> None:
    """Patch megatron-core (and mbridge) for CPU training. Idempotent; call before building the model."""
    global _applied
    if _applied:
        return
    import megatron.core.optimizer.optimizer as mcore_optimizer
    import megatron.core.pipeline_parallel.schedules as mcore_schedules
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    # RoPE, grad buffers, GlobalMemoryBuffer, attention masks and mbridge allocate on
    # torch.cuda.current_device(): on a CPU trainer that device is the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing and the schedules synchronize CUDA streams: nothing to wait for on CPU.
    torch.cuda.synchronize = lambda device=None: None

    def fp32_optimizer_init(self, optimizer, config, init_state_fn):
        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.tensor([1.0])
        self.is_stub_optimizer = optimizer is None

    # FP32Optimizer builds its loss-scale tensor with device='cuda'.
    FP32Optimizer.__init__ = fp32_optimizer_init
    # Grad-norm and clipping use apex/TE multi-tensor kernels on CUDA tensors (and assert CUDA types).
    mcore_optimizer.get_grad_norm_fp32 = _grad_norm_fp32_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    # The schedules count tokens in torch.zeros(..., device="cuda").
    mcore_schedules.torch = _TorchOnCpu()
    _applied = True

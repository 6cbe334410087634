"""Every workaround that lets megatron-core 0.16 and mbridge train on a CPU with gloo.

megatron-core assumes CUDA in a handful of places. `apply_cpu_patches()` replaces each
of them, once per process, and only when the trainer runs on CPU; on GPUs nothing here
runs. Each patch says in one line what it fixes and the version it was checked
against (`CHECKED_VERSIONS`; tests/test_compat.py fails on any other, and checks that
every name in `PRIVATE_NAMES`, `SOURCE_FACTS` and `REPLACEMENTS` is still there). What
cannot work on CPU at all (the distributed optimizer, sequence parallelism, Transformer
Engine layers) is refused by config validation instead of being patched.

`mla_without_te` runs wherever megatron's local layers are built (no Transformer Engine) for a
model with multi-head latent attention: its gaps are TE's absence, not the CPU's.

One private hook here runs on every device: `dist_checkpoint_reader`, through which
asyncrl/trainer/safe_dist_checkpoint.py gives megatron's checkpoint loader a reader that never
runs a general unpickler (docs/security.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

CHECKED_VERSIONS = {"megatron-core": "0.16.1"}

# The megatron-core names patched or read here, as (module, attribute path).
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("megatron.core.tensor_parallel.random", "_MODEL_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.tensor_parallel.random", "_DATA_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.tensor_parallel.random", "_EXPERT_PARALLEL_RNG_TRACKER_NAME"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED"),
    ("megatron.core.optimizer.optimizer", "MegatronOptimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__"),
    ("megatron.core.optimizer.optimizer", "get_grad_norm_fp32"),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32"),
    ("megatron.core.pipeline_parallel.schedules", "torch"),
    ("megatron.core.dist_checkpointing.strategies.torch", "_get_filesystem_reader"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize"),
    ("megatron.core.tensor_parallel.random", "_get_all_rng_states"),
    ("megatron.core.tensor_parallel.random", "_set_all_rng_states"),
    ("megatron.core.transformer.multi_latent_attention", "HAVE_TE"),
    ("megatron.core.transformer.multi_latent_attention", "gather_from_tensor_model_parallel_region"),
]

# Why each patch is still needed, and what it must match: (module, attribute path or ""
# for the module, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    ("megatron.core.tensor_parallel.random", "initialize_rng_tracker", "if _CUDA_RNG_STATE_TRACKER_INITIALIZED:"),
    ("megatron.core.tensor_parallel.random", "get_cuda_rng_tracker", "return _CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed", "offset = seed + 2718"),
    ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed",
     "expert_parallel_seed = seed + 1024 + 100 * ep_rank + etp_rank"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__",
     "self._scale = torch.tensor([1.0], dtype=torch.float, device='cuda')"),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__",
     "self.is_stub_optimizer = True if optimizer is None else False"),
    ("megatron.core.pipeline_parallel.schedules", "", 'torch.zeros([], dtype=torch.int, device="cuda")'),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.__init__",
     "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
     "with torch.cuda.stream(self.cuda_dtoh_stream):"),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
     "self.input_splits, as_numpy=True"),
    ("megatron.core.transformer.moe.moe_layer", "MoELayer.forward",
     "if self.training and self.attn_tp_group.size() > 1 and not self.config.sequence_parallel:"),
    # Why tp_fold_expert_params is needed: the all-to-all dispatcher gathers tokens over the TP group.
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher.dispatch_postprocess",
     "global_input_tokens, group=self.tp_group"),
    ("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction.forward",
     "if te_general_gemm is not None and router_dtype != torch.float64:"),
    # Why mla_without_te: multi-head latent attention tests an isinstance against TE's TELinear,
    # a mock where TE does not import, behind a HAVE_TE that its import guard sets anyway.
    ("megatron.core.transformer.multi_latent_attention", "MultiLatentAttention.__init__",
     "and isinstance(self.linear_proj, TELinear)"),
    # Why mla_without_te gathers the latents its own way: without TE the down projections are
    # column-parallel, their outputs gathered for every rank's heads, and the gather's backward
    # keeps this rank's slice of this rank's gradient only; and why tp_fold_expert_params holds the
    # q latent norm: finalize_model_grads sums the gradient of every "q_layernorm" over TP.
    ("megatron.core.distributed.finalize_model_grads", "_allreduce_non_tensor_model_parallel_grads",
     'config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)'),
    ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention.get_query_key_value_tensors",
     "kv_combined = gather_from_tensor_model_parallel_region(kv_combined)"),
    ("megatron.core.transformer.multi_latent_attention", "MLASelfAttention.get_query_key_value_tensors",
     "q_compressed = gather_from_tensor_model_parallel_region(q_compressed)"),
    ("megatron.core.tensor_parallel.mappings", "_GatherFromModelParallelRegion.backward",
     "return _split_along_last_dim(grad_output, ctx.group), None"),
    # Activation recomputation (trainer.recompute) saves and restores the CUDA RNG state.
    ("megatron.core.tensor_parallel.random", "_get_all_rng_states", "cuda_rng_state = _get_cuda_rng_state("),
    ("megatron.core.tensor_parallel.random", "CheckpointFunction.backward", "_set_all_rng_states(*ctx.rng_states)"),
    # Every torch DCP reader of megatron's load path comes from _get_filesystem_reader.
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistLoadShardedStrategy.load",
     "fsr = _get_filesystem_reader(checkpoint_dir, cache_metadata=True)"),
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistLoadShardedStrategy.load_sharded_metadata",
     "fs_reader = _get_filesystem_reader(checkpoint_dir)"),
    ("megatron.core.dist_checkpointing.strategies.torch", "TorchDistLoadShardedStrategy.load_tensors_metadata",
     "fs_reader = _get_filesystem_reader(checkpoint_dir)"),
    # safe_dist_checkpoint.SafeFileSystemReader.read_data stands in for torch DCP's (torch 2.13): each
    # item is the bytes at its private _StorageInfo's offset and length, given to the planner's
    # load_bytes or torch.load'ed, narrowed and committed.
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "offset: int"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "length: int"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data", "planner.load_bytes(req, read_bytes)"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data", "narrow_tensor_by_index("),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader.read_data",
     "planner.commit_tensor(req, target_tensor)"),
]

_applied = False
_MOE_LAYER_FORWARD: Callable[..., Any] | None = None  # megatron's own, wrapped by _moe_layer_forward_cpu
_NO_CUDA_STREAM = object()  # stands where megatron keeps a CUDA stream it never uses on CPU


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
    # Same names and seed offsets as megatron: TP ranks differ, DP ranks share the data-parallel seed.
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + tp_rank)
    # get_cuda_rng_tracker() returns this global; there is no public setter (mcore 0.16.1).
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


def _fp32_optimizer_init_cpu(self, optimizer, config, init_state_fn) -> None:
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
    self._scale = torch.tensor([1.0])
    self.is_stub_optimizer = optimizer is None


def _get_all_rng_states_cpu():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # what megatron's returns, without the CUDA generator's state: the tracker's are CPU states here
    return torch.get_rng_state(), None, get_cuda_rng_tracker().get_states()


def _set_all_rng_states_cpu(cpu_rng_state, cuda_rng_state, cuda_rng_state_tracker) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(cpu_rng_state)
    get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)


def _moe_dispatcher_sync_cpu(self, point, tokens_per_expert=None):
    # The MoE routing counts are CPU tensors already: no device-to-host copy, no stream to wait
    # on; only the expert-parallel all-to-all's split sizes become numpy, as megatron's copy makes them.
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            if torch.is_tensor(getattr(self, name, None)):
                setattr(self, name, getattr(self, name).numpy())
    return tokens_per_expert


def _moe_layer_forward_cpu(self, hidden_states, intermediate_tensors=None, padding_mask=None):
    # MoELayer.forward refuses to train under TP without sequence parallelism, and torch norms (no
    # TE) refuse sequence parallelism. Its outputs and input gradients are right without it; the
    # experts' weight gradients come out TP-fold, which the trainer undoes (tp_fold_expert_params).
    # The guard is the only reader of the MoE layer's own `training` flag (its router and experts keep theirs).
    training, self.training = self.training, False
    try:
        return _MOE_LAYER_FORWARD(self, hidden_states, intermediate_tensors, padding_mask=padding_mask)
    finally:
        self.training = training


def tp_fold_expert_params(chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The expert weights whose gradients come out tp_size-fold under TP without sequence
    parallelism (CPU: see _moe_layer_forward_cpu), and multi-head latent attention's q latent norm
    (below); the trainer divides their gradients after backward.

    Each TP rank holds every token; the dispatcher gathers the tokens over the TP group as if each
    held a slice (MoEAlltoAllTokenDispatcher.dispatch_postprocess), so every expert shard sees each
    token tp_size times and its weight gradient sums tp_size equal copies (the reduce-scatter after
    the experts makes the outputs and the input gradients right). Measured: squared gradient norms
    4x TP 1's at TP 2, every other parameter equal.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    experts = [p for chunk in chunks for m in chunk.modules() if isinstance(m, SequentialMLP) for p in m.parameters()]
    # Multi-head latent attention's q latent norm (local layers) comes before the TP split: its
    # gradient is whole on every rank, and megatron's finalize_model_grads sums every parameter named
    # "q_layernorm" / "k_layernorm" over TP as if each held a part (mcore 0.16.1): tp_size-fold too.
    # (Its kv latent norm, "kv_layernorm", is not summed, and is right as it is.)
    norms = [p for chunk in chunks for m in chunk.modules() if isinstance(m, MLASelfAttention)
             for p in m.q_layernorm.parameters()]
    return experts + norms


# The functions replaced, as (module, attribute path, replacement): same parameters.
REPLACEMENTS: list[tuple[str, str, object]] = [
    ("megatron.core.transformer.moe.moe_layer", "MoELayer.forward", _moe_layer_forward_cpu),
    ("megatron.core.transformer.moe.token_dispatcher", "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
     _moe_dispatcher_sync_cpu),
    ("megatron.core.optimizer.optimizer", "FP32Optimizer.__init__", _fp32_optimizer_init_cpu),
    ("megatron.core.optimizer.optimizer", "get_grad_norm_fp32", _grad_norm_fp32_cpu),
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32_cpu),
    ("megatron.core.tensor_parallel.random", "_get_all_rng_states", _get_all_rng_states_cpu),
    ("megatron.core.tensor_parallel.random", "_set_all_rng_states", _set_all_rng_states_cpu),
]


class _TorchOnCpu:
    """The torch module, except that factories asked for device="cuda" allocate on the CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def dist_checkpoint_reader(make_reader: Callable[..., Any]) -> Iterator[None]:
    """While in this context, megatron's torch_dist loader reads checkpoints through
    `make_reader(checkpoint_dir, cache_metadata=False)` instead of torch's FileSystemReader."""
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategy

    # TorchDistLoadShardedStrategy builds its reader in this module function, and no argument
    # of dist_checkpointing.load chooses another (mcore 0.16.1).
    original = mcore_torch_strategy._get_filesystem_reader
    mcore_torch_strategy._get_filesystem_reader = make_reader
    try:
        yield
    finally:
        mcore_torch_strategy._get_filesystem_reader = original


def mla_without_te(kv_lora_rank: int, rope_dim: int, q_lora_rank: int | None) -> None:
    """Let megatron build and train multi-head latent attention with its local layers (no
    Transformer Engine), at any TP size (with `tp_fold_expert_params` for its q latent norm)."""
    from megatron.core.transformer import multi_latent_attention

    # Its module sets HAVE_TE = True whenever megatron's TE extension imports, which it does without
    # TE (its classes then mocks), and MLA's __init__ then calls isinstance(x, TELinear) on a mock:
    # TypeError (mcore 0.16.1). Without TE, none of its TE branches applies.
    multi_latent_attention.HAVE_TE = False
    # Under TP the local down projections (hidden -> q latent, hidden -> kv latent + rope key) are
    # column-parallel: each rank computes a slice, gathered whole for its own heads. The gather's
    # backward keeps this rank's slice of this rank's gradient. For the latents that is all of it
    # (the up projections all-reduce their input gradients), but the rope key goes straight into
    # attention, so its gradient on each rank holds only that rank's heads' part: the other ranks'
    # parts are lost (measured at TP 2: gradient norm 0.7 % under TP 1's, every weight off after a
    # step). The rope key's gradient is summed over TP first (mcore 0.16.1; TE duplicates the
    # down projections instead).
    if q_lora_rank == kv_lora_rank + rope_dim:  # the gathers are told apart by their width
        raise ValueError(f"q_lora_rank {q_lora_rank} == kv_lora_rank + qk_rope_head_dim: not supported without TE")
    multi_latent_attention.gather_from_tensor_model_parallel_region = functools.partial(
        _gather_latent, kv_width=kv_lora_rank + rope_dim, rope_dim=rope_dim)


class _GatherLatent(torch.autograd.Function):
    """All-gather along the last dimension over the TP group; backward: the last `rope_dim` columns'
    gradient summed over the group, then this rank's slice."""

    @staticmethod
    def forward(ctx, input_: torch.Tensor, group: Any, rope_dim: int) -> torch.Tensor:
        ctx.group, ctx.rope_dim = group, rope_dim
        parts = [torch.empty_like(input_) for _ in range(group.size())]
        torch.distributed.all_gather(parts, input_.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.rope_dim:
            grad = grad.clone()
            rope = grad[..., -ctx.rope_dim:].contiguous()
            torch.distributed.all_reduce(rope, group=ctx.group)
            grad[..., -ctx.rope_dim:] = rope
        rank = torch.distributed.get_rank(group=ctx.group)
        return grad.chunk(ctx.group.size(), dim=-1)[rank].contiguous(), None, None


def _gather_latent(input_: torch.Tensor, group: Any = None, *, kv_width: int, rope_dim: int) -> torch.Tensor:
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return input_
    return _GatherLatent.apply(input_, group, rope_dim if input_.shape[-1] * group.size() == kv_width else 0)


def apply_cpu_patches() -> None:
    """Patch megatron-core (and mbridge) for CPU training. Idempotent; call before building the model."""
    global _applied
    if _applied:
        return
    import megatron.core.optimizer.optimizer as mcore_optimizer
    import megatron.core.pipeline_parallel.schedules as mcore_schedules
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    # RoPE, grad buffers, GlobalMemoryBuffer, attention masks, mbridge use torch.cuda.current_device() (mcore 0.16.1).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # dist_checkpointing and the schedules synchronize CUDA streams: nothing to wait for on CPU (mcore 0.16.1).
    torch.cuda.synchronize = lambda device=None: None

    # FP32Optimizer builds its loss-scale tensor with device='cuda' (mcore 0.16.1; the rest of its __init__ as here).
    FP32Optimizer.__init__ = _fp32_optimizer_init_cpu
    # Grad norm and clipping use apex/TE multi-tensor kernels and assert CUDA tensors (mcore 0.16.1).
    mcore_optimizer.get_grad_norm_fp32 = _grad_norm_fp32_cpu
    mcore_optimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    # The schedules count tokens in torch.zeros(..., device="cuda") (mcore 0.16.1).
    mcore_schedules.torch = _TorchOnCpu()
    # Activation recomputation keeps the CUDA generator's state beside the CPU one (mcore 0.16.1).
    mp_random._get_all_rng_states = _get_all_rng_states_cpu
    mp_random._set_all_rng_states = _set_all_rng_states_cpu
    # The MoE all-to-all dispatcher makes a CUDA stream for its device-to-host copies when the
    # first one is built, and syncs on it at every forward (mcore 0.16.1); neither exists on CPU.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_CUDA_STREAM
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _moe_dispatcher_sync_cpu
    # The router's gating linear tests `te_general_gemm is not None`, a name that is only defined
    # when Transformer Engine imports (mcore 0.16.1): NameError without TE.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    global _MOE_LAYER_FORWARD
    _MOE_LAYER_FORWARD = MoELayer.forward
    MoELayer.forward = _moe_layer_forward_cpu
    _applied = True

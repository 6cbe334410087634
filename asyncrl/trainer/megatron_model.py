"""What the policy and the critic (critic.py) both do with a megatron model: wrap it for data
parallelism, build its Adam, run megatron's schedule over packed micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.config.schema import TrainerConfig
from asyncrl.trainer.batch import PackedBatch


def wrap_ddp(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """megatron's DDP around each chunk; the chunks' config (their own: a model built from its
    own bridge) gets the hooks megatron's schedule calls (no_sync, the data-parallel all-reduce)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_config, module=c) for c in chunks]
    config = chunks[0].config
    config.finalize_model_grads_func = finalize_model_grads  # data-parallel all-reduce after the last micro-batch
    config.no_sync_func = wrapped[0].no_sync
    return wrapped


def adam(model: list[torch.nn.Module], t: TrainerConfig, dtype: torch.dtype, lr: float):
    """megatron's Adam over `model` with trainer.* settings at learning rate `lr`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min(t.min_lr, lr), weight_decay=t.weight_decay, adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.grad_clip, bf16=dtype == torch.bfloat16,
        params_dtype=dtype, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(opt_config, model)
    model[0].config.grad_scale_func = optimizer.scale_loss
    return optimizer


def grads_finite(model: list[torch.nn.Module], device: torch.device) -> bool:
    """Every gradient of every rank is finite (after the data-parallel all-reduce): one flag,
    reduced over the trainer's world so that every rank skips or steps alike."""
    finite = torch.ones((), device=device)
    for m in model:
        for buffer in m.buffers + m.expert_parallel_buffers:
            finite = finite * torch.isfinite(buffer.grad_data).all()
    torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    return bool(finite)


def forward_packed(model: torch.nn.Module, batch: PackedBatch, use_te: bool, half: bool) -> torch.Tensor:
    """The packed row as megatron's THD format: rope restarts at every sequence, and the
    attention (Transformer Engine's, or attention.py's on local layers) stays within each."""
    from megatron.core.packed_seq_params import PackedSeqParams

    # The kernels read the boundaries on the device (`cu_seqlens_q`, moved with the batch);
    # megatron's per-sequence rope reads the "padded" ones, equal here (no padding inside a
    # sequence), as a host list: on the host it needs no synchronisation per layer. TE reads both
    # on the device.
    cu, host = batch.cu_seqlens_device, batch.cu_seqlens
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=cu if use_te else host,
                             cu_seqlens_kv_padded=cu if use_te else host,
                             max_seqlen_q=batch.max_seqlen, max_seqlen_kv=batch.max_seqlen)
    # bf16 (Float16Module): the output stays bf16; the losses take it to fp32
    return model(batch.input_ids, batch.position_ids, None, packed_seq_params=packed,
                 **({"fp32_output": False} if half else {}))


def run_schedule(model: list[torch.nn.Module], batches: list[PackedBatch], forward_step: Callable,
                 forward_only: bool) -> list:
    """megatron's schedule (handles pipeline stages) over packed micro-batches; `forward_step`:
    (forward_only, number of micro-batches, data_iterator, model) -> (output, loss function)."""
    from functools import partial

    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not batches:
        return []
    return get_forward_backward_func()(
        forward_step_func=partial(forward_step, forward_only, len(batches)),
        data_iterator=iter(batches), model=model, num_microbatches=len(batches),
        seq_length=max(b.input_ids.shape[1] for b in batches), micro_batch_size=1, forward_only=forward_only)

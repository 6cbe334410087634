"""Qwen3.5's text models (model_type qwen3_5_text, and qwen3_5_moe_text with Qwen2-MoE's experts) in
megatron-core: the hybrid of gated-DeltaNet linear attention and gated full attention, converted to
and from HF's checkpoint exactly.

mbridge 0.15.1 has no bridge for it, and megatron-core 0.16.1's own GatedDeltaNet needs
flash-linear-attention and refuses packed rows, its hybrid layer spec needs Transformer Engine,
and its torch norms refuse zero-centred weights. So, registered for mbridge's AutoBridge:
- the layer spec: megatron's local layers, each layer's self-attention slot holding the packed
  gated DeltaNet (gdn.py) where `layer_types` says "linear_attention", else megatron's attention
  with its output gate (`attention_output_gate`: HF's q_proj holds each head's query and gate) and
  the packed attention (attention.py); every norm HF's zero-centred RMSNorm (x * (1 + w)), the
  DeltaNet's output norm gated;
- rope on `partial_rotary_factor` of each head (megatron's `rotary_percent`);
- the weights: the DeltaNet's four input projections fused into megatron's `in_proj` (q k v, z,
  b, a), and q_proj's per-head [query | gate] re-laid per query group as megatron's gated
  linear_qkv wants ([queries, gates, key, value]); both by cat / split / view, so the export is
  the checkpoint bit for bit; under tensor parallelism the DeltaNet's are split by head
  (`split_for_tp`).
One pipeline stage (more are refused at validation: config/models.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from asyncrl.trainer.gdn import PackedGatedDeltaNet
from asyncrl.trainer.norms import ZeroCenteredRMSNorm

MODEL_TYPE = "qwen3_5_text"


def layer_spec(config: Any, layer_types: list[str], vp_stage: int | None = None) -> Any:
    """megatron's local decoder block spec with Qwen3.5's layers (the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from asyncrl.trainer.attention import PackedAttention

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    if len(spec.layer_specs) != len(layer_types):
        raise ValueError(f"{MODEL_TYPE}: {len(spec.layer_specs)} layers on this stage of {len(layer_types)}: "
                         "pipeline parallelism is not built for it")
    layers = []
    for layer, kind in zip(spec.layer_specs, layer_types):
        layer = copy.deepcopy(layer)  # the block's layers may share one spec: each layer gets its own
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if kind == "linear_attention":
            sub.self_attention = ModuleSpec(module=PackedGatedDeltaNet)
        else:
            attention = sub.self_attention.submodules
            attention.core_attention = PackedAttention
            attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
        layers.append(layer)
    spec.layer_specs, spec.layer_norm = layers, ZeroCenteredRMSNorm
    return spec


def gated_qkv_to_mcore(q_proj: torch.Tensor, k_proj: torch.Tensor, v_proj: torch.Tensor, heads: int,
                       groups: int, head_dim: int) -> torch.Tensor:
    """HF's q_proj (per head: its query, then its gate), k_proj and v_proj -> megatron's gated
    linear_qkv (per query group: its heads' queries, their gates, the key, the value)."""
    hidden = q_proj.shape[-1]
    per_head = q_proj.view(heads, 2, head_dim, hidden)
    query = per_head[:, 0].reshape(groups, -1, hidden)
    gate = per_head[:, 1].reshape(groups, -1, hidden)
    return torch.cat([query, gate, k_proj.view(groups, head_dim, hidden), v_proj.view(groups, head_dim, hidden)],
                     dim=1).reshape(-1, hidden)


def gated_qkv_to_hf(qkv: torch.Tensor, heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    """The inverse of `gated_qkv_to_mcore`: [q_proj, k_proj, v_proj]."""
    hidden = qkv.shape[-1]
    width = heads // groups * head_dim
    query, gate, key, value = qkv.view(groups, -1, hidden).split([width, width, head_dim, head_dim], dim=1)
    q_proj = torch.stack([query.reshape(heads, head_dim, hidden), gate.reshape(heads, head_dim, hidden)], dim=1)
    return [q_proj.reshape(-1, hidden), key.reshape(-1, hidden), value.reshape(-1, hidden)]


def config_args(hf: Any, moe: bool = False) -> dict[str, Any]:
    """megatron's TransformerConfig settings for this HF config, beside mbridge's own; with `moe`,
    Qwen3.5-MoE's experts: softmax top-k routing (renormalised: hf_bridge sets where the softmax
    goes) and one shared expert behind a sigmoid gate (hf_bridge sets the gate)."""
    args = dict(qk_layernorm=True, attention_output_gate=True, kv_channels=hf.head_dim,
                linear_conv_kernel_dim=hf.linear_conv_kernel_dim, linear_key_head_dim=hf.linear_key_head_dim,
                linear_value_head_dim=hf.linear_value_head_dim, linear_num_key_heads=hf.linear_num_key_heads,
                linear_num_value_heads=hf.linear_num_value_heads)
    if moe:
        args.update(num_moe_experts=hf.num_experts, moe_router_topk=hf.num_experts_per_tok,
                    moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_score_function="softmax",
                    moe_shared_expert_intermediate_size=hf.shared_expert_intermediate_size,
                    moe_aux_loss_coeff=hf.router_aux_loss_coef, moe_router_load_balancing_type="none")
    return args


def gptmodel_args(hf: Any) -> dict[str, Any]:
    """GPTModel's settings beside mbridge's: rope on a part of each head."""
    return {"rotary_percent": (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)}


def _head_parts(name: str, hf: Any) -> list[int] | None:
    """The rows of a DeltaNet parameter split by head, part by part (None: not one of them): in_proj's
    q, k, v, z, b, a; conv1d's q, k, v channels."""
    keys = hf.linear_num_key_heads * hf.linear_key_head_dim
    values = hf.linear_num_value_heads * hf.linear_value_head_dim
    if "self_attention.in_proj.weight" in name:
        return [keys, keys, values, values, hf.linear_num_value_heads, hf.linear_num_value_heads]
    if "self_attention.conv1d.weight" in name:
        return [keys, keys, values]
    return None


def _in_proj_rows(hf: Any) -> list[int]:
    """in_proj's HF tensors: in_proj_qkv (q k v, through the convolution), in_proj_z, _b, _a."""
    q, k, v, z, b, a = _head_parts("self_attention.in_proj.weight", hf)
    return [q + k + v, z, b, a]


def split_for_tp(name: str, weights: torch.Tensor, hf: Any, tp: int) -> list[torch.Tensor] | None:
    """Each tensor-parallel rank's rows of a DeltaNet parameter: its heads of every part (None:
    not one of them)."""
    parts = _head_parts(name, hf)
    if parts is None:
        return None
    chunks = [part.chunk(tp, dim=0) for part in weights.split(parts, dim=0)]
    return [torch.cat([c[rank] for c in chunks], dim=0) for rank in range(tp)]


def merge_from_tp(name: str, shards: list[torch.Tensor], hf: Any) -> torch.Tensor | None:
    """The inverse of `split_for_tp`."""
    parts = _head_parts(name, hf)
    if parts is None:
        return None
    pieces = [shard.split([p // len(shards) for p in parts], dim=0) for shard in shards]
    return torch.cat([piece[i] for i in range(len(parts)) for piece in pieces], dim=0)


def to_mcore(name: str, hf_weights: list[torch.Tensor], hf: Any) -> torch.Tensor | None:
    """The megatron tensor of the fused parameters (None: not one of them)."""
    if "self_attention.in_proj.weight" in name:
        return torch.cat(hf_weights, dim=0)
    if "self_attention.linear_qkv.weight" in name:
        return gated_qkv_to_mcore(*hf_weights, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    return None


def to_hf(name: str, weights: torch.Tensor, hf: Any) -> list[torch.Tensor] | None:
    """The HF tensors of a fused parameter, in the name map's order (None: not one of them)."""
    if "self_attention.in_proj.weight" in name:
        return list(weights.split(_in_proj_rows(hf), dim=0))
    if "self_attention.linear_qkv.weight" in name:
        return gated_qkv_to_hf(weights, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    return None

"""Causal attention over a packed row of sequences, with memory linear in its tokens.

A micro-batch is one row of several sequences end to end (batch.py). Megatron's local
`DotProductAttention` needs a dense [L, L] mask for that and keeps [heads, L, L] scores per
layer for backward: memory and time grow with the square of the packed row. This module
takes its place in megatron's local layer spec (mbridge_compat.use_local_layer_spec) and
reads the sequence boundaries from megatron's `PackedSeqParams` (THD format: q, k, v of
shape [tokens, heads, dim], rope already applied per sequence by megatron), so no tensor
of size L x L exists on any path:

- CUDA: PyTorch's `varlen_attn` (FlashAttention over cu_seqlens, one call for the row)
  where this torch has it; otherwise `scaled_dot_product_attention` per sequence (flash or
  memory-efficient kernels: causal, no mask);
- CPU: `scaled_dot_product_attention` per sequence (its CPU flash kernel; exact against
  HF's eager attention within fp32 rounding).

A layer with a sliding window (Gemma 3's local layers, each of Mistral-7B-v0.1's: each query sees
its `window` latest keys, itself included, as HF's `sliding_window`) passes the window to `varlen_attn`; per
sequence, a sequence longer than the window runs in blocks of up to 512 queries, each against
the keys its queries can see (block + window - 1), so memory grows with tokens x window, not
tokens squared.

The loop over sequences is per sequence, not per token: a micro-batch holds a few to a
few hundred. Where Transformer Engine is installed the trainer keeps TE's own THD attention.
"""

from __future__ import annotations

import inspect
import math
from functools import cache

import torch
import torch.nn.functional as F

WINDOW_BLOCK = 512  # queries per call of a sliding-window sequence on the per-sequence path


@cache
def _varlen_params() -> frozenset[str]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_kernel(window: int | None = None) -> str:
    """Which attention runs packed rows on CUDA: "varlen_attn" (torch >= 2.10) or "sdpa" per sequence."""
    # causal via window_size=(-1, 0) (torch 2.11, 2.13) or is_causal (2.10); GQA natively (2.13) or
    # by repeating k and v (2.11 has no enable_gqa); a sliding window needs window_size
    wanted = {"window_size"} if window is not None else {"window_size", "is_causal"}
    return "varlen_attn" if wanted & _varlen_params() else "sdpa"


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: list[int],
                            max_seqlen: int, scale: float, dropout_p: float = 0.0,
                            cu_seqlens_device: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row.

    query and key [T, Hq, D] and [T, Hkv, D], value [T, Hkv, Dv] (Hq a multiple of Hkv:
    grouped-query attention; Dv != D: multi-head latent attention); `cu_seqlens` the sequence
    boundaries (0, ..., T), and `cu_seqlens_device` the same as an int32 tensor on the query's
    device if the caller has it; `window`: each query sees its `window` latest keys (itself
    included), None: its whole prefix. Returns [T, Hq * Dv].
    """
    tokens, heads, dim = query.shape[0], query.shape[1], value.shape[-1]
    if (query.is_cuda and dropout_p == 0.0 and varlen_kernel(window) == "varlen_attn"
            and query.shape[-1] == dim):  # FlashAttention's head dims are one
        if cu_seqlens_device is None or cu_seqlens_device.device != query.device:
            cu_seqlens_device = torch.tensor(cu_seqlens, dtype=torch.int32, device=query.device)
        out = _varlen_attn(query, key, value, cu_seqlens_device, max_seqlen, scale, window)
    else:
        out = query.new_empty(tokens, heads, dim)
        gqa = key.shape[1] != heads
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if end == start:
                continue
            q, k, v = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, H, l, D]
            if window is None or end - start <= window:
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                   enable_gqa=gqa)
            else:
                o = _windowed_attention(q, k, v, window, scale, dropout_p, gqa)
            out[start:end] = o[0].transpose(0, 1)
    return out.reshape(tokens, heads * dim)


def _windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float,
                        dropout_p: float, gqa: bool) -> torch.Tensor:
    """Sliding-window causal attention of one sequence ([1, H, l, D] each), a block of queries at a
    time: queries [s, e) see keys [s - window + 1, e), a [block, block + window - 1] mask."""
    length, block = q.shape[2], min(window, WINDOW_BLOCK)
    out = q.new_empty(*q.shape[:3], v.shape[-1])
    for s in range(0, length, block):
        e, first = min(s + block, length), max(0, s - window + 1)
        i = torch.arange(s, e, device=q.device)[:, None]
        j = torch.arange(first, e, device=q.device)[None, :]
        mask = (j <= i) & (i - j < window)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, first:e], v[:, :, first:e],
                                                        attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                                        enable_gqa=gqa)
    return out


def _varlen_attn(query, key, value, cu: torch.Tensor, max_seqlen: int, scale: float,
                 window: int | None = None) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs = {"scale": scale}
    if "window_size" in params:
        # causal: no key after the query; a window of W keys: W - 1 before it
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:
        kwargs["is_causal"] = True
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, **kwargs)


def config_window(config) -> int | None:
    """megatron's one window for every layer (`config.window_size`, flash-attention's (left, right):
    Mistral's (W - 1, 0)) as the keys a query sees, W; None: no window."""
    if config.window_size is None:
        return None
    left, right = config.window_size
    if right != 0 or getattr(config, "window_attn_skip_freq", None) is not None:
        raise ValueError(f"config.window_size {config.window_size}, window_attn_skip_freq "
                         f"{getattr(config, 'window_attn_skip_freq', None)}: the packed attention takes a causal "
                         "window for every layer, or a layer spec's window per layer")
    return None if left < 0 else left + 1


class PackedAttention(torch.nn.Module):
    """Megatron's core-attention interface (as `DotProductAttention`) over THD packed rows."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None, window: int | None = None):
        # k_channels / v_channels: multi-head latent attention's head dims (its softmax_scale is given);
        # the shapes of q, k and v carry them. window: this layer's sliding window (a layer spec's
        # parameter, Gemma 3's); None: the config's window for every layer (Mistral's), if any
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine's attention")
        window = config_window(config) if window is None else window
        if window is not None and window < 1:
            raise ValueError(f"sliding window {window}: must be at least 1")
        self.config, self.window = config, window
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by the packed attention")
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise ValueError("PackedAttention needs THD packed_seq_params (the trainer passes them for every row)")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the packed attention")
        # the boundaries on the query's device (for a varlen kernel) and on the host (for a loop);
        # the trainer gives both (trainer_rank._forward), so neither needs a synchronisation
        on_device, on_host = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded
        if on_host is None or on_host.device.type != "cpu":
            raise ValueError("PackedAttention needs the sequence boundaries on the host as cu_seqlens_q_padded")
        return packed_causal_attention(query, key, value, on_host.tolist(), int(packed_seq_params.max_seqlen_q),
                                       self.softmax_scale, self.dropout_p if self.training else 0.0,
                                       cu_seqlens_device=on_device, window=self.window)

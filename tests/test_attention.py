"""The trainer's packed attention (asyncrl/trainer/attention.py) against attention with a dense
mask, sequence by sequence: causal, with a sliding window (Gemma 3's local layers), under
grouped-query attention; outputs and gradients, and no tensor of a long sequence's length squared
for a windowed layer. The whole model (megatron's layers around it) is checked against HF in
tests/test_model_families.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from asyncrl.trainer import attention
from asyncrl.trainer.attention import packed_causal_attention


class LargestTensor(TorchDispatchMode):
    """The most elements any op returns while active."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def dense_reference(query, key, value, cu_seqlens, scale, window):
    """Each sequence alone with a full [l, l] mask: key j is seen by query i when j <= i and,
    with a window, i - j < window (HF's `sliding_window_overlay`)."""
    groups = query.shape[1] // key.shape[1]
    out = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
        i, j = torch.arange(end - start)[:, None], torch.arange(end - start)[None, :]
        allowed = (j <= i) & ((i - j < window) if window else True)
        scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1).reshape(end - start, -1))
    return torch.cat(out)


@pytest.mark.parametrize("window", [None, 1, 5, 16])
def test_packed_attention_equals_a_dense_mask_per_sequence(window, monkeypatch):
    # sequences shorter than, as long as and longer than the windows; the block of queries smaller than
    # the window too (WINDOW_BLOCK 4), so both a block's own keys and the window's earlier ones are read
    monkeypatch.setattr(attention, "WINDOW_BLOCK", 4)
    gen = torch.Generator().manual_seed(0)
    cu = [0, 3, 8, 24, 61]
    q, k, v = (torch.randn(61, heads, 16, generator=gen, dtype=torch.float64, requires_grad=True)
               for heads in (4, 2, 2))
    out = packed_causal_attention(q, k, v, cu, max_seqlen=37, scale=0.3, window=window)
    ref = dense_reference(q, k, v, cu, 0.3, window)
    assert out.shape == ref.shape == (61, 4 * 16)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    if window == 1:  # each query sees itself only
        torch.testing.assert_close(out.view(61, 2, 2, 16), v.detach()[:, :, None].expand(61, 2, 2, 16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed attention's CUDA path (varlen_attn)")
@pytest.mark.parametrize("window", [None, 16])
def test_the_cuda_kernel_equals_a_dense_mask_per_sequence(window):
    """On a GPU: bf16 (FlashAttention's dtypes), grouped-query attention (4 query heads on 2 KV heads),
    causal and windowed, one varlen_attn call for the row, against the dense mask in fp32; gradients too."""
    assert attention.varlen_kernel(window) == "varlen_attn", "this torch has no varlen_attn with a window"
    gen = torch.Generator().manual_seed(0)
    cu = [0, 3, 8, 24, 61, 200]
    inputs = [torch.randn(200, heads, 64, generator=gen) for heads in (4, 2, 2)]
    on_gpu = [x.to("cuda", torch.bfloat16).requires_grad_() for x in inputs]
    ref_inputs = [x.to(torch.bfloat16).double().requires_grad_() for x in inputs]
    out = packed_causal_attention(*on_gpu, cu, max_seqlen=139, scale=0.125, window=window)
    ref = dense_reference(*ref_inputs, cu, 0.125, window)
    assert (out.double().cpu() - ref).abs().max() < 2e-2
    grad = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, on_gpu, grad.to("cuda", torch.bfloat16))
    theirs = torch.autograd.grad(ref, ref_inputs, grad)
    for a, b in zip(ours, theirs):
        assert (a.double().cpu() - b).abs().max() < 5e-2 * max(1.0, b.abs().max().item())


def test_a_windowed_layer_makes_no_tensor_larger_than_its_inputs():
    """A 2,048-token sequence through a 64-token window, forward and backward: no op returns more
    elements than q, k and v hold together (a block's mask and scores are [heads,] 64 x 127; scores
    against the whole prefix would be 2 x 64 x 2,048, an [L, L] mask 2,048 x 2,048). So memory grows
    with tokens x window."""
    length, heads, dim = 2048, 2, 8
    q, k, v = (torch.randn(length, heads, dim, requires_grad=True) for _ in range(3))
    bound = 3 * length * heads * dim
    with LargestTensor() as watch:
        packed_causal_attention(q, k, v, [0, length], max_seqlen=length, scale=0.35, window=64).sum().backward()
    assert watch.largest <= bound, watch.largest
    assert torch.isfinite(q.grad).all()
    # the causal layer (no window) of the same sequence is one call of torch's CPU flash kernel: no
    # [L, L] tensor either
    with LargestTensor() as watch:
        packed_causal_attention(q, k, v, [0, length], max_seqlen=length, scale=0.35).sum().backward()
    assert watch.largest <= bound, watch.largest


def test_the_window_comes_from_the_layer_spec_or_megatrons_config():
    """Gemma 3's layers give their own window; Mistral's model-wide one is megatron's window_size in
    flash-attention's terms, (W - 1, 0)."""
    from types import SimpleNamespace

    def config(window_size=None, skip=None):
        return SimpleNamespace(context_parallel_size=1, window_size=window_size, window_attn_skip_freq=skip,
                               kv_channels=16, apply_query_key_layer_scaling=False, attention_dropout=0.0)

    assert attention.PackedAttention(config(), 1, None, "self").window is None
    assert attention.PackedAttention(config(), 1, None, "self", window=16).window == 16
    assert attention.PackedAttention(config((15, 0)), 1, None, "self").window == 16
    assert attention.PackedAttention(config((-1, 0)), 1, None, "self").window is None
    with pytest.raises(ValueError, match="sliding window 0: must be at least 1"):
        attention.PackedAttention(config(), 1, None, "self", window=0)
    for bad in (config((15, 2)), config((15, 0), skip=4)):  # keys after the query; windows on some layers
        with pytest.raises(ValueError, match="the packed attention takes a causal window for every layer"):
            attention.PackedAttention(bad, 1, None, "self")

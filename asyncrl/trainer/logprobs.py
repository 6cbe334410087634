"""Per-token logprobs and entropy from the model's logits, in fp32 a chunk of tokens at a time.

The model's output layer gives [L, vocab / TP] logits in its dtype (bf16 on GPUs) for every
position of a packed row. Taking the response rows to fp32 at once would hold N x vocab floats
(16K tokens of Qwen3's vocabulary: 10 GB), and autograd would keep them for backward. Here each
chunk's fp32 work is recomputed in backward (activation checkpointing) instead of kept, so the loss
holds one chunk of fp32 logits whatever N. Tensor parallelism never gathers the vocabulary for
logprobs (megatron's `vocab_parallel_cross_entropy`); the entropy gathers one chunk's.
"""

from __future__ import annotations

import torch

# fp32 logits held at once by the loss: [chunk, vocab / TP] (2**26 floats, 256 MiB: 441 tokens of
# Qwen3's 151,936-entry vocabulary); the tiny models' whole micro-batch fits in one chunk.
LOGIT_CHUNK_ELEMENTS = 1 << 26


def token_logprobs(logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor, temperature: float,
                   with_entropy: bool = True,
                   chunk_elements: int = LOGIT_CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of rows `index` of `logits` ([L, vocab / TP], the model's
    dtype) divided by `temperature`, both [N] fp32. The fp32 logits of at most `chunk_elements`
    exist at once: each chunk is recomputed in backward (activation checkpointing) instead of
    being kept, so memory is the model's own logits plus one chunk, whatever N."""
    chunk = max(1, chunk_elements // logits.shape[-1])
    rows = logits[index]  # [N, vocab / TP], the model's dtype
    if index.numel() <= chunk:
        return _chunk_logprobs(rows, targets, temperature, with_entropy)
    parts = []
    # split, not slices: its backward joins the chunks' gradients in one copy
    for part, part_targets in zip(rows.split(chunk), targets.split(chunk)):
        if torch.is_grad_enabled() and rows.requires_grad:
            parts.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, part, part_targets, temperature,
                                                           with_entropy, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(part, part_targets, temperature, with_entropy))
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if with_entropy else None)


def _chunk_logprobs(rows, targets, temperature, with_entropy):
    from megatron.core import tensor_parallel

    rows = rows.float() / temperature
    entropy = _vocab_parallel_entropy(rows) if with_entropy else None
    # vocab_parallel_cross_entropy shifts its input in place: give it a copy where the entropy read it.
    logp = -tensor_parallel.vocab_parallel_cross_entropy(rows.clone() if with_entropy else rows, targets)
    return logp, entropy


def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each row's softmax when the vocabulary is split over tensor-parallel ranks."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    if mpu.get_tensor_model_parallel_world_size() > 1:
        logits = gather_from_tensor_model_parallel_region(logits)
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)

"""The gated delta rule (Qwen3.5 / Qwen3-Next linear attention) in torch, over packed sequences:
the trainer's packed rows (asyncrl/trainer/gdn.py) and the vLLM-CPU engine's batches of prefills
and decodes, each sequence from a state of its own (asyncrl/engine/vllm_qwen3_5.py), run the same
functions, so that the engine's fp32 logprobs are the trainer's.

Each sequence's short causal convolution and recurrent state start from zero (or from the state
the engine kept) at its first token, as when the sequence is alone:

- the convolution runs per sequence, with k-1 zeros before it (`packed_causal_conv1d`);
- the chunked gated delta rule (HF's `torch_chunk_gated_delta_rule`, op for op) runs on chunks
  of 64 aligned to each sequence's start: the chunk-local work (the UT transform, the
  within-chunk attention) for every chunk of the row at once, then one scan step per chunk
  position, over every sequence that still has a chunk there (`packed_chunk_gated_delta_rule`);
- a decode step (one token per sequence) is HF's recurrent rule, batched over the sequences.

Memory grows with the packed tokens (chunks of 64 x 64, states of the chunks in the scan), never
with their square; Python loops once per chunk position (the longest sequence's tokens / 64),
never per token. Sequences are ordered longest first so that the sequences of each scan step are
a prefix: each step's state is a slice of the last, nothing is gathered or scattered in the scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # HF's and flash-linear-attention's chunk


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """flash-linear-attention's (and HF's) l2 normalisation of the last dimension."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """Depthwise causal convolution of x [T, D] with weight [D, k], each sequence of the row
    from zero state, then SiLU: [T, D]. One convolution per sequence, as HF's `causal_conv1d_fn`
    computes it (one call over the row with zeros between the sequences differs from it in the
    last bit: the kernel picks its algorithm by length)."""
    k, channels = weight.shape[-1], weight.shape[0]
    taps = weight.unsqueeze(1)
    # SiLU on each sequence's slice too: its vectorised kernel rounds the tail of a row differently
    out = [F.silu(F.conv1d(x[a:b].t().unsqueeze(0).to(weight.dtype), taps, padding=k - 1, groups=channels)[..., :b - a])
           for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    return torch.cat(out, dim=-1)[0].t().to(x.dtype)


def _layout(cu_seqlens: list[int], device: torch.device) -> tuple[torch.Tensor, list[int], int, list[int]]:
    """Where each token goes in the chunk buffer, chunks ordered by (position in the sequence,
    sequence longest first): (its row in the buffer [T], the sequences at each chunk position,
    the buffer's chunks, the sequences longest first)."""
    lengths = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    chunks = [-(-n // CHUNK) for n in lengths]
    order = sorted(range(len(lengths)), key=lambda s: -chunks[s])
    rank = [0] * len(lengths)
    for r, s in enumerate(order):
        rank[s] = r
    active = [sum(1 for n in chunks if n > c) for c in range(max(chunks, default=0))]  # sequences at position c
    first = [0]
    for a in active[:-1]:
        first.append(first[-1] + a)  # the buffer's first chunk of position c
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(cu_seqlens[-1]) - torch.tensor(cu_seqlens[:-1])[seq]
    chunk = torch.tensor(first, dtype=torch.long)[pos // CHUNK] + torch.tensor(rank)[seq]
    return (chunk * CHUNK + pos % CHUNK).to(device), active, sum(active), order


def packed_chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """The gated delta rule within each sequence of a packed row, every state from zero.

    query, key [T, H, Dk] (already repeated to the value heads), value [T, H, Dv], g (log decay,
    <= 0) and beta [T, H]; q and k are l2-normalised here and q scaled by Dk^-0.5 (HF's
    use_qk_l2norm_in_kernel=True). Computed in fp32; returns [T, H, Dv] in value's dtype."""
    return _chunked_rule(query, key, value, g, beta, cu_seqlens, None, final=False)[0]


def packed_chunk_gated_delta_rule_with_state(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        cu_seqlens: list[int], initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`packed_chunk_gated_delta_rule`, each sequence's recurrent state starting from
    `initial_state[s]` ([S, H, Dk, Dv] fp32; None: zeros), as a serving engine continues a prompt;
    returns (output, each sequence's final state [S, H, Dk, Dv] fp32)."""
    return _chunked_rule(query, key, value, g, beta, cu_seqlens, initial_state, final=True)


def _chunked_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  cu_seqlens: list[int], initial_state: torch.Tensor | None,
                  final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule, and with `final` each sequence's final state (a serving engine's; the trainer needs
    none, and gathering one [H, Dk, Dv] state a sequence on every layer's forward is not free)."""
    dtype, tokens = value.dtype, value.shape[0]
    rows, active, chunks, order = _layout(cu_seqlens, value.device)
    query, key = l2norm(query.float()), l2norm(key.float())
    query = query * query.shape[-1] ** -0.5

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [chunks, H, CHUNK, ...], zeros past each end
        buffer = x.new_zeros(chunks * CHUNK, *x.shape[1:]).index_copy(0, rows, x)
        return buffer.view(chunks, CHUNK, *x.shape[1:]).transpose(1, 2)

    query, key, value = chunked(query), chunked(key), chunked(value.float())
    beta, decay = chunked(beta.float()), chunked(g.float())  # [chunks, H, CHUNK]
    v_beta, k_beta = value * beta.unsqueeze(-1), key * beta.unsqueeze(-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=value.device).triu(1)
    cum_decay = decay.cumsum(dim=-1)
    pairwise = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise
    intra = (query @ key.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, k_beta * cum_decay.exp().unsqueeze(-1), upper=False,
                                               unitriangular=True)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    # the scan: position c's chunks are buffer[first : first + active[c]], their sequences' states the
    # first active[c] of the last step's (longest first: those still going); a sequence's final state
    # is its state when it drops out
    heads, dk, dv = key.shape[1], key.shape[-1], value.shape[-1]
    sequences = len(cu_seqlens) - 1
    if initial_state is None:
        state = value.new_zeros(sequences, heads, dk, dv)
    else:
        state = initial_state.float().index_select(0, torch.tensor(order, device=value.device))
    out, finals, first = [], [state[active[0]:] if active else state], 0
    for c, n in enumerate(active):
        at = slice(first, first + n)
        state = state[:n]
        v_new = new_values[at] - k_cumdecay[at] @ state
        out.append(query[at] @ state + intra[at] @ v_new)
        state = state * chunk_decay[at] + key[at].transpose(-1, -2) @ v_new
        if final:
            finals.append(state[active[c + 1] if c + 1 < len(active) else 0:])
        first += n
    core = torch.cat(out).transpose(1, 2).reshape(chunks * CHUNK, heads, dv) if out else value.new_zeros(0, heads, dv)
    output = core.index_select(0, rows).to(dtype) if tokens else core.to(dtype)
    if not final:
        return output, None
    # ranks ascending: the last step's (the longest sequences), ..., the first step's, those with no chunk
    by_rank = torch.cat(finals[:0:-1] + finals[:1])
    return output, torch.empty_like(by_rank).index_copy_(0, torch.tensor(order, device=value.device), by_rank)


def recurrent_gated_delta_rule_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of S sequences through the gated delta rule (HF's
    torch_recurrent_gated_delta_rule for one step, batched), as a serving engine decodes:
    query, key [S, H, Dk], value [S, H, Dv], g and beta [S, H], state [S, H, Dk, Dv] fp32;
    returns (output [S, H, Dv] in value's dtype, the new states)."""
    dtype = value.dtype
    query, key = l2norm(query.float()), l2norm(key.float())
    query = query / (query.shape[-1] ** 0.5)
    state = state.float() * g.float().exp()[..., None, None]
    memory = (state * key.unsqueeze(-1)).sum(dim=-2)
    delta = (value.float() - memory) * beta.float().unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * query.unsqueeze(-1)).sum(dim=-2).to(dtype), state


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's log decay g = -exp(A_log) softplus(a + dt_bias) (fp32) and its write strength
    beta = sigmoid(b), per token and value head, as HF's Qwen3_5GatedDeltaNet computes them."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def repeat_key_heads(query: torch.Tensor, key: torch.Tensor,
                     value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """query, key [T, Hk, Dk] repeated to the value heads [T, Hv, Dk]: each key head serves
    Hv / Hk consecutive value heads (HF's repeat_interleave)."""
    if value_heads == query.shape[1]:
        return query, key
    repeat = value_heads // query.shape[1]
    return query.repeat_interleave(repeat, dim=1), key.repeat_interleave(repeat, dim=1)

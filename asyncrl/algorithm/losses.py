"""Policy losses on per-token logprobs, and how tokens are weighted into one number.

Notation (all per token t of a response; tool/env tokens have mask 0 and count nowhere):
    logp    log pi_theta(t)   the policy being trained (carries the gradient)
    mu      log mu(t)         the behaviour policy: the logprob vLLM sampled the token with
    prox    log pi_prox(t)    the proximal policy: the trainer's weights before this update,
                              recomputed by the trainer (decoupled PPO)
    A       the advantage of the token's trajectory

Loss types (`algorithm.loss.type`):
    grpo           r = exp(logp - mu)
                   l = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)
    decoupled_ppo  u = exp(logp - prox),  w = min(exp(prox - mu), C)   (w is a constant)
                   l = -w * min(u*A, clip(u, 1-eps_low, 1+eps_high)*A)
    tis            w = min(exp(logp - mu), C)   (a constant: truncated importance sampling)
                   l = -w * A * logp
    cispo          w = min(exp(logp - mu), 1 + eps_high)   (a constant: CISPO, MiniMax-M1)
                   l = -w * A * logp            (every token gets a gradient, clipped or not)
    gspo           s_i = exp(mean over sequence i's trained tokens of (logp - mu))   (GSPO)
                   l = -min(s_i*A, clip(s_i, 1-seq_eps_low, 1+seq_eps_high)*A) on each of
                   sequence i's tokens: with sequence aggregation, the mean over sequences
    icepop         k = exp(prox - mu),  M(k) = k inside [icepop_low, icepop_high], else 0
                   l = -M(k) * min(u*A, clip(u, 1-eps_low, 1+eps_high)*A)   (IcePop: decoupled
                   PPO whose behaviour weight masks the tokens outside the band instead of
                   truncating them; those are out of every statistic too)
Optional terms, added to l:
    k3 KL to a reference policy   kl_coef * (exp(ref - logp) - (ref - logp) - 1)
    entropy bonus                 -entropy_coef * H_t

The value model's loss (gae; V: its value now, V_old: before the step, G: the return):
    V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
    l = 0.5 * max((V - G)^2, (V_clip - G)^2)       (PPO's clipped value loss, as verl's)

Aggregation: `token` averages over every trained token of the step; `sequence` first
averages within each trajectory, then over trajectories. `aggregation_weights` turns
either into one weight per token, computed once for the whole step, so that summing
`sum(l * weight)` over micro-batches (gradient accumulation) gives exactly the
step's loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.config.schema import AGGREGATIONS, LOSS_TYPES, LossConfig

# Losses that read the proximal policy's logprobs (recomputed by the trainer before a step's
# first update when the step has several).
NEEDS_PROX = ("decoupled_ppo", "icepop")
# Losses whose objective is per sequence: their aggregation must be `sequence`.
SEQUENCE_LEVEL = ("gspo",)


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar: sum over tokens of per-token loss times its aggregation weight
    # Sums over trained tokens (divide by `tokens` for means) and maxima, for metrics: 0-d tensors
    # on the loss's device, read (`float`) once per step rather than once per micro-batch (on a
    # GPU each read waits for the device).
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxima: dict[str, torch.Tensor] = field(default_factory=dict)
    tokens: torch.Tensor | int = 0


def aggregation_weights(masks: list[torch.Tensor], mode: str) -> list[torch.Tensor]:
    """One weight per token for each trajectory (`masks[i]`: its loss mask, 1 = trained);
    the weights of all trained tokens of a step sum to 1."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation {mode!r}: valid are {AGGREGATIONS}")
    if mode == "token":
        total = sum(float(m.sum()) for m in masks)
        return [m.float() / max(total, 1.0) for m in masks]
    counted = [m for m in masks if float(m.sum()) > 0]
    n = max(len(counted), 1)
    return [m.float() / (max(float(m.sum()), 1.0) * n) for m in masks]


def policy_loss(
    logp: torch.Tensor,
    mu: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    settings: LossConfig,
    prox: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_index: torch.Tensor | None = None,
) -> LossOutput:
    """The weighted loss of a set of tokens (1-D tensors of equal length) and its statistics.
    `seq_index`: which sequence each token is of (gspo's sequence ratio)."""
    mask = mask.float()
    trained = mask > 0
    eps_lo, eps_hi, cap = settings.clip_eps_low, settings.clip_eps_high, settings.importance_cap
    sums: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}

    if settings.type not in LOSS_TYPES:
        raise ValueError(f"loss type {settings.type!r}: valid are {LOSS_TYPES}")
    if settings.type in ("tis", "cispo"):
        ratio = torch.exp(logp.detach() - mu)
        bound = cap if settings.type == "tis" else 1 + eps_hi
        w = ratio.clamp(max=bound)
        per_token = -w * advantages * logp
        sums["is_weight_truncated"] = ((ratio > bound) & trained).sum()
        clipped = torch.zeros_like(trained)
    elif settings.type == "gspo":
        if seq_index is None:
            raise ValueError("gspo needs each token's sequence (seq_index)")
        n = int(seq_index.max()) + 1 if seq_index.numel() else 0
        log_r = (logp - mu) * mask
        count = torch.zeros(n, device=logp.device).index_add_(0, seq_index, mask)
        seq_log_r = torch.zeros(n, device=logp.device, dtype=log_r.dtype).index_add_(0, seq_index, log_r)
        ratio = torch.exp(seq_log_r / count.clamp(min=1))[seq_index]
        per_token, clipped = _ppo_clip(ratio, advantages, settings.seq_clip_eps_low, settings.seq_clip_eps_high,
                                       trained, sums)
        w = torch.ones_like(ratio)
    else:
        anchor = mu if settings.type == "grpo" else prox
        if anchor is None:
            raise ValueError(f"{settings.type} needs the proximal logprobs (prox)")
        ratio = torch.exp(logp - anchor)
        per_token, clipped = _ppo_clip(ratio, advantages, eps_lo, eps_hi, trained, sums)
        if settings.type == "decoupled_ppo":
            raw_w = torch.exp(prox - mu)
            w = raw_w.clamp(max=cap)
            per_token = w * per_token
            sums["is_weight_truncated"] = ((raw_w > cap) & trained).sum()
        elif settings.type == "icepop":
            k = torch.exp(prox - mu).detach()
            kept = (k >= settings.icepop_low) & (k <= settings.icepop_high)
            sums["icepop_masked"] = (~kept & trained).sum()
            mask = mask * kept  # masked tokens: no gradient, and out of every statistic below
            trained = mask > 0
            clipped = clipped & trained
            w = k * kept  # M(k)
            per_token = w * per_token
        else:
            w = torch.ones_like(ratio)
    sums["clip_fraction"] = clipped.sum()
    sums["ratio"] = (ratio.detach() * mask).sum()
    sums["is_weight"] = (w.detach() * mask).sum()
    # ratio and w are positive: over trained tokens only, 0 when there are none
    maxima["ratio"] = (ratio.detach() * mask).max() if mask.numel() else mask.new_zeros(())
    maxima["is_weight"] = (w.detach() * mask).max() if mask.numel() else mask.new_zeros(())

    if ref_logp is not None and settings.kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        per_token = per_token + settings.kl_coef * k3
        sums["kl_ref"] = (k3.detach() * mask).sum()
    if entropy is not None:
        if settings.entropy_coef > 0:
            per_token = per_token - settings.entropy_coef * entropy
        sums["entropy"] = (entropy.detach() * mask).sum()

    # Behaviour vs proximal mismatch, k3 estimator of KL(mu || pi_prox) on tokens sampled from mu.
    if prox is not None:
        log_r = (prox - mu).detach()
        sums["mismatch_kl"] = ((torch.exp(log_r) - log_r - 1) * mask).sum()
        maxima["mismatch_abs_logratio"] = (log_r.abs() * mask).max() if mask.numel() else mask.new_zeros(())

    loss = (per_token * weights * mask).sum()
    return LossOutput(loss=loss, sums=sums, maxima=maxima, tokens=mask.sum())


def _ppo_clip(ratio: torch.Tensor, advantages: torch.Tensor, eps_lo: float, eps_hi: float, trained: torch.Tensor,
              sums: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped per-token loss -min(r A, clip(r, 1-eps_lo, 1+eps_hi) A), and which trained
    tokens the clamp, not the ratio, sets (no gradient); counts both kinds of clipping in `sums`."""
    unclipped = ratio * advantages
    clipped_obj = ratio.clamp(1 - eps_lo, 1 + eps_hi) * advantages
    sums["clip_low"] = ((ratio < 1 - eps_lo) & (advantages < 0) & trained).sum()
    sums["clip_high"] = ((ratio > 1 + eps_hi) & (advantages > 0) & trained).sum()
    return -torch.minimum(unclipped, clipped_obj), (clipped_obj < unclipped) & trained


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               weights: torch.Tensor, value_clip: float) -> LossOutput:
    """The critic's clipped value loss over a set of tokens, weighted as the policy loss, and its
    statistics: `value_clip_fraction` counts the tokens where the clipped term is the larger."""
    mask = mask.float()
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_err, clipped_err = (values - returns) ** 2, (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)
    sums = {"value_clip_fraction": ((clipped_err > unclipped_err) & (mask > 0)).sum(),
            "value_loss": (per_token.detach() * mask).sum()}
    return LossOutput(loss=(per_token * weights * mask).sum(), sums=sums, tokens=mask.sum())

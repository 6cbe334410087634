"""Advantages from rewards (`algorithm.advantage`).

grpo, for the n rewards r_1..r_n of one prompt's group:
    A_i = (r_i - mean(r)) / (std(r) + eps)      (normalize_std=True)
    A_i =  r_i - mean(r)                         (normalize_std=False, Dr. GRPO style)
rloo (leave-one-out): A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r))
reinforce_pp (REINFORCE++): over every sample of the step's batch (all groups),
    A = (r - mean_batch(r)) / (std_batch(r) + eps)
gae (PPO with a critic), per trained token t of a trajectory, with V the value model's
estimate before the token, R the trajectory's reward (on its last trained token) and the
trajectory's trained tokens as the time steps (tool/env tokens between them are the env's):
    delta_t = r_t + gamma * V_{t+1} - V_t        (r_t = R on the last token, else 0; V after it = 0)
    A_t     = delta_t + gamma * lam * A_{t+1}     (A after the last token = 0)
    returns_t = A_t + V_t                          (the value model's target)
std is the sample standard deviation (n - 1 in the denominator), as in torch.std and
verl; eps = 1e-4 as in Megatron-LM. A group whose rewards are all equal carries no
learning signal for the group baselines (every A_i is 0); `is_uniform` lets the trainer
filter it out.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-4


def group_advantages(rewards: list[float], normalize_std: bool = True, eps: float = EPS) -> list[float]:
    """The advantage of each sample of one group (same order as `rewards`)."""
    n = len(rewards)
    if n == 0:
        return []
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / (n - 1)) if n > 1 else 0.0
    return [c / (std + eps) for c in centered]


def rloo_advantages(rewards: list[float]) -> list[float]:
    """Each sample's reward minus the mean of the other n - 1 rewards of its group."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    return [r - (total - r) / (n - 1) for r in rewards]


def batch_normalized(rewards: list[float], eps: float = EPS) -> list[float]:
    """REINFORCE++: the rewards of a whole batch, centred and scaled by the batch's std."""
    return group_advantages(rewards, normalize_std=True, eps=eps)


def is_uniform(rewards: list[float]) -> bool:
    """True when every reward of the group is the same (no signal for group advantages)."""
    return len(rewards) == 0 or max(rewards) == min(rewards)


def filters_uniform_groups(setting: bool | None, advantage: str) -> bool:
    """Whether groups of equal rewards are left out of a step (algorithm.loss.filter_uniform_groups).
    None, the default, decides by the advantage: yes for grpo and rloo (such a group's advantages
    are all 0: training it moves nothing), no for reinforce_pp (its batch statistics count it)."""
    return advantage != "reinforce_pp" if setting is None else setting


def gae(values: torch.Tensor, rewards: torch.Tensor, last: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE for trajectories laid end to end: `values` [T] of their trained tokens in order,
    `rewards` [T] (a trajectory's reward on its last token, 0 elsewhere), `last` [T] bool (a
    trajectory's last token). Returns (advantages, returns), [T] each. No loop over tokens:
    the recursion is a scan in log2(T) vector steps (`reverse_linear_scan`)."""
    after = torch.cat([values[1:], values.new_zeros(1)]) * ~last  # V_{t+1}; 0 past a trajectory's end
    delta = rewards + gamma * after - values
    advantages = reverse_linear_scan(delta, (gamma * lam) * (~last).to(values.dtype))
    return advantages, advantages + values


def packed_gae(values: torch.Tensor, mask: torch.Tensor, seq_index: torch.Tensor, seq_rewards: torch.Tensor,
               gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over a packed micro-batch: per-token `values`, `mask` (trained tokens > 0) and `seq_index`
    [T], each sequence's reward `seq_rewards` [S]. A sequence's trained tokens are its steps, one
    after another (a multi-turn sample's tool tokens are not steps); its reward comes at its last
    trained token. Returns (advantages, returns) [T] in `values`' dtype, 0 at untrained tokens."""
    trained = mask > 0
    v, seq = values[trained].double(), seq_index[trained]
    last = torch.ones_like(seq, dtype=torch.bool)
    last[:-1] = seq[1:] != seq[:-1]
    adv, ret = gae(v, torch.where(last, seq_rewards.double()[seq], 0.0), last, gamma, lam)
    advantages, returns = torch.zeros_like(values), torch.zeros_like(values)
    advantages[trained], returns[trained] = adv.to(values.dtype), ret.to(values.dtype)
    return advantages, returns


def mean_std(n: float, total: float, squares: float) -> tuple[float, float]:
    """The mean and sample std of `n` numbers from their sum and sum of squares (sums that can be
    added over micro-batches and data-parallel ranks); (0, 0) for none."""
    n = max(n, 1.0)
    mean = total / n
    return mean, max((squares - n * mean ** 2) / max(n - 1, 1.0), 0.0) ** 0.5


def reverse_linear_scan(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x with x_t = b_t + a_t * x_{t+1} (x past the end = 0), for 1-D `b`, `a`: each element
    holds the map x_{t+1} -> x_t as (a, b); composing maps of spans 1, 2, 4, ... (Hillis-Steele)
    leaves each element the map of its whole suffix, whose constant is x_t."""
    b, a = b.clone(), a.clone()
    d, n = 1, b.numel()
    while d < n:
        # the right-hand sides read the old values: (a1, b1) after (a2, b2) = (a1 a2, b1 + a1 b2)
        b[:-d] = b[:-d] + a[:-d] * b[d:]
        a[:-d] = a[:-d] * a[d:]
        d *= 2
    return b

"""Advantages from rewards (`algorithm.advantage`).

grpo, for the n rewards r_1..r_n of one prompt's group:
    A_i = (r_i - mean(r)) / (std(r) + eps)      (normalize_std=True)
    A_i =  r_i - mean(r)                         (normalize_std=False, Dr. GRPO style)
rloo (leave-one-out): A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean(r))
reinforce_pp (REINFORCE++): over every sample of the step's batch (all groups),
    A = (r - mean_batch(r)) / (std_batch(r) + eps)
std is the sample standard deviation (n - 1 in the denominator), as in torch.std and
verl; eps = 1e-4 as in Megatron-LM. A group whose rewards are all equal carries no
learning signal for the group baselines (every A_i is 0); `is_uniform` lets the trainer
filter it out.
"""

from __future__ import annotations

import math

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

"""What a step's objective is made of, chosen once from the algorithm section: the advantage
estimator, the per-token terms added to it, and the forward passes and models they need.

The real trainer (trainer/trainer_rank.py) and the simulated one (trainer/sim_trainer.py) both read
an `AdvantagePlan`, so they cannot disagree on when proximal logprobs, a reference model or a
critic are needed. Where each token's advantage comes from:
- grpo / rloo / reinforce_pp: one number per sample from the rewards (`sample_advantages`),
  the same for each of its trained tokens;
- gae: per token, from the critic's values, in the trainer (trainer/critic.py, `packed_gae`);
- plus, with a distillation teacher, distill_coef x (teacher logprob - mu) per trained token.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.algorithm.advantages import (
    batch_normalized,
    filters_uniform_groups,
    group_advantages,
    rloo_advantages,
)
from asyncrl.algorithm.losses import NEEDS_PROX
from asyncrl.config.schema import AlgorithmConfig


@dataclass(frozen=True)
class AdvantagePlan:
    estimator: str = "grpo"  # algorithm.advantage: grpo | rloo | reinforce_pp | gae
    normalize_std: bool = True  # grpo's std scaling (algorithm.loss.normalize_adv_std)
    filter_uniform: bool = True  # groups of equal rewards left out (filters_uniform_groups)
    distill_coef: float = 0.0  # per trained token: coef x (teacher - mu); 0 without a teacher
    kl_coef: float = 0.0  # the reference model's KL term (algorithm.loss.kl_coef)
    loss_type: str = "grpo"  # algorithm.loss.type
    mask_truncated: bool = False  # truncated responses left out (algorithm.loss.mask_truncated)

    @classmethod
    def of(cls, a: AlgorithmConfig) -> AdvantagePlan:
        return cls(estimator=a.advantage, normalize_std=a.loss.normalize_adv_std,
                   filter_uniform=filters_uniform_groups(a.loss.filter_uniform_groups, a.advantage),
                   distill_coef=a.distill.coef if a.distill.teacher_path else 0.0, kl_coef=a.loss.kl_coef,
                   loss_type=a.loss.type, mask_truncated=a.loss.mask_truncated)

    @property
    def per_token(self) -> bool:
        """A training signal per token (the critic's values, a teacher): a group of one usable
        sample, or of equal rewards, still trains."""
        return self.estimator == "gae" or self.distill_coef > 0

    @property
    def needs_critic(self) -> bool:
        return self.estimator == "gae"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    def needs_prox(self, updates: int) -> bool:
        """pi_prox, the policy before the step's first update: with one update the pass that
        computes pi_theta gives it; with several it is a forward pass of its own."""
        return self.loss_type in NEEDS_PROX and updates > 1

    def forward_passes(self, updates: int) -> int:
        """Forward-only passes a step adds per token: the proximal policy's and the reference's."""
        return int(self.needs_prox(updates)) + int(self.needs_reference)

    def sample_advantages(self, rewards: list[list[float]]) -> list[list[float]]:
        """Each sample's advantage from the rewards of the step's trained groups (one list per
        group, in order): 0 for gae (its advantages are per token, from the critic)."""
        if self.estimator == "reinforce_pp":  # normalised over every sample the step trains on
            flat = iter(batch_normalized([r for group in rewards for r in group]))
            return [[next(flat) for _ in group] for group in rewards]
        if self.estimator == "rloo":
            return [rloo_advantages(group) for group in rewards]
        if self.estimator == "gae":
            return [[0.0] * len(group) for group in rewards]
        return [group_advantages(group, self.normalize_std) for group in rewards]

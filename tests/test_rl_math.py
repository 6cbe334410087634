"""Advantages and losses against values worked out by hand from the formulas
(asyncrl/algorithm/*.py docstrings). Each expected number shows its arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithm.advantages import gae, group_advantages, is_uniform, reverse_linear_scan, rloo_advantages
from asyncrl.algorithm.losses import aggregation_weights, policy_loss, value_loss
from asyncrl.config.schema import LossConfig

log = math.log


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def loss_of(logp, mu, adv, mask=None, weights=None, **kw):
    logp = t(*logp).requires_grad_(True)
    n = logp.numel()
    mask = t(*(mask or [1] * n))
    weights = t(*(weights or [1.0] * n))
    prox = kw.pop("prox", None)
    ref = kw.pop("ref", None)
    seq = kw.pop("seq", None)
    out = policy_loss(logp, t(*mu), t(*adv), mask, weights, LossConfig(**kw),
                      prox=None if prox is None else t(*prox), ref_logp=None if ref is None else t(*ref),
                      seq_index=None if seq is None else torch.tensor(seq))
    out.loss.backward()
    return out, logp.grad


def test_group_advantages_by_hand():
    # rewards 1,0,0,1: mean 0.5, deviations +-0.5, sample std sqrt(4 * 0.25 / 3) = 0.5773503
    a = group_advantages([1, 0, 0, 1])
    assert a == pytest.approx([0.5 / 0.5774503, -0.5 / 0.5774503, -0.5 / 0.5774503, 0.5 / 0.5774503], rel=1e-6)
    # rewards 3,1,2: mean 2, deviations 1,-1,0, sample std sqrt(2 / 2) = 1
    assert group_advantages([3, 1, 2]) == pytest.approx([1 / 1.0001, -1 / 1.0001, 0.0])
    assert group_advantages([3, 1, 2], normalize_std=False) == pytest.approx([1.0, -1.0, 0.0])
    assert group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert is_uniform([0.5, 0.5]) and not is_uniform([0.0, 1.0])


def test_grpo_ratio_inside_the_trust_region_is_plain_policy_gradient():
    # token 1: r = 0.5 / 0.4 = 1.25 < 1.28, objective 1.25 * 2 = 2.5 -> loss -2.5
    # token 2: r = 0.3 / 0.3 = 1, objective 1 * -1 = -1 -> loss 1
    out, grad = loss_of([log(0.5), log(0.3)], [log(0.4), log(0.3)], [2, -1], weights=[0.5, 0.5])
    assert out.loss.item() == pytest.approx((-2.5 + 1) / 2)
    # d(-w r A)/d logp = -w r A: -0.5 * 1.25 * 2, -0.5 * 1 * -1
    assert grad.tolist() == pytest.approx([-1.25, 0.5])
    assert out.sums["clip_fraction"] == 0


def test_grpo_clips_asymmetrically_and_clipped_tokens_get_no_gradient():
    # token 1: r = 0.6 / 0.4 = 1.5 > 1 + 0.28, A = 2: min(3.0, 1.28 * 2 = 2.56) -> loss -2.56
    # token 2: r = 0.2 / 0.4 = 0.5 < 1 - 0.2, A = -1: min(-0.5, 0.8 * -1 = -0.8) -> loss 0.8
    # token 3: r = 0.5 / 0.4 = 1.25, A = 1: inside -> loss -1.25
    out, grad = loss_of([log(0.6), log(0.2), log(0.5)], [log(0.4)] * 3, [2, -1, 1])
    assert out.loss.item() == pytest.approx(-2.56 + 0.8 - 1.25)
    assert grad.tolist() == pytest.approx([0.0, 0.0, -1.25])
    assert (out.sums["clip_fraction"], out.sums["clip_high"], out.sums["clip_low"]) == (2, 1, 1)
    # A ratio beyond the bound with an advantage pointing back is not clipped: r = 1.5, A = -1 -> -1.5
    out, grad = loss_of([log(0.6)], [log(0.4)], [-1])
    assert out.loss.item() == pytest.approx(1.5) and grad.tolist() == pytest.approx([1.5])
    assert out.sums["clip_fraction"] == 0


def test_decoupled_ppo_clips_against_prox_and_truncates_the_behaviour_weight():
    # u = 0.55 / 0.5 = 1.1 (inside), w = min(0.5 / 0.25, C)
    # C = 5: w = 2, loss = -2 * 1.1 * 1 = -2.2, gradient -2 * 1.1 = -2.2
    out, grad = loss_of([log(0.55)], [log(0.25)], [1], prox=[log(0.5)], type="decoupled_ppo")
    assert out.loss.item() == pytest.approx(-2.2) and grad.tolist() == pytest.approx([-2.2])
    assert out.sums["is_weight_truncated"] == 0
    # C = 1.5: w = 1.5, loss = -1.5 * 1.1 = -1.65
    out, _ = loss_of([log(0.55)], [log(0.25)], [1], prox=[log(0.5)], type="decoupled_ppo", importance_cap=1.5)
    assert out.loss.item() == pytest.approx(-1.65) and out.sums["is_weight_truncated"] == 1
    # mismatch KL(mu || prox), k3 with r = prox / mu = 2: 2 - log 2 - 1 = 0.3068528
    assert out.sums["mismatch_kl"] == pytest.approx(2 - log(2) - 1)
    # u = 0.75 / 0.5 = 1.5 > 1.28 with A = 1: clipped at 1.28, loss -1.5 * 1.28, no gradient
    out, grad = loss_of([log(0.75)], [log(0.25)], [1], prox=[log(0.5)], type="decoupled_ppo", importance_cap=1.5)
    assert out.loss.item() == pytest.approx(-1.5 * 1.28) and grad.tolist() == [0.0]
    with pytest.raises(ValueError, match="proximal"):
        loss_of([log(0.5)], [log(0.5)], [1], type="decoupled_ppo")


def test_truncated_importance_sampling():
    # w = min(0.3 / 0.1 = 3, C = 2) = 2; loss = -2 * A * logp = -2 * 1 * log 0.3; gradient -2 * A = -2
    out, grad = loss_of([log(0.3)], [log(0.1)], [1], type="tis", importance_cap=2.0)
    assert out.loss.item() == pytest.approx(-2 * log(0.3)) and grad.tolist() == pytest.approx([-2.0])
    assert out.sums["is_weight_truncated"] == 1
    # below the cap: w = 0.3 / 0.6 = 0.5; gradient -0.5 * A = 1 for A = -2
    out, grad = loss_of([log(0.3)], [log(0.6)], [-2], type="tis")
    assert grad.tolist() == pytest.approx([1.0])


def test_rloo_and_reinforce_pp_advantages_by_hand():
    # rloo: rewards 1, 0, 0, 1 -> each minus the mean of the other three: 1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3
    assert rloo_advantages([1, 0, 0, 1]) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # 3, 1, 2: 3 - 1.5, 1 - 2.5, 2 - 2 (= n / (n - 1) times the centred rewards)
    assert rloo_advantages([3, 1, 2]) == pytest.approx([1.5, -1.5, 0.0])
    assert rloo_advantages([5.0]) == [0.0]
    # REINFORCE++ normalises over the whole step: two groups [1, 0] and [1, 1] (not filtered) ->
    # batch 1, 0, 1, 1: mean 0.75, sample std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    from asyncrl.algorithm.plan import AdvantagePlan as Plan
    from asyncrl.config.schema import AlgorithmConfig
    from asyncrl.trainer.batch import build_samples
    from asyncrl.types import Segment, Trajectory, TrajectoryGroup

    def group(name, rewards):
        return TrajectoryGroup(name, name, [Trajectory(name, name, [1, 2], [Segment.from_policy([3], [-1.0], 0)],
                                                       reward=r) for r in rewards])

    groups = [group("a", [1.0, 0.0]), group("b", [1.0, 1.0])]
    samples = build_samples(groups, Plan("reinforce_pp", filter_uniform=False)).samples
    expect = [(r - 0.75) / (0.5 + 1e-4) for r in (1, 0, 1, 1)]
    assert [s.advantage for s in samples] == pytest.approx(expect)
    rloo = build_samples(groups, Plan("rloo", filter_uniform=False)).samples
    assert [s.advantage for s in rloo] == pytest.approx([1.0, -1.0, 0.0, 0.0])
    # the filter's default (null) is by the advantage: REINFORCE++ keeps the uniform group b in its
    # statistics (the same advantages as above), grpo and rloo leave it out (its advantages are all 0)
    def by_default(advantage: str, **loss):
        return build_samples(groups, Plan.of(AlgorithmConfig(advantage=advantage, loss=LossConfig(**loss))))

    assert [s.advantage for s in by_default("reinforce_pp").samples] == pytest.approx(expect)
    assert not by_default("reinforce_pp").filtered
    assert by_default("rloo").filtered == by_default("grpo").filtered == {"b": "uniform"}
    assert not by_default("grpo", filter_uniform_groups=False).filtered  # an explicit setting holds


def test_one_advantage_plan_says_what_a_step_needs():
    """The real and the simulated trainer read the same plan (asyncrl/algorithm/plan.py)."""
    from asyncrl.algorithm.plan import AdvantagePlan
    from asyncrl.config.schema import AlgorithmConfig, DistillConfig

    ppo = AdvantagePlan.of(AlgorithmConfig(advantage="gae", loss=LossConfig(type="decoupled_ppo", kl_coef=0.1)))
    assert ppo.needs_critic and ppo.per_token and ppo.needs_reference
    # pi_prox is a pass of its own only with several updates (with one, the update's own pass gives it)
    assert (ppo.needs_prox(1), ppo.needs_prox(2), ppo.forward_passes(1), ppo.forward_passes(2)) == (False, True, 1, 2)
    assert ppo.sample_advantages([[1.0, 0.0], [2.0]]) == [[0.0, 0.0], [0.0]]  # per token, from the critic
    teacher = DistillConfig(teacher_path="teacher", coef=0.5)
    distill = AdvantagePlan.of(AlgorithmConfig(distill=teacher))
    assert (distill.distill_coef, distill.per_token, distill.needs_critic) == (0.5, True, False)
    assert AdvantagePlan.of(AlgorithmConfig(distill=DistillConfig(coef=0.5))).distill_coef == 0  # no teacher
    grpo = AdvantagePlan.of(AlgorithmConfig())
    assert not grpo.per_token and grpo.filter_uniform and grpo.forward_passes(4) == 0
    # rewards 1, 0: mean 0.5, sample std sqrt(0.5) -> +-0.5 / (0.70711 + 1e-4); rloo: 1 - 0, 0 - 1
    a = 0.5 / (0.5 ** 0.5 + 1e-4)
    assert grpo.sample_advantages([[1.0, 0.0]]) == [pytest.approx([a, -a])]
    assert AdvantagePlan("rloo").sample_advantages([[1.0, 0.0]]) == [[1.0, -1.0]]
    assert not AdvantagePlan.of(AlgorithmConfig(advantage="reinforce_pp")).filter_uniform  # its batch counts them


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    # token 1: r = 0.6 / 0.4 = 1.5 > 1 + 0.28: w = 1.28 (a constant), loss -1.28 * A * logp, gradient -1.28 * A
    # token 2: r = 0.2 / 0.4 = 0.5 (no lower bound): w = 0.5, gradient -0.5 * A = 0.5 for A = -1
    out, grad = loss_of([log(0.6), log(0.2)], [log(0.4)] * 2, [2, -1], type="cispo")
    assert out.loss.item() == pytest.approx(-1.28 * 2 * log(0.6) - 0.5 * -1 * log(0.2))
    assert grad.tolist() == pytest.approx([-1.28 * 2, 0.5])  # grpo would give the clipped token none
    assert out.sums["is_weight_truncated"] == 1


def test_gspo_clips_one_ratio_per_sequence():
    # sequence 0: tokens with log-ratios log 1.5 and log(2/3): mean 0, s = 1, inside the band
    # sequence 1: one token, r = 0.5 / 0.4 = 1.25 > 1 + 4e-4 with A = 1: clipped, no gradient
    logp, mu = [log(0.6), log(0.2), log(0.5)], [log(0.4), log(0.3), log(0.4)]
    weights = [0.25, 0.25, 0.5]  # sequence aggregation: each sequence's tokens weigh 1/2 in total
    out, grad = loss_of(logp, mu, [2, 2, 1], weights=weights, seq=[0, 0, 1], type="gspo", aggregation="sequence")
    # loss = 1/2 * -(1 * 2) + 1/2 * -(1.0004 * 1)
    assert out.loss.item() == pytest.approx(-1.0 - 0.5 * 1.0004)
    # d/d logp_t of -(s A) * 1/2 with s = exp(mean log-ratio): -1/2 * A * s / len = -1/2 * 2 * 1 / 2
    assert grad.tolist() == pytest.approx([-0.5, -0.5, 0.0])
    assert (out.sums["clip_fraction"], out.sums["clip_high"]) == (1, 1)
    with pytest.raises(ValueError, match="seq_index"):
        loss_of(logp, mu, [1, 1, 1], type="gspo")


def test_icepop_weights_kept_tokens_by_their_mismatch_and_masks_the_others():
    # prox / mu = k: 0.5 / 0.25 = 2 (kept), 0.9 / 0.1 = 9 > 5 (masked), 0.1 / 0.4 = 0.25 < 0.5 (masked)
    # the kept token: u = 0.55 / 0.5 = 1.1 inside the clip, weighted by M(k) = k = 2 (IcePop's objective):
    # loss -2 * 1.1 * A, gradient d/dlogp of -2 * u * A = -2.2
    out, grad = loss_of([log(0.55), log(0.9), log(0.1)], [log(0.25), log(0.1), log(0.4)], [1, 1, 1],
                        prox=[log(0.5), log(0.9), log(0.1)], type="icepop")
    assert out.loss.item() == pytest.approx(-2.2) and grad.tolist() == pytest.approx([-2.2, 0.0, 0.0])
    assert out.sums["icepop_masked"] == 2 and float(out.tokens) == 1
    assert float(out.sums["is_weight"]) == pytest.approx(2.0)  # the kept token's weight, the only one counted
    # k = 5 is inside the band (closed), weighted 5 where decoupled_ppo truncates at importance_cap (2 here)
    out, _ = loss_of([log(0.5)], [log(0.1)], [1], prox=[log(0.5)], type="icepop")
    assert out.loss.item() == pytest.approx(-5.0) and out.sums["icepop_masked"] == 0
    capped, _ = loss_of([log(0.5)], [log(0.1)], [1], prox=[log(0.5)], type="decoupled_ppo", importance_cap=2.0)
    assert capped.loss.item() == pytest.approx(-2.0)


def test_k3_kl_to_reference_and_entropy_bonus():
    # ref 0.5, policy 0.25: d = ref - logp = log 2; k3 = e^d - d - 1 = 2 - log 2 - 1 = 0.3068528
    # ratio 1 against mu, A = 0: the PPO term is 0, so the loss is kl_coef * k3
    out, grad = loss_of([log(0.25)], [log(0.25)], [0], ref=[log(0.5)], kl_coef=0.1)
    assert out.loss.item() == pytest.approx(0.1 * (2 - log(2) - 1))
    assert out.sums["kl_ref"] == pytest.approx(2 - log(2) - 1)
    # d k3 / d logp = -e^d + 1 = -1
    assert grad.tolist() == pytest.approx([-0.1])
    logp = t(log(0.25)).requires_grad_(True)
    out = policy_loss(logp, t(log(0.25)), t(0.0), t(1.0), t(1.0), LossConfig(entropy_coef=0.01), entropy=t(1.5))
    assert out.loss.item() == pytest.approx(-0.01 * 1.5) and out.sums["entropy"] == 1.5


def test_tool_tokens_are_masked_out():
    # the masked token has a huge ratio and advantage, yet adds nothing to loss, gradient or stats
    out, grad = loss_of([log(0.5), log(0.9)], [log(0.5), log(0.01)], [1, 100], mask=[1, 0])
    assert out.loss.item() == pytest.approx(-1.0) and grad.tolist() == pytest.approx([-1.0, 0.0])
    assert out.tokens == 1 and out.sums["clip_fraction"] == 0 and out.maxima["ratio"] == pytest.approx(1.0)


def test_token_and_sequence_aggregation_weights():
    masks = [torch.tensor([1, 1, 1, 1]), torch.tensor([1, 1, 0])]
    # token: 6 trained tokens -> 1/6 each
    tok = aggregation_weights(masks, "token")
    assert tok[0].tolist() == pytest.approx([1 / 6] * 4) and tok[1].tolist() == pytest.approx([1 / 6, 1 / 6, 0])
    # sequence: mean over 2 sequences of per-sequence means -> 1/(4*2), 1/(2*2)
    seq = aggregation_weights(masks, "sequence")
    assert seq[0].tolist() == pytest.approx([1 / 8] * 4) and seq[1].tolist() == pytest.approx([1 / 4, 1 / 4, 0])
    assert sum(float(w.sum()) for w in seq) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="aggregation"):
        aggregation_weights(masks, "batch")


def test_gae_by_hand_over_two_trajectories_end_to_end():
    # Trajectory 1: 3 tokens, V = 0.5, 0.2, 0.4, reward 1; trajectory 2: 2 tokens, V = 0.1, 0.3, reward 0.
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45):
    #   t3: delta = 1 - 0.4 = 0.6;                A = 0.6
    #   t2: delta = 0.9 * 0.4 - 0.2 = 0.16;        A = 0.16 + 0.45 * 0.6 = 0.43
    #   t1: delta = 0.9 * 0.2 - 0.5 = -0.32;       A = -0.32 + 0.45 * 0.43 = -0.1265
    #   u2: delta = 0 - 0.3 = -0.3;                A = -0.3
    #   u1: delta = 0.9 * 0.3 - 0.1 = 0.17;        A = 0.17 + 0.45 * -0.3 = 0.035
    values = t(0.5, 0.2, 0.4, 0.1, 0.3)
    last = torch.tensor([False, False, True, False, True])
    adv, ret = gae(values, t(0, 0, 1, 0, 0), last, gamma=0.9, lam=0.5)
    assert adv.tolist() == pytest.approx([-0.1265, 0.43, 0.6, 0.035, -0.3])
    assert ret.tolist() == pytest.approx([0.3735, 0.63, 1.0, 0.135, 0.0])  # A + V
    # gamma = lam = 1 (the default): every token's advantage is the reward minus its own value
    adv, ret = gae(values, t(0, 0, 1, 0, 0), last, gamma=1.0, lam=1.0)
    assert adv.tolist() == pytest.approx([0.5, 0.8, 0.6, -0.1, -0.3])
    assert ret.tolist() == pytest.approx([1, 1, 1, 0, 0])


def test_the_critics_targets_on_a_packed_micro_batch_by_hand():
    """The critic's step (trainer/critic.py `prepare`): GAE over a packed row's trained tokens, each
    sequence's reward at its last trained token, a multi-turn sample's tool tokens skipped, then
    the advantages whitened over the step's tokens from sums (as over ranks and micro-batches)."""
    from asyncrl.algorithm.advantages import mean_std, packed_gae

    # sequence 0: prompt, prompt, then trained tokens with V = 0.5, 0.2, 0.4 (reward 1); sequence 1: a
    # prompt token, V = 0.1, a tool token (mask 0: not a step), V = 0.3 (reward 0). The trained tokens
    # are the previous test's two trajectories: the same advantages and returns at their positions.
    values = t(9.0, 9.0, 0.5, 0.2, 0.4, 9.0, 0.1, 9.0, 0.3)
    mask = t(0, 0, 1, 1, 1, 0, 1, 0, 1)
    seq_index = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 1])
    adv, ret = packed_gae(values, mask, seq_index, t(1.0, 0.0), gamma=0.9, lam=0.5)
    assert adv.tolist() == pytest.approx([0, 0, -0.1265, 0.43, 0.6, 0, 0.035, 0, -0.3])
    assert ret.tolist() == pytest.approx([0, 0, 0.3735, 0.63, 1.0, 0, 0.135, 0, 0.0])
    # whitening: A = -0.1265, 0.43, 0.6, 0.035, -0.3 from two micro-batches' sums: mean 0.1277,
    # sample std sqrt((0.01600225 + 0.1849 + 0.36 + 0.001225 + 0.09 - 5 * 0.1277^2) / 4) = sqrt(0.14264770)
    a = [-0.1265, 0.43, 0.6, 0.035, -0.3]
    first, second = a[:2], a[2:]
    mean, std = mean_std(5, sum(first) + sum(second), sum(x * x for x in first) + sum(x * x for x in second))
    assert mean == pytest.approx(0.1277) and std == pytest.approx(0.377687, rel=1e-5)
    assert mean_std(0, 0.0, 0.0) == (0.0, 0.0) and mean_std(1, 2.0, 4.0) == (2.0, 0.0)


def test_reverse_linear_scan_equals_the_recursion():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 64, 1000):
        b, a = torch.randn(n, generator=gen, dtype=torch.float64), torch.rand(n, generator=gen, dtype=torch.float64)
        x, expected = 0.0, []
        for bt, at in zip(reversed(b.tolist()), reversed(a.tolist())):
            x = bt + at * x
            expected.append(x)
        assert reverse_linear_scan(b, a).tolist() == pytest.approx(expected[::-1])


def test_clipped_value_loss_by_hand():
    # V_old = 0, clip 0.5, returns 1 for both tokens; weights 0.5 each.
    #   token 1: V = 0.8: clipped V = 0.5; (0.8-1)^2 = 0.04 < (0.5-1)^2 = 0.25: l = 0.5 * 0.25 = 0.125
    #            the clipped term is the larger: no gradient through V (the clamp is flat there)
    #   token 2: V = 0.3: inside the clip: l = 0.5 * 0.49 = 0.245, dl/dV = (0.3 - 1) = -0.7 (x weight 0.5)
    v = t(0.8, 0.3).requires_grad_(True)
    out = value_loss(v, t(0, 0), t(1, 1), t(1, 1), t(0.5, 0.5), value_clip=0.5)
    assert float(out.loss) == pytest.approx(0.5 * 0.125 + 0.5 * 0.245)
    out.loss.backward()
    assert v.grad.tolist() == pytest.approx([0.0, -0.35])
    assert float(out.sums["value_clip_fraction"]) == 1 and float(out.tokens) == 2
    # a masked token counts nowhere
    out = value_loss(t(0.8, 0.3), t(0, 0), t(1, 1), t(0, 1), t(0.5, 0.5), value_clip=0.5)
    assert float(out.loss) == pytest.approx(0.5 * 0.245) and float(out.sums["value_clip_fraction"]) == 0


def test_distillation_adds_the_teachers_log_ratio_to_each_trained_token():
    # Group "a": rewards 1, 0 -> grpo advantages +-0.5 / (0.7071 + 1e-4); group "b": rewards 0, 0 (uniform:
    # kept, the teacher still says something). coef 0.5; bonus = 0.5 * (teacher - mu) on trained tokens.
    from asyncrl.algorithm.plan import AdvantagePlan as Plan
    from asyncrl.trainer.batch import build_samples, pack
    from asyncrl.types import Segment, Trajectory, TrajectoryGroup

    def traj(name, reward, mu, teacher, env_tokens=0):
        segments = [Segment.from_policy([3] * len(mu), mu, 0)]
        if env_tokens:
            segments.append(Segment.from_env([9] * env_tokens))
        return Trajectory(name, name, [1, 2], segments, reward=reward, teacher_logprobs=teacher)

    groups = [TrajectoryGroup("a", "a", [traj("a", 1.0, [-1.0, -2.0], [-0.5, -2.5, 0.0], env_tokens=1),
                                         traj("a", 0.0, [-1.0], [-3.0])]),
              TrajectoryGroup("b", "b", [traj("b", 0.0, [-1.0], None), traj("b", 0.0, [-2.0], [-1.0])])]
    step = build_samples(groups, Plan(distill_coef=0.5))
    assert len(step.samples) == 4 and step.stats["trajectories_without_teacher"] == 1
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    batch = pack(step.samples)
    # sample 1: a + 0.5 * (-0.5 + 1) = a + 0.25, a + 0.5 * (-2.5 + 2) = a - 0.25, the env token a (mask 0)
    # sample 2: -a + 0.5 * (-3 + 1) = -a - 1; sample 3 (no teacher): 0; sample 4: 0.5 * (-1 + 2) = 0.5
    assert batch.advantages.tolist() == pytest.approx([a + 0.25, a - 0.25, a, -a - 1, 0.0, 0.5], rel=1e-5)
    # reverse KL per trained token, mean(mu - teacher): (-0.5 + 0.5 + 2 - 1) / 4 = 0.25
    assert step.stats["distill_reverse_kl"] == pytest.approx(0.25)

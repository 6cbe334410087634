"""From trajectory groups to packed micro-batches (asyncrl/trainer/batch.py)."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.trainer.batch import assign_weights, build_samples, micro_batches, pack, shard_for_data_parallel
from asyncrl.types import Segment, Trajectory, TrajectoryGroup


def traj(gid, reward, response=(7, 8), prompt=(1, 2, 3), status="ok", env=None):
    segs = [Segment.from_policy(list(response), [-0.5] * len(response), 3)]
    if env:
        segs += [Segment.from_env(list(env)), Segment.from_policy([9], [-0.1], 4)]
    return Trajectory(prompt_id=gid, group_id=gid, prompt_token_ids=list(prompt), segments=segs, reward=reward,
                      status=status, failure_reason="tool timed out" if status == "failed" else None)


def test_build_samples_advantages_filters_and_counts():
    groups = [
        TrajectoryGroup("a", "a", [traj("a", 1.0), traj("a", 0.0), traj("a", 0.0, status="failed")]),
        TrajectoryGroup("b", "b", [traj("b", 1.0), traj("b", 1.0)]),  # uniform: filtered
        TrajectoryGroup("c", "c", [traj("c", 0.0), traj("c", 0.0, status="failed")]),  # 1 usable: no group
    ]
    batch = build_samples(groups, AdvantagePlan(filter_uniform=True))
    s = batch.stats
    assert (s["groups"], s["groups_filtered_uniform"], s["groups_empty"], s["trajectories_failed"]) == (3, 1, 1, 2)
    # group a without its failed member: rewards 1, 0 -> mean 0.5, sample std 0.7071 -> A = +-0.5 / 0.7072
    assert [x.advantage for x in batch.samples] == pytest.approx([0.5 / 0.7072068, -0.5 / 0.7072068])
    kept = build_samples(groups, AdvantagePlan(filter_uniform=False))
    assert kept.stats["samples"] == 4 and [x.advantage for x in kept.samples[2:]] == [0.0, 0.0]


def test_truncated_responses_count_in_the_group_but_can_be_left_untrained():
    group = TrajectoryGroup("a", "a", [traj("a", 1.0), traj("a", 0.0), traj("a", 0.0, status="truncated"),
                                       traj("a", 0.0)])
    # rewards 1, 0, 0, 0: mean 0.25, sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # -> A = 0.75 / 0.5001 and -0.25 / 0.5001
    masked = build_samples([group], AdvantagePlan(mask_truncated=True))
    assert [x.advantage for x in masked.samples] == pytest.approx([1.4997, -0.49990, -0.49990], abs=1e-4)
    assert (masked.stats["trajectories_truncated"], masked.stats["trajectories_masked_truncated"]) == (1, 1)
    trained = build_samples([group], AdvantagePlan())
    assert trained.stats["samples"] == 4 and trained.stats["trajectories_masked_truncated"] == 0


def test_pack_keeps_tokens_and_masks_and_isolates_sequences():
    a = traj("a", 1.0, response=(7, 8))
    b = traj("a", 0.0, response=(5,), env=(60, 61))  # policy 5, tool 60 61, policy 9
    samples = build_samples([TrajectoryGroup("a", "a", [a, b])], AdvantagePlan()).samples
    assign_weights(samples, "token")
    p = pack(samples)
    assert p.input_ids.tolist() == [[1, 2, 3, 7, 8, 1, 2, 3, 5, 60, 61, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]
    assert p.cu_seqlens.tolist() == [0, 5, 12]
    # the logits at position i predict token i + 1; responses start at 3 and 8
    assert p.logit_index.tolist() == [2, 3, 7, 8, 9, 10]
    assert p.targets.tolist() == [7, 8, 5, 60, 61, 9]
    assert p.mask.tolist() == [1, 1, 1, 0, 0, 1]
    assert p.versions.tolist() == [3, 3, 3, -1, -1, 4]
    assert p.weights.tolist() == pytest.approx([0.25, 0.25, 0.25, 0, 0, 0.25])
    # Sequence parallelism (MoE under TP) needs a row length that TP divides: a pad sequence of its own.
    padded = pack(samples, multiple=8)
    assert padded.input_ids.tolist() == [[1, 2, 3, 7, 8, 1, 2, 3, 5, 60, 61, 9, 0, 0, 0, 0]]
    assert padded.position_ids.tolist()[0][12:] == [0, 1, 2, 3] and padded.cu_seqlens.tolist() == [0, 5, 12, 16]
    assert torch.equal(padded.logit_index, p.logit_index) and torch.equal(padded.targets, p.targets)
    assert pack(samples, multiple=4).input_ids.shape == (1, 12)  # already a multiple: unchanged


def test_data_parallel_shards_cover_every_sample_once_balanced_by_tokens():
    samples = build_samples([TrajectoryGroup("g", "g", [traj("g", float(i % 2), response=tuple(range(1 + i)))
                                                        for i in range(9)])], AdvantagePlan()).samples
    shards = [shard_for_data_parallel(samples, r, 3) for r in range(3)]
    assert sorted(id(s) for sh in shards for s in sh) == sorted(id(s) for s in samples)
    loads = [sum(len(s.tokens) for s in sh) for sh in shards]
    assert max(loads) - min(loads) <= max(len(s.tokens) for s in samples)
    assert [len(mb) for mb in micro_batches(samples, 10**6, 4)] == [4, 4, 1]
    assert torch.equal(pack(shards[0]).input_ids, pack(shard_for_data_parallel(samples, 0, 3)).input_ids)


def test_micro_batches_by_token_budget_first_fit_decreasing():
    samples = build_samples([TrajectoryGroup("g", "g", [traj("g", float(i % 2), prompt=(1,), response=(7,) * (n - 1))
                                                        for i, n in enumerate([5, 9, 2, 7, 3, 6, 15])])],
                            AdvantagePlan()).samples

    def lengths(mbs):
        return [[len(s.tokens) for s in mb] for mb in mbs]

    # longest first into the first micro-batch with room for it; 15 > 12 is trained alone
    assert lengths(micro_batches(samples, 12)) == [[15], [9, 3], [7, 5], [6, 2]]
    assert lengths(micro_batches(samples, 12, 1)) == [[15], [9], [7], [6], [5], [3], [2]]
    assert lengths(micro_batches(samples, 100)) == [[15, 9, 7, 6, 5, 3, 2]]
    assert lengths(micro_batches(samples, 100, 3)) == [[15, 9, 7], [6, 5, 3], [2]]
    assert sorted(id(s) for mb in micro_batches(samples, 12) for s in mb) == sorted(id(s) for s in samples)


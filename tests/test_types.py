import json
import pickle

import pytest

from asyncrl.types import AgentLoopSnapshot, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus


def make_trajectory(group_id: str = "g0", prompt_id: str = "p0") -> Trajectory:
    return Trajectory(
        prompt_id=prompt_id,
        group_id=group_id,
        prompt_token_ids=[5, 6, 7],
        segments=[
            Segment.from_policy([10, 11], [-0.5, -1.25], version=3),
            Segment.from_env([40, 41, 42]),  # a tool's output
            Segment.from_policy([12], [-0.125], version=[4]),
        ],
        reward=1.0,
        status=TrajectoryStatus.TRUNCATED,
        env_id="arith",
        timings={"generate_s": 0.25},
        info={"answer": "-4"},
    )


def test_flattened_views_follow_segment_order():
    t = make_trajectory()
    assert t.response_token_ids == [10, 11, 40, 41, 42, 12]
    assert t.response_logprobs == [-0.5, -1.25, 0.0, 0.0, 0.0, -0.125]
    assert t.loss_mask == [1, 1, 0, 0, 0, 1]
    assert t.versions == [3, 3, -1, -1, -1, 4]
    assert t.num_response_tokens == 6
    # Environment tokens carry no policy version: the oldest trained token is version 3.
    assert t.oldest_version() == 3


def test_pickle_round_trip():
    group = TrajectoryGroup("g0", "p0", [make_trajectory(), make_trajectory()], env_id="arith")
    snapshot = AgentLoopSnapshot("partial_tool", "calling_tools", make_trajectory(), max_new_tokens=10,
                                 loop_state={"turn": 2, "pending_tool_results": ["3"]}, num_interruptions=1)
    for obj in (make_trajectory(), group, snapshot):
        assert pickle.loads(pickle.dumps(obj)) == obj


def test_json_round_trip():
    group = TrajectoryGroup("g0", "p0", [make_trajectory()])
    assert TrajectoryGroup.from_dict(json.loads(json.dumps(group.to_dict()))) == group
    snapshot = AgentLoopSnapshot("partial_single_turn", "generating", make_trajectory(), max_new_tokens=10)
    restored = AgentLoopSnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict())))
    assert restored == snapshot
    assert restored.trajectory.status is TrajectoryStatus.TRUNCATED


def test_snapshot_budget_counts_every_response_token():
    snapshot = AgentLoopSnapshot("partial_single_turn", "generating", make_trajectory(), max_new_tokens=10)
    assert snapshot.tokens_remaining == 4
    snapshot.max_new_tokens = 5
    assert snapshot.tokens_remaining == 0


def test_segment_lengths_must_agree():
    with pytest.raises(ValueError, match="logprobs has 1 entries but token_ids has 2"):
        Segment([1, 2], [0.0], [1, 1], [0, 0])


def test_failed_trajectory_needs_a_reason():
    with pytest.raises(ValueError, match="failure_reason"):
        Trajectory("p", "g", [1], status="failed")
    t = Trajectory("p", "g", [1], status="failed", failure_reason="reward_timeout")
    assert t.status is TrajectoryStatus.FAILED


def test_group_rejects_foreign_trajectory():
    with pytest.raises(ValueError, match="holds a trajectory of group other"):
        TrajectoryGroup("g0", "p0", [make_trajectory(group_id="other")])


@pytest.mark.slow
def test_round_trip_through_the_ray_object_store(ray_cluster):
    import ray

    group = TrajectoryGroup("g0", "p0", [make_trajectory(), make_trajectory()])

    @ray.remote
    def echo(g):
        return g

    assert ray.get(echo.remote(group)) == group

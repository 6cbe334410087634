from itertools import combinations
from math import isclose

import pytest

from asyncrl.metrics import pass_at_k


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 7))
def test_matches_enumeration_of_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert isclose(pass_at_k(n, c, k), brute_force_pass_at_k(n, c, k), abs_tol=1e-12)


def test_hand_computed_values():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(8, 2, 1) == pytest.approx(2 / 8)  # pass@1 is the fraction correct
    assert pass_at_k(8, 0, 8) == 0.0
    assert pass_at_k(8, 1, 8) == 1.0
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - 35 / 210)  # 1 - C(7,4)/C(10,4)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_the_plot_draws_tool_panels_for_runs_that_call_tools(tmp_path):
    import json

    from asyncrl.monitoring.plot import _expand, plot_run

    tool_run = [{"step": 1, "batch/reward_mean": 0.5, "rollout/tool_call_validity": 0.9,
                 "rollout/tool_errors/invalid_json": 2, "rollout/tool_errors/timeout": 1}]
    series = (("rollout/tool_errors/", ""), ("batch/reward_mean", "train reward"))
    assert _expand(series, tool_run) == [("rollout/tool_errors/invalid_json", "invalid_json"),
                                         ("rollout/tool_errors/timeout", "timeout"),
                                         ("batch/reward_mean", "train reward")]
    assert _expand(series, [{"step": 1}]) == [("batch/reward_mean", "train reward")]
    for name, records in (("tools", tool_run), ("plain", [{"step": 1, "batch/reward_mean": 0.5}])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        assert plot_run(tmp_path / name).stat().st_size > 10_000


def test_length_histogram_bins_usable_responses_by_their_lower_edge():
    from asyncrl.metrics import LENGTH_BIN_TOKENS, length_histogram
    from asyncrl.types import Segment, Trajectory, TrajectoryGroup, TrajectoryStatus

    assert LENGTH_BIN_TOKENS == 8

    def traj(n: int, status: TrajectoryStatus = TrajectoryStatus.OK) -> Trajectory:
        seg = Segment(list(range(n)), [0.0] * n, [1] * n, [0] * n)
        return Trajectory("p", "g", [1], [seg], status=status, failure_reason="boom" if status == "failed" else None)

    group = TrajectoryGroup("g", "p", [traj(3), traj(8), traj(15), traj(16), traj(20, TrajectoryStatus.FAILED)])
    assert length_histogram([group, group]) == {0: 2, 8: 4, 16: 2}  # the failed response counts nowhere
    assert length_histogram([]) == {}


def test_eval_overlap_compares_the_steps_an_evaluation_ran_beside_with_the_others():
    from asyncrl.monitoring.run_log import eval_overlap

    rates = {1: 100.0, 2: 90.0, 3: 50.0, 4: 70.0, 5: 110.0, 6: 80.0}
    records = [{"step": s, "throughput/samples_per_s": v} for s, v in rates.items()]
    # started at step 2, logged at step 4: it overlapped steps 3 and 4
    records.append({"step": 4, "eval/started_step": 2, "eval/greedy_accuracy": 0.5})
    out = eval_overlap(records)
    assert out == {"steps": 2, "samples_per_s": 60.0, "samples_per_s_other_steps": 95.0, "ratio": 60.0 / 95.0}
    assert eval_overlap(records[:6]) is None  # no evaluation beside training

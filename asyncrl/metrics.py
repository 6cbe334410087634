"""Metrics that are pure math (no engine, no Ray)."""

from __future__ import annotations

from collections import Counter
from math import comb

from asyncrl.types import TrajectoryGroup, TrajectoryStatus

LENGTH_BIN_TOKENS = 8


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def length_histogram(groups: list[TrajectoryGroup]) -> dict[int, int]:
    """Response lengths of the groups' usable (not failed) trajectories: bin -> count, each bin
    LENGTH_BIN_TOKENS wide and named by its lower edge."""
    return dict(sorted(Counter(LENGTH_BIN_TOKENS * (t.num_response_tokens // LENGTH_BIN_TOKENS)
                               for g in groups for t in g.trajectories
                               if t.status is not TrajectoryStatus.FAILED).items()))


def reward_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """`batch/reward_metrics/<key>`: the mean of each per-sample reward metric (a verl reward
    function's extra keys, info["reward_metrics"]) over the trajectories that report it."""
    sums: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for t in (t for g in groups for t in g.trajectories):
        for key, value in t.info.get("reward_metrics", {}).items():
            sums[key] += value
            counts[key] += 1
    return {f"batch/reward_metrics/{key}": sums[key] / counts[key] for key in sorted(counts)}

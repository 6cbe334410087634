"""Controlled staleness (algorithm.policy_lag = L): a sync to version v sends the weights of version
v - L, so the trainer keeps what it staged of the last L + 1 versions. Shared by TrainerRank (which
keeps packed buckets) and SimTrainerRank (which keeps nothing but the version)."""

from __future__ import annotations

import collections
from typing import Any


class PolicyLag:
    def __init__(self, lag: int):
        self.lag = lag
        self.kept: collections.deque[tuple[int, Any]] = collections.deque()  # (version, weights), oldest first

    def stage(self, version: int, weights: Any, newest: bool = False) -> tuple[int, Any]:
        """Keep `weights` as `version`; returns the (version, weights) a sync to `version` sends: the one
        L versions back, or the oldest kept. `newest` sends these and starts the lag again from them
        (a restored run; the final evaluation)."""
        if newest:
            self.kept.clear()
        self.kept.append((version, weights))
        while len(self.kept) > 1 and self.kept[1][0] <= version - self.lag:
            self.kept.popleft()
        sent = self.kept[0]
        if not self.lag:
            self.kept.clear()
        return sent

    def clear(self) -> None:
        """Restored weights: the oldest a lagged sync can send from now on are the next staged."""
        self.kept.clear()

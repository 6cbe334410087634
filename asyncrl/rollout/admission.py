"""Staleness control and the prompt ledger: plain Python, no Ray (the driver calls them).

Admission (AReaL): with B prompts per train step, a weight sync every k steps and
policy version v (the number of syncs so far), a new prompt may start only while

    admitted <= (eta - lag + v + 1) * k * B

(lag: `algorithm.policy_lag`, the versions the engines run behind the trainer, so that the
tokens' staleness is lag + how far generation runs ahead, at most eta.)

where `admitted` counts every prompt ever accepted (trained, queued or running). With
eta = 0 this is synchronous on-policy training; with eta = 1 one-step off-policy; larger
eta lets generation run further ahead. Out-of-order completion can still make a group
older than eta by the time it is taken; `is_fresh` catches those so that the invariant
"no trained token is more than eta versions old" holds without exception.

The ledger keeps every admitted prompt in exactly one state (invariant 1 of DESIGN.md).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from asyncrl.types import TrajectoryGroup, staleness

STATES = ("running", "trained", "filtered", "failed")


@dataclass
class StalenessController:
    max_staleness: int  # eta
    prompts_per_step: int  # B
    sync_every_steps: int = 1  # k
    admitted: int = 0
    policy_lag: int = 0  # lag

    def capacity(self, version: int) -> int:
        ahead = self.max_staleness - self.policy_lag
        return (ahead + version + 1) * self.sync_every_steps * self.prompts_per_step

    def admissible(self, version: int) -> int:
        """How many more prompts may start now."""
        return max(0, self.capacity(version) - self.admitted)

    def on_admitted(self, n: int, version: int) -> None:
        self.admitted += n
        assert self.admitted <= self.capacity(version), (self.admitted, self.capacity(version))

    def is_fresh(self, group: TrajectoryGroup, version: int) -> bool:
        """True when no trained token of the group is more than eta versions behind `version`."""
        oldest = group.oldest_version()
        return oldest is None or staleness(version, oldest) <= self.max_staleness


@dataclass
class PromptLedger:
    """Where every admitted prompt is. `running` covers waiting in a worker, generating,
    snapshotted and queued; the others are final, with a reason for filtered and failed."""

    states: dict[str, str] = field(default_factory=dict)
    reasons: collections.Counter = field(default_factory=collections.Counter)

    def admit(self, prompt_id: str) -> None:
        if prompt_id in self.states:
            raise ValueError(f"prompt {prompt_id} admitted twice")
        self.states[prompt_id] = "running"

    def finish(self, prompt_id: str, state: str, reason: str = "") -> None:
        if state not in STATES[1:]:
            raise ValueError(f"unknown final state {state!r}")
        current = self.states.get(prompt_id)
        if current != "running":
            raise ValueError(f"prompt {prompt_id} is {current!r}, not running: cannot become {state}")
        self.states[prompt_id] = state
        if reason:
            self.reasons[f"{state}:{reason}"] += 1

    def counts(self) -> dict[str, int]:
        c = collections.Counter(self.states.values())
        return {s: c.get(s, 0) for s in STATES}

    def running(self) -> set[str]:
        return {p for p, s in self.states.items() if s == "running"}

"""Staleness control and the prompt account: plain Python, no Ray (the driver's `Prompts` calls them).

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

`PromptAccount` is the one account of a run's prompts: every admitted prompt in exactly one
state (invariant 1 of DESIGN.md), the admitted count derived from it, the order prompts were
trained in; `check` asserts that it adds up.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from asyncrl.config.schema import AlgorithmConfig
from asyncrl.types import TrajectoryGroup, staleness

STATES = ("running", "trained", "filtered", "failed")


@dataclass(frozen=True)
class StalenessController:
    """The admission rule (no state: the account counts what was admitted)."""

    max_staleness: int  # eta
    prompts_per_step: int  # B
    sync_every_steps: int = 1  # k
    policy_lag: int = 0  # lag

    @classmethod
    def of(cls, a: AlgorithmConfig) -> StalenessController:
        return cls(a.max_staleness, a.prompts_per_step, a.sync_every_steps, policy_lag=a.policy_lag)

    @property
    def window(self) -> int:
        """The prompts that may start before the first sync; each sync lets k * B more start."""
        return (self.max_staleness - self.policy_lag + 1) * self.sync_every_steps * self.prompts_per_step

    def capacity(self, version: int) -> int:
        return self.window + version * self.sync_every_steps * self.prompts_per_step

    def admissible(self, version: int, admitted: int) -> int:
        """How many more prompts may start now."""
        return max(0, self.capacity(version) - admitted)

    def queue_capacity(self) -> int:
        """Room for every group admission lets run ahead of the trainer, plus the step being taken."""
        return self.window + self.prompts_per_step

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


class InvariantBroken(AssertionError):
    """The prompt account does not add up: a bug, never a fault of the data."""


@dataclass
class PromptAccountState:
    """A checkpoint's copy of the account (ledger.json)."""

    states: dict[str, str]
    reasons: dict[str, int]
    trained: list[str]  # in the order trained (a prompt trained twice would show)
    rejected: int  # refused at admission: failed, never counted as admitted
    duplicates_dropped: int

    @classmethod
    def from_dict(cls, d: dict) -> PromptAccountState:
        """From `asdict`'s JSON (a checkpoint's ledger.json), its types checked."""
        if not isinstance(d, dict):
            raise ValueError(f"not a prompt account: a JSON object is expected, not {type(d).__name__}")
        state = cls(**{k: d.get(k) for k in ("states", "reasons", "trained", "rejected", "duplicates_dropped")})
        ok = (isinstance(state.states, dict) and all(isinstance(p, str) and s in STATES
                                                     for p, s in state.states.items())
              and isinstance(state.reasons, dict) and all(isinstance(n, int) for n in state.reasons.values())
              and isinstance(state.trained, list) and all(isinstance(p, str) for p in state.trained)
              and isinstance(state.rejected, int) and isinstance(state.duplicates_dropped, int))
        if not ok:
            raise ValueError(f"not a prompt account: states {{id: one of {STATES}}}, reasons {{str: int}}, "
                             "trained [id], rejected and duplicates_dropped integers")
        return state


class PromptAccount:
    """Every prompt of a run, one account: admitted = accepted at admission = running + trained +
    filtered + failed after acceptance; trained in order, none twice; the running ones held by a
    worker or the queue (`check`)."""

    def __init__(self, rule: StalenessController, state: PromptAccountState | None = None):
        self.rule = rule
        state = state or PromptAccountState({}, {}, [], 0, 0)
        self._ledger = PromptLedger(dict(state.states), collections.Counter(state.reasons))
        self._trained = list(state.trained)
        self._rejected = state.rejected
        # groups of prompts already finished (a dead worker's late put)
        self.duplicates_dropped = state.duplicates_dropped

    @property
    def admitted(self) -> int:
        return len(self._ledger.states) - self._rejected

    def admissible(self, version: int) -> int:
        return self.rule.admissible(version, self.admitted)

    def admit(self, prompt_ids: list[str], rejected: Mapping[str, str], version: int) -> None:
        """These prompts were dealt to the workers, which refused `rejected` (id -> reason)."""
        for p in prompt_ids:
            self._ledger.admit(p)
            if p in rejected:
                self._ledger.finish(p, "failed", rejected[p])
                self._rejected += 1
        if self.admitted > self.rule.capacity(version):
            raise InvariantBroken(f"{self.admitted} prompts admitted, more than admission's "
                                  f"{self.rule.capacity(version)} at version {version}")

    def state_of(self, prompt_id: str) -> str | None:
        return self._ledger.states.get(prompt_id)

    def trained(self, prompt_id: str) -> None:
        self._ledger.finish(prompt_id, "trained")
        self._trained.append(prompt_id)

    def filtered(self, prompt_id: str, reason: str) -> None:
        self._ledger.finish(prompt_id, "filtered", reason)

    def failed(self, prompt_id: str, reason: str) -> None:
        """An accepted prompt that cannot go on (e.g. refused when restarted)."""
        self._ledger.finish(prompt_id, "failed", reason)

    def dropped_duplicate(self) -> None:
        self.duplicates_dropped += 1

    def running(self) -> set[str]:
        return self._ledger.running()

    def counts(self) -> dict[str, int]:
        """Prompts per state (refused at admission among the failed)."""
        return self._ledger.counts()

    def reasons(self) -> dict[str, int]:
        return dict(self._ledger.reasons)

    def trained_twice(self) -> int:
        return len(self._trained) - len(set(self._trained))

    def check(self, version: int, held: set[str] | None = None) -> None:
        """Raise InvariantBroken unless the account adds up; with `held` (the prompts the workers and
        the queue hold), also unless every running prompt is held (none lost)."""
        counts = self._ledger.counts()
        problems = []
        if not 0 <= self._rejected <= counts["failed"]:
            problems.append(f"{self._rejected} prompts refused at admission but {counts['failed']} failed")
        if self.admitted > self.rule.capacity(version):
            problems.append(f"{self.admitted} admitted, more than admission's {self.rule.capacity(version)} "
                            f"at version {version}")
        if len(self._trained) != counts["trained"] or self.trained_twice():
            problems.append(f"{len(self._trained)} trainings recorded ({self.trained_twice()} of prompts trained "
                            f"before) for {counts['trained']} trained prompts")
        if held is not None and (lost := self.running() - held):
            problems.append(f"{len(lost)} running prompts are neither queued nor in a worker, e.g. {sorted(lost)[:3]}")
        if problems:
            raise InvariantBroken("prompt account broken: " + "; ".join(problems))

    def state(self) -> PromptAccountState:
        return PromptAccountState(dict(self._ledger.states), dict(self._ledger.reasons), list(self._trained),
                                  self._rejected, self.duplicates_dropped)

    def to_dict(self) -> dict:
        return asdict(self.state())

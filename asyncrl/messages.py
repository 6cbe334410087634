"""Typed messages between actors: what one actor answers another, beyond the plain data
of `asyncrl.types` (trajectories, groups, snapshots).

Every result that crosses an actor boundary in the training path is one of these
dataclasses: no `dict[str, Any]` under agreed keys, no reasons parsed out of free text.
Metrics meant only for logging stay `dict[str, float]` (their keys are the metric names).
Nothing here knows vLLM, Megatron or Ray.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncrl.types import AgentLoopSnapshot, Trajectory, TrajectoryGroup

# -- failures ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Failure:
    """Why a prompt or a trajectory failed: a stable `code` to count by, and a `detail` for people.

    Codes: empty_prompt, prompt_too_long, unknown_env, unknown_agent_loop, bad_chat_template (a
    row rejected at submit); loop_error, remote_error (a sample that could not be generated); reward_error,
    reward_timeout (a reward function that raised or hung: reward 0); <service>_error,
    <service>_timeout for each served model of asyncrl/reward/services.py (reward_model_error,
    prm_timeout, ...: it failed or hung on a sample: reward 0; the teacher's: no distillation
    term either), judge_unparsable (the judge answered what its parser cannot read: reward 0)."""

    code: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}" if self.detail else self.code


def error_line(e: BaseException) -> str:
    """What went wrong, in one line: a remote error's cause (Ray's own message starts with the
    actor's address and carries the remote traceback)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
    return f"{type(e).__name__}: {(text.splitlines() or [''])[0]}"


# -- engine -----------------------------------------------------------------------------

@dataclass
class EngineStartInfo:
    """What `EngineActor.start()` reports."""

    start_s: float
    rss_gib: float  # the actor's process tree
    cpu_cores: list[int]  # the cores its processes' threads may run on
    vllm_processes: list[str]  # by title: VLLM::EngineCore, VLLM::Worker...
    model_in_engine_core: bool
    plain_weights: bool  # vLLM-CPU linear weights kept unpacked (engine.cpu_prepack_weights=false)
    pid: int = 0  # the actor's process (logged for the served models' engines: the faults bench finds them so)


@dataclass(frozen=True)
class EngineActivity:
    """What `EngineActor.activity()` reports: running totals since the engine started. Over an
    interval, busy seconds / its length = 1 - the idle ratio (an engine serving one straggler is
    busy), request-seconds / its length = the mean number of requests running (which sees the
    straggler: utilization = that mean over the engine's concurrency)."""

    busy_s: float  # seconds with at least one request outstanding
    request_s: float  # the integral of the outstanding requests over time
    cpu_s: float = 0.0  # CPU seconds of the actor's own process (not vLLM's): its share of the control plane


@dataclass
class WeightUpdateReport:
    """What `EngineActor.update_weights()` reports: each phase's seconds, how the weights were
    loaded and what was received (per-tensor checksums, checked against the trainer's)."""

    pause_s: float
    broadcast_load_s: float  # receiving and loading, as the engine actor waits for them
    receive_s: float  # of which waiting for bytes
    load_s: float  # of which loading
    resume_s: float
    paused_s: float  # the time this engine did not generate
    load_path: str  # replay | copy | reload, +repack (asyncrl.engine.worker_extension)
    in_place_bytes: int  # received straight into parameters
    checksums: dict[str, int]
    aborted: int = 0  # pause mode none: requests whose adapter left the window, continued on the newest


# -- trainer ----------------------------------------------------------------------------

@dataclass
class TrainerSetupInfo:
    """What a trainer rank reports after `setup()`."""

    setup_s: float
    params_this_rank: int
    transformer_engine: bool
    tp: int
    pp: int
    dp: int
    weight_bytes: int  # of the whole model, as broadcast to the engines
    weight_buckets: int
    cpu_cores: list[int]  # the cores this rank may run on


@dataclass
class StagedWeights:
    """What `stage_weights(version)` reports: seconds to export and pack, the policy version the
    engines will get (older than asked with algorithm.policy_lag), and each of its tensors' checksum."""

    seconds: float
    checksums: dict[str, int]
    version: int = 0


@dataclass
class TrainStepResult:
    """One train step: its metrics (`train/...`, logged as they are), the oldest trained
    token's staleness, which the driver checks against the bound, and the groups that gave no
    training signal (prompt id -> why: "uniform", "no_usable"), which the prompt account records."""

    metrics: dict[str, float]
    staleness_max: int
    tokens: int
    filtered: dict[str, str] = field(default_factory=dict)


# -- weight sync (driver side) ------------------------------------------------------------

@dataclass
class SyncTimings:
    """One weight sync, as the driver sees it: engine-side phases are the slowest engine's."""

    version: int  # the trainer's, after the sync
    engine_version: int  # the policy the engines hold now (version - algorithm.policy_lag, at least 0)
    stage_s: float  # trainer export + pack, while the engines still generate
    total_s: float  # pause -> broadcast -> load -> resume, from the driver's calls to the last reply
    pause_s: float
    broadcast_load_s: float
    load_s: float
    resume_s: float
    paused_s: float  # the longest time an engine did not generate
    load_paths: list[str]  # per engine
    in_place_bytes: list[int]  # per engine
    aborted: int = 0  # pause mode none: requests whose adapter left the window, all engines

    def metrics(self) -> dict[str, float]:
        """`sync/<phase>` for the run's metrics (the per-engine lists left out)."""
        return {f"sync/{k}": v for k, v in asdict(self).items() if isinstance(v, (int, float))}


# -- rollout workers ----------------------------------------------------------------------

@dataclass
class Admitted:
    """A rollout worker's answer to `submit` / `restore`: the rows it accepted, and why it refused
    each of the others (by prompt id)."""

    accepted: int = 0
    rejected: dict[str, Failure] = field(default_factory=dict)

    @classmethod
    def merge(cls, answers: list[Admitted]) -> Admitted:
        return cls(sum(a.accepted for a in answers), {k: f for a in answers for k, f in a.rejected.items()})


@dataclass
class WorkerStats:
    """What a rollout worker reports: counters, what is running, and every failure by code (the
    rows it refused are answered to `submit` / `restore`, as `Admitted`)."""

    worker_id: int = 0
    prompts_submitted: int = 0
    groups_emitted: int = 0
    trajectories_finished: int = 0
    interruptions: int = 0
    resumes: int = 0
    generated_tokens: int = 0
    running_loops: int = 0
    snapshots: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # Failure.code -> count (prompts and trajectories)
    tool_calls: int = 0  # in finished trajectories (their info["tool_calls"])
    tool_errors: dict[str, int] = field(default_factory=dict)  # reason -> calls (their info["tool_errors"])
    engine_outstanding: list[int] = field(default_factory=list)  # this worker's requests per engine
    engine_failovers: int = 0  # requests that ended because their engine failed (their loops moved on)
    pending_tokens: int = 0  # policy tokens held by unfinished groups (finished samples and snapshots)
    cpu_s: float = 0.0  # CPU seconds of the worker's process so far
    # served model (asyncrl/reward/services.py) -> (samples it scored for this worker, the seconds they took)
    services: dict[str, tuple[int, float]] = field(default_factory=dict)


@dataclass
class RewardRequest:
    """A finished sample as a reward model scores it: the prompt (its text, and its messages when
    it is a conversation) and the response's text."""

    prompt: str
    response: str
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class PendingGroupState:
    """A group a rollout worker had not finished when a checkpoint was taken: the trajectories
    it had finished (None where a sample was still running) and, by sample index, the snapshot
    of each loop still running. Any worker continues it (`RolloutWorker.restore`)."""

    group_id: str
    prompt_id: str
    trajectories: list[Trajectory | None]
    snapshots: dict[int, AgentLoopSnapshot]

    def generated_tokens(self) -> int:
        """Policy tokens kept: those of the finished samples and of the snapshots."""
        done = [t for t in self.trajectories if t is not None] + [s.trajectory for s in self.snapshots.values()]
        return sum(sum(t.loss_mask) for t in done)

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "prompt_id": self.prompt_id,
                "trajectories": [t.to_dict() if t is not None else None for t in self.trajectories],
                "snapshots": {str(i): s.to_dict() for i, s in self.snapshots.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PendingGroupState:
        return cls(d["group_id"], d["prompt_id"],
                   [Trajectory.from_dict(t) if t is not None else None for t in d["trajectories"]],
                   {int(i): AgentLoopSnapshot.from_dict(s) for i, s in d["snapshots"].items()})


# -- faults -----------------------------------------------------------------------------

@dataclass
class FaultEvent:
    """One fault the driver recovered from: what died, when it was seen, how long each phase of
    the recovery took, and what it cost (prompts started again, generated tokens thrown away)."""

    # engine | rollout_worker | reward_model | judge | teacher | trainer | run (the run was stopped and
    # resumed from a checkpoint)
    kind: str
    actor: str  # its dashboard name
    step: int  # the train step during which it was found
    error: str
    phases_s: dict[str, float] = field(default_factory=dict)
    prompts_restarted: int = 0
    loops_resumed: int = 0
    tokens_lost: int = 0  # what the driver could count: a worker's last report, less what its mirror kept
    tokens_kept: int = 0  # generated tokens a replacement continues with (a dead worker's mirror)

    @property
    def recovery_s(self) -> float:
        return sum(self.phases_s.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recovery_s": self.recovery_s}


@dataclass
class ControlRequest:
    """What was asked of a running job since its last step (`asyncrl scale`, `asyncrl stop`)."""

    engines: int | None = None  # the newest engine count asked for
    stop: bool = False  # end after the current step (final evaluation, export, summary)


@dataclass
class ScaleEvent:
    """One change of a running job's engine count (`asyncrl scale`, or `engine.autoscale`): why,
    at which step, the slots it added or removed, and how long each phase took."""

    direction: str  # up | down
    engines_before: int
    engines_after: int
    step: int
    reason: str
    slots: list[int] = field(default_factory=list)
    phases_s: dict[str, float] = field(default_factory=dict)
    # added slots whose engines never got a place before the run ended (not in engines_after)
    cancelled: list[int] = field(default_factory=list)

    @property
    def scale_s(self) -> float:
        return sum(self.phases_s.values())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "scale_s": self.scale_s}


# -- queue ------------------------------------------------------------------------------

@dataclass
class QueueState:
    """The queue's contents and counters, for a checkpoint (`to_dict` is JSON)."""

    groups: list[TrajectoryGroup]
    produced: int
    consumed: int
    staleness_histogram: dict[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {"groups": [g.to_dict() for g in self.groups], "produced": self.produced, "consumed": self.consumed,
                "staleness_histogram": {str(k): v for k, v in self.staleness_histogram.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QueueState:
        return cls([TrajectoryGroup.from_dict(g) for g in d["groups"]], d["produced"], d["consumed"],
                   {int(k): v for k, v in d["staleness_histogram"].items()})


@dataclass
class QueueStats:
    """What the queue reports each step."""

    size: int
    capacity: int
    produced: int
    consumed: int
    producer_wait_s: float  # total seconds producers waited for room (backpressure)
    consumer_wait_s: float  # total seconds the trainer waited for groups
    staleness_histogram: dict[int, int]  # versions between a group's oldest token and the version it was taken at
    cpu_s: float = 0.0  # CPU seconds of the queue's process so far

    def metrics(self) -> dict[str, float | dict[int, int]]:
        return {f"queue/{k}": v for k, v in asdict(self).items()}

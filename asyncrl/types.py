"""Plain data that crosses actors: trajectories, groups and agent-loop snapshots.

Everything here is a dataclass of builtins (ints, floats, strings, lists, dicts, and the
bytes of `RoutedExperts`, base64 in JSON), so it pickles through the Ray object store and
round-trips through `to_dict`/`from_dict` (JSON) for checkpoints and the env server.
Nothing here knows vLLM, Megatron or Ray.

Token in, token out: a trajectory stores the token ids the engine produced; the
trainer consumes exactly those ids and never re-tokenizes text.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def staleness(trainer_version: Any, token_version: Any) -> Any:
    """How many policy versions a token is behind the trainer: the trainer's version minus the
    version of the policy that generated it (ints, or tensors of token versions). The one
    definition that admission, the queue's histogram and the trainers' metrics all use;
    `algorithm.max_staleness` bounds it for every trained token."""
    return trainer_version - token_version


@dataclass
class SamplingSpec:
    """What an agent loop asks of an engine for one generation request."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)  # stop strings, kept in the output
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, tests)
    stop_token_ids: list[int] = field(default_factory=list)  # stop tokens (special ones too), kept in the output


@dataclass
class RoutedExperts:
    """The experts each MoE layer's router chose for each position of a token sequence, as the
    engine that forwarded it chose them (rollout routing replay, R3; docs/moe.md).

    `data` holds uint8 expert ids [positions, layers, top_k], C order: position p is the p-th
    token of the sequence as input to the model (its routes shape the logits that predict
    token p + 1). Bytes, not lists: 2 layers x top-2 is 4 bytes a token.
    """

    data: bytes
    layers: int
    top_k: int

    @property
    def positions(self) -> int:
        return len(self.data) // (self.layers * self.top_k)

    def array(self) -> np.ndarray:
        """[positions, layers, top_k] uint8 (read-only, over `data`)."""
        return np.frombuffer(self.data, dtype=np.uint8).reshape(-1, self.layers, self.top_k)

    @classmethod
    def from_array(cls, ids: np.ndarray) -> RoutedExperts:
        if ids.ndim != 3:
            raise ValueError(f"RoutedExperts: expected [positions, layers, top_k], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError("RoutedExperts: expert ids must be in [0, 255] (uint8)")
        return cls(np.ascontiguousarray(ids, dtype=np.uint8).tobytes(), int(ids.shape[1]), int(ids.shape[2]))

    def extended(self, other: RoutedExperts | None) -> RoutedExperts:
        """These routes, then `other`'s for the positions past ours: a position keeps the routes
        of the first forward that computed it (whose policy produced the tokens that followed)."""
        if other is None or other.positions <= self.positions:
            return self
        if (other.layers, other.top_k) != (self.layers, self.top_k):
            raise ValueError(f"RoutedExperts: [{other.layers} layers, top-{other.top_k}] cannot extend "
                             f"[{self.layers} layers, top-{self.top_k}]")
        row = self.layers * self.top_k
        return RoutedExperts(self.data + other.data[self.positions * row:], self.layers, self.top_k)

    def prefix(self, positions: int) -> RoutedExperts:
        """The routes of the first `positions` positions."""
        return RoutedExperts(self.data[: positions * self.layers * self.top_k], self.layers, self.top_k)

    def to_dict(self) -> dict[str, Any]:
        return {"data": base64.b64encode(self.data).decode(), "layers": self.layers, "top_k": self.top_k}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutedExperts:
        data = d["data"]
        return cls(base64.b64decode(data) if isinstance(data, str) else bytes(data), int(d["layers"]), int(d["top_k"]))


@dataclass
class GenerationResult:
    """What an engine returns for one request: the sampled tokens, each with its logprob
    and the policy version of the weights that produced it.

    finish_reason: "stop" (EOS or a stop string), "length" (max_new_tokens or the
    context), or "abort" (interrupted by `pause("abort")`: the tokens so far are kept).
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    # With routing replay: the routes of every position this request forwarded (the prompt's,
    # then each generated token's but the last, which no forward took as input).
    routes: RoutedExperts | None = None

    @property
    def interrupted(self) -> bool:
        return self.finish_reason == "abort"


class TrajectoryStatus(str, enum.Enum):
    """How a trajectory ended."""

    OK = "ok"  # finished normally (stop token or stop string)
    TRUNCATED = "truncated"  # hit the token budget or the context length
    FAILED = "failed"  # could not be completed; `Trajectory.failure_reason` says why


@dataclass
class Segment:
    """A contiguous run of response tokens from one source.

    A policy segment holds tokens sampled by the engine (loss mask 1), each with its
    sampled-token logprob and the policy version that produced it. An environment
    segment (a tool's output, an observation) holds tokens the policy did not choose
    (loss mask 0; logprobs 0.0 and version -1 by convention).
    """

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    versions: list[int]

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        for name in ("logprobs", "loss_mask", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Segment.{name} has {len(getattr(self, name))} entries but token_ids has {n}"
                )

    @classmethod
    def from_policy(cls, token_ids: list[int], logprobs: list[float], version: int | list[int]) -> Segment:
        """Tokens sampled by the policy at `version` (one int, or one per token)."""
        versions = [version] * len(token_ids) if isinstance(version, int) else list(version)
        return cls(list(token_ids), list(logprobs), [1] * len(token_ids), versions)

    @classmethod
    def from_env(cls, token_ids: list[int]) -> Segment:
        """Tokens inserted by the environment (tool output): not trained on."""
        n = len(token_ids)
        return cls(list(token_ids), [0.0] * n, [0] * n, [-1] * n)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Trajectory:
    """One prompt's response: prompt tokens plus response segments, a reward and a status."""

    prompt_id: str
    group_id: str
    prompt_token_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    status: TrajectoryStatus = TrajectoryStatus.OK
    failure_reason: str | None = None
    env_id: str = ""
    # Wall-clock stamps and durations (seconds) of the phases this trajectory went through.
    timings: dict[str, float] = field(default_factory=dict)
    # Free-form extras a recipe wants to keep (e.g. the ground-truth answer, the parsed answer).
    info: dict[str, Any] = field(default_factory=dict)
    # With routing replay: the engine's routes for positions 0.. of prompt + response, each kept
    # from the first forward that computed it (`RoutedExperts.extended`).
    routes: RoutedExperts | None = None
    # On-policy distillation: the teacher's logprob of each response token (env tokens' too, unused)
    teacher_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        self.status = TrajectoryStatus(self.status)
        if self.status is TrajectoryStatus.FAILED and not self.failure_reason:
            raise ValueError(f"Trajectory {self.prompt_id}: status 'failed' needs a failure_reason")

    # Flattened views over the segments (what the trainer packs).
    @property
    def response_token_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def response_logprobs(self) -> list[float]:
        return [x for s in self.segments for x in s.logprobs]

    @property
    def loss_mask(self) -> list[int]:
        return [m for s in self.segments for m in s.loss_mask]

    @property
    def versions(self) -> list[int]:
        return [v for s in self.segments for v in s.versions]

    @property
    def num_response_tokens(self) -> int:
        return sum(len(s) for s in self.segments)

    def oldest_version(self) -> int | None:
        """The oldest policy version among trained tokens (None if the policy produced none)."""
        trained = [v for s in self.segments for v, m in zip(s.versions, s.loss_mask) if m]
        return min(trained) if trained else None

    def add_routes(self, routes: RoutedExperts | None) -> None:
        """Keep the routes of a generation over this trajectory's tokens (see `routes`)."""
        if routes is not None:
            self.routes = routes if self.routes is None else self.routes.extended(routes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["routes"] = self.routes.to_dict() if self.routes is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["segments"] = [Segment(**s) for s in d.get("segments", [])]
        if d.get("routes") is not None:
            d["routes"] = RoutedExperts.from_dict(d["routes"])
        return cls(**d)


@dataclass
class TrajectoryGroup:
    """The n trajectories sampled for one prompt; group-relative advantages are computed over them."""

    group_id: str
    prompt_id: str
    trajectories: list[Trajectory]
    env_id: str = ""

    def __post_init__(self) -> None:
        for t in self.trajectories:
            if t.group_id != self.group_id:
                raise ValueError(
                    f"TrajectoryGroup {self.group_id} holds a trajectory of group {t.group_id}"
                )

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]

    def oldest_version(self) -> int | None:
        versions = [v for t in self.trajectories if (v := t.oldest_version()) is not None]
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "env_id": self.env_id,
            "trajectories": [t.to_dict() for t in self.trajectories],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrajectoryGroup:
        return cls(
            group_id=d["group_id"],
            prompt_id=d["prompt_id"],
            env_id=d.get("env_id", ""),
            trajectories=[Trajectory.from_dict(t) for t in d["trajectories"]],
        )


@dataclass
class AgentLoopSnapshot:
    """The whole state of an interrupted agent loop; any worker can resume it on any engine.

    `state` is the loop's state-machine state (e.g. "generating", "calling_tools");
    `trajectory` holds the prompt and every segment generated so far; `max_new_tokens`
    is the loop's original total budget, so a resumed request asks only for what
    remains; `loop_state` carries loop-specific extras (turn count, pending tool results)
    and must itself be plain data.
    """

    loop_name: str
    state: str
    trajectory: Trajectory
    max_new_tokens: int
    loop_state: dict[str, Any] = field(default_factory=dict)
    num_interruptions: int = 0

    @property
    def tokens_remaining(self) -> int:
        return max(0, self.max_new_tokens - self.trajectory.num_response_tokens)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["trajectory"] = self.trajectory.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AgentLoopSnapshot:
        d = dict(d)
        d["trajectory"] = Trajectory.from_dict(d["trajectory"])
        return cls(**d)

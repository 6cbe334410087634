"""What every agent loop shares: its inputs, its outcome, and how it stops early.

A loop is started on a trajectory that holds only the prompt, or resumed from an
`AgentLoopSnapshot`. It ends in one of two ways:
  - finished: `LoopOutcome.trajectory` is complete (status ok / truncated / failed);
  - interrupted: `LoopOutcome.snapshot` holds everything needed to continue, on any
    worker and any engine. Interruption comes from the engine (`pause("abort")` ends
    the in-flight request with finish_reason "abort") or from the worker setting
    `interrupt` (checked before each state transition, so a running tool call
    completes before the snapshot is taken).

`AgentLoop.resume` drives the state machine: before each state it checks `interrupt`,
then runs the method named after the state, which ends the loop (a `LoopOutcome`) or
moves it on (sets `snapshot.state`, returns None). Every loop shares the generating
state; a loop adds its other states and says, in `generated`, what a finished
generation leads to.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.clock import Clock
from asyncrl.config.schema import ToolsConfig
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.inference.stops import cut_at_split_stop
from asyncrl.types import AgentLoopSnapshot, GenerationResult, SamplingSpec, Segment, Trajectory, TrajectoryStatus

_request_counter = itertools.count()


@dataclass
class LoopOutcome:
    trajectory: Trajectory | None = None  # set when the loop finished
    snapshot: AgentLoopSnapshot | None = None  # set when it was interrupted

    @property
    def finished(self) -> bool:
        return self.trajectory is not None


class AgentLoop:
    """Base class: holds the inference interface, the tokenizer and the sampling settings,
    drives the state machine and runs the generating state."""

    name: str = ""
    initial_state: str = "generating"
    states: tuple[str, ...] = ("generating",)  # each one a method of the same name
    extra_stop: tuple[str, ...] = ()  # stop strings this loop adds to every request (kept in the output)
    extra_stop_token_ids: tuple[int, ...] = ()  # stop tokens this loop adds to every request (kept too)
    uses_tools: bool = False  # runs `tools` (the rollout worker checks the sandbox at start)

    def __init__(self, engine: InferenceInterface, tokenizer: Any, sampling: SamplingSpec, max_model_len: int,
                 interrupt: asyncio.Event | None = None, env: Any = None, tools: ToolsConfig | None = None,
                 chat_prompt: bool = False, clock: Clock | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.interrupt = interrupt or asyncio.Event()
        # The problem's environment, for loops that ask it for observations (multi-turn).
        self.env = env
        self.tools = tools or ToolsConfig()
        # The prompt is a conversation rendered by the chat template (the problem has messages):
        # loops that add environment messages render them with it.
        self.chat_prompt = chat_prompt
        self.clock = clock or Clock()  # the run's: simulated seconds with simulated backends (sim_agent's tools)

    async def run(self, trajectory: Trajectory) -> LoopOutcome:
        """Start on a trajectory holding only the prompt."""
        snapshot = AgentLoopSnapshot(self.name, self.initial_state, trajectory, self.sampling.max_new_tokens)
        return await self.resume(snapshot)

    async def resume(self, snapshot: AgentLoopSnapshot) -> LoopOutcome:
        """Continue from a snapshot in whatever state it was taken."""
        while True:
            if self.interrupt.is_set():  # between states: a running tool call has completed
                return self.interrupted(snapshot, snapshot.state)
            if snapshot.state not in self.states:
                raise ValueError(f"{self.name}: unknown state {snapshot.state!r} in snapshot")
            outcome = await getattr(self, snapshot.state)(snapshot)
            if outcome is not None:
                return outcome

    async def generating(self, snapshot: AgentLoopSnapshot) -> LoopOutcome | None:
        """The generating state: out of budget -> truncated; otherwise generate what remains of
        the budget, stopping also at `extra_stop` and `extra_stop_token_ids`; aborted by the
        engine -> snapshot (the partial tokens are kept); finished -> `generated` says what next."""
        if self.budget(snapshot) == 0:
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **snapshot.loop_state)
        result = await self.generate(snapshot, stop=[*self.sampling.stop, *self.extra_stop],
                                     stop_token_ids=[*self.sampling.stop_token_ids, *self.extra_stop_token_ids])
        if result.interrupted:
            return self.interrupted(snapshot, "generating")
        return self.generated(snapshot, result)

    def generated(self, snapshot: AgentLoopSnapshot, result: GenerationResult) -> LoopOutcome | None:
        """After a generation that was not aborted. Default: the trajectory ends, truncated if
        the request hit its token budget."""
        status = TrajectoryStatus.TRUNCATED if result.finish_reason == "length" else TrajectoryStatus.OK
        return self.finish(snapshot, status, **snapshot.loop_state)

    # -- helpers for subclasses ---------------------------------------------------

    def budget(self, snapshot: AgentLoopSnapshot) -> int:
        """Tokens the next request may generate: what is left of the loop's total budget
        and of the context window."""
        t = snapshot.trajectory
        context_left = self.max_model_len - len(t.prompt_token_ids) - t.num_response_tokens
        return max(0, min(snapshot.tokens_remaining, context_left))

    async def generate(self, snapshot: AgentLoopSnapshot, **overrides: Any) -> GenerationResult:
        """Generate a continuation of prompt + response so far, appending it as a policy segment."""
        t = snapshot.trajectory
        sampling = replace(self.sampling, max_new_tokens=self.budget(snapshot), **overrides)
        request_id = f"{t.prompt_id}:{t.group_id}:{next(_request_counter)}"
        result = await self.engine.agenerate(t.prompt_token_ids + t.response_token_ids, sampling, request_id)
        if sampling.stop:  # (the tokens before the pause, only as many as the longest stop string)
            before = self.continued_tokens(t, max(len(s) for s in sampling.stop))
            result = cut_at_split_stop(before, result, sampling.stop, self.tokenizer,
                                       len(t.prompt_token_ids) + t.num_response_tokens)
        t.add_routes(result.routes)  # before the new tokens: positions past the trajectory's are theirs
        if result.token_ids:
            t.segments.append(Segment.from_policy(result.token_ids, result.logprobs, result.versions))
        return result

    @staticmethod
    def continued_tokens(t: Trajectory, limit: int) -> list[int]:
        """The last `limit` (at most) policy tokens since the last environment tokens: what the
        next request continues (after an environment's tokens a request starts fresh: no stop
        string spans them)."""
        tail: list[int] = []
        for segment in reversed(t.segments):
            if not any(segment.loss_mask) or len(tail) >= limit:
                break
            tail[:0] = segment.token_ids
        return tail[-limit:]

    def append_env(self, snapshot: AgentLoopSnapshot, text: str) -> None:
        """Append `text` (a tool's output, an environment's reply) as environment tokens (loss
        mask 0), cut so the response never exceeds the token budget or the context."""
        # split_special_tokens: text that spells a special token ("<|im_end|>", an EOS) stays text
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        self.append_env_ids(snapshot, ids)

    def append_env_ids(self, snapshot: AgentLoopSnapshot, ids: list[int]) -> None:
        """Append token ids as environment tokens (loss mask 0), cut like `append_env`."""
        ids = ids[: self.budget(snapshot)]
        if ids:
            snapshot.trajectory.segments.append(Segment.from_env(ids))

    @staticmethod
    def interrupted(snapshot: AgentLoopSnapshot, state: str) -> LoopOutcome:
        snapshot.state = state
        snapshot.num_interruptions += 1
        return LoopOutcome(snapshot=snapshot)

    @staticmethod
    def finish(snapshot: AgentLoopSnapshot, status: TrajectoryStatus, **info: Any) -> LoopOutcome:
        t = snapshot.trajectory
        t.status = status
        t.info.update(info, num_interruptions=snapshot.num_interruptions)
        return LoopOutcome(trajectory=t)

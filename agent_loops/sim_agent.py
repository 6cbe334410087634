"""sim_agent: a tool-calling episode of simulated turns, for scenarios on simulated engines
(engine=sim; docs/scale.md). The model's turns are the engine's (their lengths its length
model's); between two turns a tool call takes a drawn latency, in the run's simulated seconds,
and returns a drawn number of result tokens; the episode makes a drawn number of calls
(tools.sim: lognormals through a median and a 99th percentile).

States (snapshot.state):
  generating  1) one model turn (AgentLoop.generating); aborted by the engine: snapshot;
              2) a turn that hit the token budget ends the episode, truncated; after the
                 episode's last call's turn it ends, ok; otherwise -> calling;
  calling     3) at tools.max_calls calls the episode ends, truncated; otherwise wait the
                 call's latency (an interrupt waits for it, as for a real tool), append its
                 result as environment tokens (loss mask 0) -> generating.

Every draw is seeded by the episode (its prompt and its first response token, which the
simulated engine draws per sample) and the call's number, so an episode interrupted and
resumed on another worker runs as an uninterrupted one would.
"""

from __future__ import annotations

import random

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import register_agent_loop
from asyncrl.lognormal import lognormal
from asyncrl.types import AgentLoopSnapshot, GenerationResult, TrajectoryStatus

RESULT_TOKEN = 0  # a tool result's tokens (any id outside the simulated engine's response tokens)


@register_agent_loop("sim_agent")
class SimAgentLoop(AgentLoop):
    name = "sim_agent"
    states = ("generating", "calling")

    def _rng(self, snapshot: AgentLoopSnapshot, call: int) -> random.Random:
        t = snapshot.trajectory
        first = t.segments[0].token_ids[0] if t.segments and t.segments[0].token_ids else -1
        return random.Random(hash((tuple(t.prompt_token_ids), first, call, self.tools.sim.seed)))

    def _calls(self, snapshot: AgentLoopSnapshot) -> int:
        s = self.tools.sim
        return int(lognormal(s.calls_median, s.calls_p99, self._rng(snapshot, -1)))

    def generated(self, snapshot: AgentLoopSnapshot, result: GenerationResult) -> LoopOutcome | None:
        state = snapshot.loop_state
        state["turns"] = state.get("turns", 0) + 1
        if result.finish_reason == "length":  # 2)
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **state)
        if state.get("tool_calls", 0) >= self._calls(snapshot):
            return self.finish(snapshot, TrajectoryStatus.OK, **state)
        snapshot.state = "calling"
        return None

    async def calling(self, snapshot: AgentLoopSnapshot) -> LoopOutcome | None:
        state, s = snapshot.loop_state, self.tools.sim
        if state.get("tool_calls", 0) >= self.tools.max_calls:  # 3)
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **state)
        rng = self._rng(snapshot, state.get("tool_calls", 0))
        latency = lognormal(s.latency_median_s, s.latency_p99_s, rng)
        await self.clock.asleep(latency)
        state["tool_calls"] = state.get("tool_calls", 0) + 1
        state["tool_s"] = state.get("tool_s", 0.0) + latency
        self.append_env_ids(snapshot, [RESULT_TOKEN] * max(1, round(lognormal(s.result_tokens_median,
                                                                            s.result_tokens_p99, rng))))
        snapshot.state = "generating"
        return None

"""partial_single_turn: generate until finished; interruptible and resumable.

States: generating -> done.
  1) Ask for what remains of the total token budget, continuing prompt + response so far.
  2) Append the returned tokens (with their logprobs and versions) as a policy segment.
  3) If the engine aborted the request (a weight sync), snapshot; on resume go to 1).
  4) Otherwise finish: "length" -> truncated, "stop" -> ok.
"""

from __future__ import annotations

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import register_agent_loop
from asyncrl.types import AgentLoopSnapshot, TrajectoryStatus


@register_agent_loop("partial_single_turn")
class PartialSingleTurnLoop(AgentLoop):
    name = "partial_single_turn"

    async def resume(self, snapshot: AgentLoopSnapshot) -> LoopOutcome:
        if self.interrupt.is_set():
            return self.interrupted(snapshot, "generating")
        if self.budget(snapshot) == 0:
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED)
        result = await self.generate(snapshot)  # 1), 2)
        if result.interrupted:  # 3)
            return self.interrupted(snapshot, "generating")
        status = TrajectoryStatus.TRUNCATED if result.finish_reason == "length" else TrajectoryStatus.OK
        return self.finish(snapshot, status)  # 4)

"""multi_turn: the model and its environment take turns, until the environment ends it.

States (snapshot.state):
  generating  1) ask for what remains of the token budget (one model turn);
              2) aborted by the engine: snapshot here (the partial tokens are kept);
              3) otherwise -> observing.
  observing   4) ask the environment for its reply to the whole response so far
                 (`env(response, turn)`, see Agent.observe); None ends the episode;
              5) append the reply as environment tokens (loss mask 0), turn + 1 -> generating.
A turn that hits the token budget ends the episode, truncated.
"""

from __future__ import annotations

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import register_agent_loop
from asyncrl.types import AgentLoopSnapshot, Segment, TrajectoryStatus


@register_agent_loop("multi_turn")
class MultiTurnLoop(AgentLoop):
    name = "multi_turn"

    async def resume(self, snapshot: AgentLoopSnapshot) -> LoopOutcome:
        while True:
            if self.interrupt.is_set():
                return self.interrupted(snapshot, snapshot.state)
            turn = snapshot.loop_state.get("turns", 0)
            if snapshot.state == "generating":
                if self.budget(snapshot) == 0:
                    return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **snapshot.loop_state)
                result = await self.generate(snapshot)  # 1)
                if result.interrupted:  # 2)
                    return self.interrupted(snapshot, "generating")
                snapshot.loop_state["turns"] = turn + 1
                if result.finish_reason == "length":
                    return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **snapshot.loop_state)
                snapshot.state = "observing"  # 3)
            elif snapshot.state == "observing":
                response = self.tokenizer.decode(snapshot.trajectory.response_token_ids, skip_special_tokens=True)
                reply = self.env(response, turn) if self.env is not None else None  # 4)
                if reply is None:
                    return self.finish(snapshot, TrajectoryStatus.OK, **snapshot.loop_state)
                ids = self.tokenizer.encode(reply, add_special_tokens=False)[: self.budget(snapshot)]  # 5)
                if ids:
                    snapshot.trajectory.segments.append(Segment.from_env(ids))
                snapshot.state = "generating"
            else:
                raise ValueError(f"multi_turn: unknown state {snapshot.state!r} in snapshot")

"""multi_turn: the model and its environment take turns, until the environment ends it.

States (snapshot.state):
  generating  1) ask for what remains of the token budget (one model turn; AgentLoop.generating);
              2) aborted by the engine: snapshot here (the partial tokens are kept);
              3) otherwise turns + 1 -> observing.
  observing   4) ask the environment for its reply to the whole response so far
                 (`env(response, turns)`, see Agent.observe); None ends the episode;
              5) append the reply as environment tokens (loss mask 0) -> generating.
A turn that hits the token budget ends the episode, truncated.
"""

from __future__ import annotations

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import register_agent_loop
from asyncrl.types import AgentLoopSnapshot, GenerationResult, TrajectoryStatus


@register_agent_loop("multi_turn")
class MultiTurnLoop(AgentLoop):
    name = "multi_turn"
    states = ("generating", "observing")

    def generated(self, snapshot: AgentLoopSnapshot, result: GenerationResult) -> LoopOutcome | None:
        snapshot.loop_state["turns"] = snapshot.loop_state.get("turns", 0) + 1
        if result.finish_reason == "length":
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, **snapshot.loop_state)
        snapshot.state = "observing"  # 3)
        return None

    async def observing(self, snapshot: AgentLoopSnapshot) -> LoopOutcome | None:
        response = self.tokenizer.decode(snapshot.trajectory.response_token_ids, skip_special_tokens=True)
        reply = self.env(response, snapshot.loop_state.get("turns", 0)) if self.env is not None else None  # 4)
        if reply is None:
            return self.finish(snapshot, TrajectoryStatus.OK, **snapshot.loop_state)
        self.append_env(snapshot, reply)  # 5)
        snapshot.state = "generating"
        return None

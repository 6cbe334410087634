"""multi_turn: the model and its environment take turns, until the environment ends it.

States (snapshot.state):
  generating  1) ask for what remains of the token budget (one model turn; AgentLoop.generating);
              2) aborted by the engine: snapshot here (the partial tokens are kept);
              3) otherwise turns + 1 -> observing.
  observing   4) ask the environment for its reply to the whole response so far
                 (`env(response, turns)`, see Agent.observe); None ends the episode;
              5) append the reply as environment tokens (loss mask 0) -> generating.
A turn that hits the token budget ends the episode, truncated.

When the prompt is a conversation (`chat_prompt`: the problem has messages), a turn ends at
the chat template's end-of-turn and the environment's reply is a user message, appended as
the tokens the template renders for it (agent_loops/chat.py); the model's tokens stay as
sampled.
"""

from __future__ import annotations

from typing import Any

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.chat import chat_format
from agent_loops.registry import register_agent_loop
from asyncrl.types import AgentLoopSnapshot, GenerationResult, TrajectoryStatus


@register_agent_loop("multi_turn")
class MultiTurnLoop(AgentLoop):
    name = "multi_turn"
    states = ("generating", "observing")

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chat = chat_format(self.tokenizer) if self.chat_prompt else None
        if self.chat is not None:
            self.extra_stop = self.chat.end_of_turn.stop
            self.extra_stop_token_ids = self.chat.end_of_turn.stop_token_ids

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
        if self.chat is None:  # 5)
            self.append_env(snapshot, reply)
        else:
            response = snapshot.trajectory.response_token_ids
            tail = response[-len(self.chat.end_of_turn.closing):]
            self.append_env_ids(snapshot, self.chat.append_ids([{"role": "user", "content": reply}], tail))
        snapshot.state = "generating"
        return None

"""chat_tool: a chat model calls schema'd tools through its chat template, token-exactly.

The prompt is a rendered conversation (agent_loops.chat; the problem's messages and tool
schemas). Each assistant turn is kept exactly as sampled; its tool calls are read by the
`tools.parser` parser (hermes or simple), checked against the tools' schemas and run
concurrently (agent_loops.tools.schemas); their results are appended as the tokens the
chat template renders for tool messages (loss mask 0), up to the opening of the next
assistant turn. A call that cannot run gets an error message as its result, and the
reason is counted in info["tool_errors"].

States (snapshot.state):
  generating     1) ask for what remains of the token budget, stopping at the template's
                    end of turn (and, simple parser, at a complete call "</tool>");
                 2) aborted by the engine: snapshot here (the partial tokens are kept);
                 3) the current turn (the policy tokens after the last environment tokens,
                    so a call split by an interruption is still found) holds calls ->
                    calling_tools; otherwise done (truncated when out of budget).
  calling_tools  4) run the turn's calls to completion, even if an interrupt arrives
                    meanwhile; append their results -> generating. A turn whose calls would
                    pass tools.max_calls ends the trajectory, truncated.
The interrupt flag is checked before each state's work, so a snapshot is never taken while
a call runs; the calls of a turn are read again from its tokens when the loop resumes.
"""

from __future__ import annotations

from typing import Any

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.chat import chat_format
from agent_loops.registry import register_agent_loop
from agent_loops.tool_parsers import ToolCall, get_tool_parser
from agent_loops.tools.schemas import run_calls
from asyncrl.types import AgentLoopSnapshot, GenerationResult, TrajectoryStatus


@register_agent_loop("chat_tool")
class ChatToolLoop(AgentLoop):
    name = "chat_tool"
    states = ("generating", "calling_tools")
    uses_tools = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chat = chat_format(self.tokenizer)  # the tokenizer's template (model.chat_template sets it)
        self.parser = get_tool_parser(self.tools.parser)
        self.extra_stop = (*self.chat.end_of_turn.stop, *self.parser.stop)
        self.extra_stop_token_ids = self.chat.end_of_turn.stop_token_ids

    def generated(self, snapshot: AgentLoopSnapshot, result: GenerationResult) -> LoopOutcome | None:
        if result.finish_reason == "length" or not self.turn_calls(snapshot):  # 3)
            return super().generated(snapshot, result)
        snapshot.state = "calling_tools"
        return None

    async def calling_tools(self, snapshot: AgentLoopSnapshot) -> LoopOutcome | None:
        state = snapshot.loop_state
        calls = self.turn_calls(snapshot)
        calls_done = state.get("tool_calls", 0)
        if calls_done + len(calls) > self.tools.max_calls:
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, stop_reason="max_tool_calls", **state)
        results = await run_calls(calls, self.tools)  # 4)
        errors = dict(state.get("tool_errors", {}))
        for r in results:
            if r.error:
                errors[r.error] = errors.get(r.error, 0) + 1
        messages = [{"role": "tool", "name": r.name, "content": r.output} for r in results]
        response = snapshot.trajectory.response_token_ids
        self.append_env_ids(snapshot, self.chat.append_ids(messages, response[-len(self.chat.end_of_turn.closing):]))
        state["tool_calls"] = calls_done + len(calls)
        if errors:
            state["tool_errors"] = errors
        snapshot.state = "generating"
        return None

    def turn_calls(self, snapshot: AgentLoopSnapshot) -> list[ToolCall]:
        """The calls of the current assistant turn: the policy tokens after the last
        environment tokens (tool output is never read for calls)."""
        segments = snapshot.trajectory.segments
        env = [i for i, s in enumerate(segments) if not any(s.loss_mask)]
        turn = [t for s in segments[env[-1] + 1 if env else 0:] for t in s.token_ids]
        return self.parser.parse(self.tokenizer.decode(turn))

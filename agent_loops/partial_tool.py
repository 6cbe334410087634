"""partial_tool: generate, call tools, feed their outputs back, until done.

The model calls a tool by writing `<tool:NAME>ARGUMENT</tool>`; the loop runs it (the
`tools` config: call limit, timeout, sandbox) and appends `<result>OUTPUT</result>` as
environment tokens (loss mask 0, never trained on). The output is escaped first, so that
nothing a tool prints can close the result or open a call of its own.

States (snapshot.state):
  generating     1) ask for what remains of the token budget, stopping at "</tool>"
                    (AgentLoop.generating);
                 2) aborted by the engine: snapshot here (the partial tokens are kept);
                 3) a call is pending in the *whole* response (a call split by an
                    interruption is still found) -> calling_tools; otherwise done.
  calling_tools  4) run the pending call to completion, even if an interrupt arrives
                    meanwhile; append its escaped result -> generating. At the tool-call
                    limit (tools.max_calls) the trajectory ends, truncated.
The interrupt flag is checked before each state's work, so a snapshot is never taken
in the middle of a tool call.
"""

from __future__ import annotations

import re

from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import register_agent_loop
from agent_loops.tools import TOOLS, run_tool, unknown_tool
from agent_loops.tools.schemas import UNKNOWN_TOOL
from asyncrl.types import AgentLoopSnapshot, GenerationResult, TrajectoryStatus

TOOL_CALL = re.compile(r"<tool:(\w+)>(.*?)</tool>", re.S)
TOOL_RESULT = re.compile(r"<result>.*?</result>", re.S)
CALL_END = "</tool>"
# What would make a tool's output parse as markup: "<tool:", "</tool>", "<result>", "</result>".
_MARKUP = re.compile(r"<(?=/?(?:tool[:>]|result>))")


@register_agent_loop("partial_tool")
class PartialToolLoop(AgentLoop):
    name = "partial_tool"
    states = ("generating", "calling_tools")
    extra_stop = (CALL_END,)
    uses_tools = True

    def generated(self, snapshot: AgentLoopSnapshot, result: GenerationResult) -> LoopOutcome | None:
        if self.pending_call(snapshot) is None:  # 3)
            return super().generated(snapshot, result)
        snapshot.state = "calling_tools"
        return None

    async def calling_tools(self, snapshot: AgentLoopSnapshot) -> LoopOutcome | None:
        calls_done = snapshot.loop_state.get("tool_calls", 0)
        if calls_done >= self.tools.max_calls:
            return self.finish(snapshot, TrajectoryStatus.TRUNCATED, stop_reason="max_tool_calls",
                               **snapshot.loop_state)
        name, argument = self.pending_call(snapshot)
        if name in TOOLS:  # 4)
            output, error = await run_tool(name, argument, self.tools)
        else:
            output, error = unknown_tool(name), UNKNOWN_TOOL
        self.append_env(snapshot, f"<result>{escape_markup(output)}</result>")
        snapshot.loop_state["tool_calls"] = calls_done + 1
        if error:  # counted by reason, as the chat_tool loop counts them
            errors = dict(snapshot.loop_state.get("tool_errors", {}))
            errors[error] = errors.get(error, 0) + 1
            snapshot.loop_state["tool_errors"] = errors
        snapshot.state = "generating"
        return None

    def pending_call(self, snapshot: AgentLoopSnapshot) -> tuple[str, str] | None:
        """The first tool call in the whole response that has no result yet."""
        text = self.tokenizer.decode(snapshot.trajectory.response_token_ids)
        calls = TOOL_CALL.findall(TOOL_RESULT.sub("", text))
        done = snapshot.loop_state.get("tool_calls", 0)
        return calls[done] if len(calls) > done else None


def escape_markup(text: str) -> str:
    """`text` with every "<" that would start tool or result markup written as "&lt;"."""
    return _MARKUP.sub("&lt;", text)

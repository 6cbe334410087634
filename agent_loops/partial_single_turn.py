"""partial_single_turn: generate until finished; interruptible and resumable.

States: generating -> done.
  1) Ask for what remains of the total token budget, continuing prompt + response so far.
  2) Append the returned tokens (with their logprobs and versions) as a policy segment.
  3) If the engine aborted the request (a weight sync), snapshot; on resume go to 1).
  4) Otherwise finish: "length" -> truncated, "stop" -> ok.
"""

from __future__ import annotations

from agent_loops.base import AgentLoop
from agent_loops.registry import register_agent_loop


@register_agent_loop("partial_single_turn")
class PartialSingleTurnLoop(AgentLoop):
    """AgentLoop's generating state alone: a finished generation ends the trajectory."""

    name = "partial_single_turn"

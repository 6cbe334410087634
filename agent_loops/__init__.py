"""Agent loops and their registry.

An agent loop drives one trajectory through the engine: it generates, may call tools,
and can be stopped in any state and resumed later from an `AgentLoopSnapshot`. Loops
depend on `asyncrl.types` and the inference interface, never on the actors. A loop
class registers itself by name; configs and dataset rows choose loops by name.
"""

from agent_loops import chat_tool, multi_turn, partial_single_turn, partial_tool, sim_agent  # noqa: F401  (registers)
from agent_loops.base import AgentLoop, LoopOutcome
from agent_loops.registry import any_uses_tools, get_agent_loop, register_agent_loop, registered_agent_loops

__all__ = ["AgentLoop", "LoopOutcome", "any_uses_tools", "get_agent_loop", "register_agent_loop",
           "registered_agent_loops"]

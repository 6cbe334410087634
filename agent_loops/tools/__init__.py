"""Tools an agent loop can call: name -> async function(argument text) -> output text.

Tools never raise: every failure comes back as text starting with "error:", which the
model sees as the tool's output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agent_loops.tools.calculator import calculate
from agent_loops.tools.python_sandbox import SandboxLimits, run_python

Tool = Callable[[str], Awaitable[str]]


async def _calculator(argument: str) -> str:
    return calculate(argument)


TOOLS: dict[str, Tool] = {
    "calculator": _calculator,
    "python": run_python,
}


async def call_tool(name: str, argument: str, timeout_s: float = 30.0) -> str:
    """Run tool `name`; unknown tools, exceptions and timeouts become "error: ..." text."""
    tool = TOOLS.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}"
    try:
        return await asyncio.wait_for(tool(argument), timeout=timeout_s)
    except asyncio.TimeoutError:
        return f"error: tool {name!r} took longer than {timeout_s:g}s"
    except Exception as e:  # a tool bug must not kill the rollout
        return f"error: tool {name!r} failed: {type(e).__name__}: {e}"


__all__ = ["TOOLS", "SandboxLimits", "call_tool", "calculate", "run_python"]

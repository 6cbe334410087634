"""Tools an agent loop can call: name -> async function(argument text, sandbox config) -> output text.

Tools never raise for what the model did: every failure comes back as text starting with
"error:", which the model sees as the tool's output. A sandbox that cannot run on this host
raises SandboxUnavailable (a setup problem, not the model's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agent_loops.tools import python_sandbox
from agent_loops.tools.calculator import calculate
from agent_loops.tools.python_sandbox import SandboxUnavailable, check_sandbox, run_python
from asyncrl.config.schema import SandboxConfig, ToolsConfig

Tool = Callable[[str, SandboxConfig], Awaitable[str]]


async def _calculator(argument: str, sandbox: SandboxConfig) -> str:
    # off the event loop: the calculator caps its values, so the thread always ends quickly
    return await asyncio.to_thread(calculate, argument)


TOOLS: dict[str, Tool] = {
    "calculator": _calculator,
    "python": run_python,
}


async def call_tool(name: str, argument: str, tools: ToolsConfig | None = None) -> str:
    """Run tool `name` under `tools.timeout_s`; unknown tools, exceptions and timeouts become
    "error: ..." text."""
    tools = tools or ToolsConfig()
    tool = TOOLS.get(name)
    if tool is None:
        return f"error: unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}"
    try:
        return await asyncio.wait_for(tool(argument, tools.sandbox), timeout=tools.timeout_s)
    except asyncio.TimeoutError:
        return f"error: tool {name!r} took longer than {tools.timeout_s:g}s"
    except SandboxUnavailable:
        raise
    except Exception as e:  # a tool bug must not kill the rollout
        return f"error: tool {name!r} failed: {type(e).__name__}: {e}"


__all__ = ["TOOLS", "SandboxUnavailable", "call_tool", "calculate", "check_sandbox", "python_sandbox", "run_python"]

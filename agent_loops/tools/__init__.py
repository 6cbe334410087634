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
    if name not in TOOLS:
        return unknown_tool(name)
    output, _ = await run_tool(name, argument, tools)
    return output


def unknown_tool(name: str) -> str:
    return f"error: unknown tool {name!r}; available: {', '.join(sorted(TOOLS))}"


async def run_tool(name: str, argument: str, tools: ToolsConfig) -> tuple[str, str]:
    """Run the known tool `name` under `tools.timeout_s`: (output, "") or, when it timed out
    or raised, ("error: ..." text, the reason: "timeout" or "tool_exception")."""
    try:
        return await asyncio.wait_for(TOOLS[name](argument, tools.sandbox), timeout=tools.timeout_s), ""
    except asyncio.TimeoutError:
        return f"error: tool {name!r} took longer than {tools.timeout_s:g}s", "timeout"
    except SandboxUnavailable:
        raise
    except Exception as e:  # a tool bug must not kill the rollout
        return f"error: tool {name!r} failed: {type(e).__name__}: {e}", "tool_exception"


__all__ = ["TOOLS", "SandboxUnavailable", "call_tool", "calculate", "check_sandbox", "python_sandbox", "run_python",
           "run_tool", "unknown_tool"]

"""What the example agents share (no asyncrl import): the calculator, and how a program is run by
asyncrl's agent_process agent (asyncrl/agents/agent_process.py):

  one episode   the problem as JSON on stdin; OPENAI_BASE_URL, OPENAI_API_KEY, ASYNCRL_MODEL in the
                environment (the `openai` client reads the first two itself)
  --serve       many: one JSON line per episode on stdin ({"episode", "problem", "base_url",
                "api_key", "model", "reward_url"}), played concurrently; {"episode": <id>} on
                stdout when one is over; exits at the end of stdin (`mode: server`)

An example gives `play(client, model, problem)`, one episode with an `AsyncOpenAI` client, and
calls `main(play)` (with `close`, what its episodes shared is closed after the last).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

# A request may wait for its turn in a busy run (many episodes, a weight sync): OpenAI's default connect
# timeout of 5 s is meant for a remote API that is up or down.
TIMEOUT = httpx.Timeout(600.0, connect=60.0)
Play = Callable[[AsyncOpenAI, str, dict[str, Any]], Awaitable[Any]]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, or "error: ..."."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        result = value(ast.parse(expression.strip()[:200], mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, RecursionError) as e:
        return f"error: {e}"
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def tool_results(message: Any) -> list[dict[str, Any]]:
    """The tool messages answering an assistant message's calls (the calculator's, or an error)."""
    results = []
    for call in message.tool_calls or []:
        arguments = json.loads(call.function.arguments)
        output = calculator(str(arguments.get("expression", ""))) if call.function.name == "calculator" \
            else f"error: no tool {call.function.name!r}"
        results.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return results


def first_messages(problem: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a problem starts with: its messages, or its prompt as the user's."""
    return list(problem["messages"]) or [{"role": "user", "content": problem["prompt"]}]


async def _serve(play: Play) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running: set[asyncio.Task] = set()
    # One HTTP client for every episode's OpenAI client: making one (its TLS context) costs 43 ms of CPU.
    # Its connections are kept and reused; at most 100 are opened, however many episodes run.
    http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100, max_keepalive_connections=100))

    async def one(episode: dict[str, Any]) -> None:
        client = AsyncOpenAI(base_url=episode["base_url"], api_key=episode["api_key"], http_client=http,
                             timeout=TIMEOUT)
        try:
            await play(client, episode["model"], episode["problem"])
        except Exception as e:  # noqa: BLE001  (an episode's failure is its own; the others go on)
            print(f"episode {episode['episode']}: {type(e).__name__}: {e}", flush=True)
        print(json.dumps({"episode": episode["episode"]}), flush=True)

    while line := await reader.readline():
        task = asyncio.ensure_future(one(json.loads(line)))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)


async def _main(play: Play, close: Callable[[], Awaitable[Any]] | None) -> None:
    try:
        if "--serve" in sys.argv:
            return await _serve(play)
        async with AsyncOpenAI(timeout=TIMEOUT) as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
            answer = await play(client, os.environ.get("ASYNCRL_MODEL", "asyncrl"), json.load(sys.stdin))
        print(json.dumps({"answer": answer}))
    finally:
        if close is not None:
            await close()


def main(play: Play, close: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Run the program's episode(s) with `play`; `close()` after the last (what the episodes shared)."""
    asyncio.run(_main(play, close))

"""A calculator agent written with the plain `openai` client: no asyncrl import.

It answers one problem a run (its JSON on stdin: prompt, messages, tools) by chatting with the
model behind OPENAI_BASE_URL (the `openai` client reads it and OPENAI_API_KEY from the
environment), running the calculator the model calls and sending back its results, turn after
turn, until the model answers without a call. It posts no reward: the run scores the answer.
With --serve it plays many episodes, each given on a line of stdin with its own base URL and key
(asyncrl's agent_process `mode: server`).

    asyncrl train recipe=arith_openai     # asyncrl runs it once per rollout worker, --serve
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import sys

from openai import AsyncOpenAI

MAX_TURNS = 4
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


async def play(client: AsyncOpenAI, model: str, problem: dict) -> list[dict]:
    """One episode: the conversation, turn after turn, until the model answers without a call."""
    messages = list(problem["messages"]) or [{"role": "user", "content": problem["prompt"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=problem["tools"] or None)
        message = reply.choices[0].message
        messages.append(message.model_dump())  # the whole message back, as most agents keep it
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            output = calculator(str(arguments.get("expression", ""))) if call.function.name == "calculator" \
                else f"error: no tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return messages


async def serve() -> None:
    """--serve: episodes as JSON lines on stdin, played concurrently; {"episode": id} on stdout when done."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    running = set()

    async def one(episode: dict) -> None:
        async with AsyncOpenAI(base_url=episode["base_url"], api_key=episode["api_key"]) as client:
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


async def main() -> None:
    if "--serve" in sys.argv:
        return await serve()
    async with AsyncOpenAI() as client:  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
        messages = await play(client, os.environ.get("ASYNCRL_MODEL", "asyncrl"), json.load(sys.stdin))
    print(json.dumps({"answer": messages[-1].get("content"), "turns": len(messages)}))


if __name__ == "__main__":
    asyncio.run(main())

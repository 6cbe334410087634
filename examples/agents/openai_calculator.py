"""A calculator agent written with the plain `openai` client: no asyncrl import.

It chats with the model, runs the calculator the model calls and sends back its results, turn
after turn, until the model answers without a call. It posts no reward: the run scores the
answer. How asyncrl runs it (one episode, or many with --serve): episodes.py.

    asyncrl train recipe=arith_openai
"""

from __future__ import annotations

from typing import Any

from episodes import first_messages, main, tool_results
from openai import AsyncOpenAI

MAX_TURNS = 4


async def play(client: AsyncOpenAI, model: str, problem: dict[str, Any]) -> str | None:
    """One episode; the model's last answer."""
    messages = first_messages(problem)
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model=model, messages=messages, tools=problem["tools"] or None)
        message = reply.choices[0].message
        messages.append(message.model_dump())  # the whole message back, as most agents keep it
        if not message.tool_calls:
            break
        messages += tool_results(message)
    return messages[-1].get("content")


if __name__ == "__main__":
    main(play)

"""The calculator agent written with the OpenAI Agents SDK: an `Agent` with a function tool, run by
`Runner` through the SDK's chat-completions model. No asyncrl import.

It posts no reward: the run scores the final answer. How asyncrl runs it (one episode, or many with
--serve): episodes.py.

    asyncrl train recipe=arith_agents_sdk
"""

from __future__ import annotations

from typing import Any

import episodes
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

MAX_TURNS = 4


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % and parentheses).

    Args:
        expression: The expression, e.g. (17 - 5) * 3
    """
    return episodes.calculator(expression)


async def play(client: AsyncOpenAI, model: str, problem: dict[str, Any]) -> str:
    """One episode: the agent runs until it answers without a call (at most MAX_TURNS model turns)."""
    agent = Agent(name="calculator", model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                  tools=[calculator])
    try:
        result = await Runner.run(agent, input=episodes.first_messages(problem), max_turns=MAX_TURNS)
    except MaxTurnsExceeded:
        return ""
    return str(result.final_output)


if __name__ == "__main__":
    set_tracing_disabled(True)  # the SDK would send its traces to OpenAI's servers
    episodes.main(play)

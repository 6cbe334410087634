"""The calculator agent as a `verifiers` environment (prime-rl's environments library, 0.4.0): a
taskset of one task, the problem, played by verifiers' single-agent env. No asyncrl import.

It runs from .venv-verifiers (scripts/setup_agent_venvs.sh makes it), as verifiers needs openai<3.

verifiers 0.4.0 has no ToolEnv: an env is a taskset (its tasks), a harness (the agent program)
and a runtime. Its own tool loop (the `null` harness) is a script it installs with uv, and its
tools are MCP servers; this harness instead runs the loop in this process, with the calculator as
a plain function, which verifiers allows as long as every model call goes to the endpoint it
hands the harness. That endpoint is verifiers' interception proxy: it records the turn on the
episode's trace and relays the request to our model, with an HTTP client of its own per episode
(base URL, key and timeouts from ours). One env serves every episode of the process (as one env
serves an evaluation's tasks): its proxy starts once, each episode is one task with its own model
endpoint (its session).

It posts no reward: the run scores the answer. How asyncrl runs it (one episode, or many with
--serve): episodes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import uuid
from typing import Any

import httpx
import verifiers.v1 as vf
from episodes import first_messages, main, tool_results
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

__all__ = ["CalculatorHarness", "CalculatorTaskset"]  # what verifiers looks up in this module
MAX_TURNS = 4


@functools.cache
def _http() -> DefaultAsyncHttpxClient:
    """One HTTP client for every episode's calls: making one (its TLS context) costs 50 ms of CPU."""
    return DefaultAsyncHttpxClient()


class CalculatorData(vf.TaskData):
    tools: list[dict[str, Any]] = []  # the problem's tool schemas, as sent to the model


class CalculatorTask(vf.Task[CalculatorData, vf.State]):
    pass


class CalculatorTasksetConfig(vf.TasksetConfig):
    pass


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorTasksetConfig]):
    """No tasks of its own: each episode's task is its problem (task())."""

    def load(self):
        return iter(())


def task(problem: dict[str, Any]) -> CalculatorTask:
    data = CalculatorData(id=problem["prompt_id"], prompt=first_messages(problem), tools=problem["tools"])
    return CalculatorTask(data)


class CalculatorHarness(vf.Harness[vf.HarnessConfig]):
    """The agent loop, in process: chat, run the calculator calls, until an answer without one."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: CalculatorData, **_: Any) -> vf.ProgramResult:
        proxy = AsyncOpenAI(base_url=endpoint, api_key=secret, http_client=_http())
        messages = [message.model_dump(mode="json", exclude_none=True) for message in data.prompt]
        for _ in range(MAX_TURNS):
            reply = await proxy.chat.completions.create(model=ctx.model, messages=messages, tools=data.tools or None)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))  # as verifiers' own chat loop keeps it
            if not message.tool_calls:
                break
            messages += tool_results(message)
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


_ENV: vf.SingleAgentEnv | None = None
_SERVING = asyncio.Lock()
_RESOURCES = contextlib.AsyncExitStack()  # the env's serving, held until the process exits


async def serving_env() -> vf.SingleAgentEnv:
    """The process's env, serving (its interception proxy started) from the first episode on."""
    global _ENV
    async with _SERVING:
        if _ENV is None:
            # verifiers finds the taskset (and its harness) by module name: this module, run or imported.
            env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(
                taskset=CalculatorTasksetConfig(id=__name__),
                agent=vf.AgentConfig(runtime=vf.SubprocessConfig())))  # its default runtime is a remote sandbox
            await _RESOURCES.enter_async_context(env.serving())
            _ENV = env
    return _ENV


async def play(client: AsyncOpenAI, model: str, problem: dict[str, Any]) -> str:
    """One episode: the env's rollout of the problem, through our client's endpoint; its answer."""
    env = await serving_env()
    # verifiers takes no client, but an endpoint: our client's, whose key it reads from a variable
    key_var = f"ASYNCRL_API_KEY_{uuid.uuid4().hex}"
    os.environ[key_var] = client.api_key
    endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=key_var,
                                   timeout=httpx.Timeout(client.timeout).as_dict())
    try:
        episode = await env.run_episode(task(problem), vf.ModelContext(model=model, client=endpoint))
    finally:
        del os.environ[key_var]
    if not episode.ok:
        error = ([e for trace in episode.traces for e in trace.errors] + episode.errors)[-1]
        raise RuntimeError(f"{error.type} (status {error.status_code}): {error.message}")
    return episode.traces[-1].last_reply


if __name__ == "__main__":
    main(play, close=_RESOURCES.aclose)

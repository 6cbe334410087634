"""The chat endpoint (asyncrl/rollout/chat_sessions.py) over real HTTP with the real `openai` client, and
agent programs run as processes (asyncrl/agents/agent_process.py), on a scripted engine: what a
session records must be the tokens the engine sampled, token for token, across turns, branches and
weight syncs; what the endpoint does not honour is refused by name and counted.

The real engines' path (vLLM, the example program) is tests/test_tool_loop_vllm.py's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from agent_loops.chat import chat_format
from agent_loops.tools.schemas import tool_schemas
from asyncrl.agents.agent_process import AgentProcessAgent
from asyncrl.agents.api import load_tokenizer
from asyncrl.agents.registry import build_agent
from asyncrl.config.schema import AgentConfig
from asyncrl.rollout.chat_sessions import ChatSettings
from asyncrl.rollout.gateway import InferenceGateway
from asyncrl.run_config import load_config
from asyncrl.types import SamplingSpec, TrajectoryStatus
from tests.scripted_inference import Reply, Request, ScriptedInference

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "agents"
VERIFIERS_PYTHON = REPO / ".venv-verifiers" / "bin" / "python"  # scripts/setup_agent_venvs.sh (make venv)
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
TOOLS = tool_schemas(["calculator"])


@pytest.fixture(scope="module")
def cfg():
    return load_config(["recipe=arith_openai"])


@pytest.fixture(scope="module")
def tokenizer(cfg):
    return load_tokenizer(cfg.model.path, cfg.model.chat_template)


def turn_ids(tokenizer, text: str) -> list[int]:
    """A turn as the model writes it: its text, then the end-of-turn token."""
    return tokenizer.encode(text, add_special_tokens=False) + list(chat_format(tokenizer).end_of_turn.stop_token_ids)


class Served:
    """A gateway with chat sessions over a scripted engine, served on loopback; failures it counted."""

    def __init__(self, engine: ScriptedInference, tokenizer: Any, max_model_len: int = 256):
        self.counts: dict[str, int] = {}
        self.gateway = InferenceGateway(lambda: engine, tokenizer, chat=ChatSettings("hermes", max_model_len, 1e6),
                                        count=lambda code, detail: self.counts.__setitem__(
                                            code, self.counts.get(code, 0) + 1))
        self.sessions = self.gateway.sessions

    async def client(self, sampling: SamplingSpec | None = None) -> tuple[Any, openai.AsyncOpenAI]:
        ticket = await self.sessions.open_session(sampling or SamplingSpec(max_new_tokens=192))
        return ticket, openai.AsyncOpenAI(base_url=ticket.base_url, api_key=ticket.api_key, max_retries=0)


def run(coro_fn):
    return asyncio.run(coro_fn())


def test_a_multi_turn_session_trains_exactly_the_sampled_tokens_across_a_weight_sync(tokenizer):
    """Turn 1 calls the calculator; turn 2 is cut by a weight sync (abort) and resumed at the next
    version. The trajectory is the first request's rendering, then each turn's sampled tokens (ids,
    logprobs, versions as the engine gave them) and the template's tokens for the tool result."""
    chat = chat_format(tokenizer)
    call, answer = turn_ids(tokenizer, CALL.format("2+3")), turn_ids(tokenizer, "Answer: 5")
    engine = ScriptedInference([Reply(call, version=3, logprobs=[-0.25] * len(call)),
                                Reply(answer[:4], "abort", version=3), Reply(answer[4:], version=4)], tokenizer)
    served = Served(engine, tokenizer)

    async def main():
        ticket, client = await served.client()
        messages = [{"role": "user", "content": "2+3 =\n"}]
        first = await client.chat.completions.create(model=ticket.model, messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.tool_calls[0].function.name == "calculator"
        assert json.loads(message.tool_calls[0].function.arguments) == {"expression": "2+3"}
        messages += [message.model_dump(), {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
        second = await client.chat.completions.create(model=ticket.model, messages=messages, tools=TOOLS,
                                                      logprobs=True)
        assert second.choices[0].message.content == "Answer: 5" and second.choices[0].finish_reason == "stop"
        assert len(second.choices[0].logprobs.content) == len(answer)
        await served.gateway.stop()
        return served.sessions.close_session(ticket.session_id), messages

    record, messages = run(main)
    assert len(record.branches) == 1 and record.turns == 2 and record.reward is None
    t = record.branches[0]
    prompt = chat.prompt(messages[:1], TOOLS)
    env = chat.append_ids([{"role": "tool", "name": "calculator", "content": "5"}], call)
    assert t.prompt_token_ids == prompt
    assert t.response_token_ids == call + env + answer
    assert t.loss_mask == [1] * len(call) + [0] * len(env) + [1] * len(answer)
    assert t.versions == [3] * len(call) + [-1] * len(env) + [3] * 4 + [4] * (len(answer) - 4)
    assert t.response_logprobs[:len(call)] == [-0.25] * len(call)
    # what the engine was asked on turn 2: exactly the recorded tokens before the answer
    assert engine.requests[1].prompt_token_ids == prompt + call + env
    assert engine.requests[2].prompt_token_ids == prompt + call + env + answer[:4]  # resumed after the sync
    # the recorded conversation renders as the template renders the whole of it
    whole = chat.render([*messages[:1], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}]},
        {"role": "tool", "name": "calculator", "content": "5"}], TOOLS, add_generation_prompt=True)
    assert tokenizer.decode(prompt + call + env) == tokenizer.decode(whole)


def test_an_edited_history_branches_and_each_sampled_token_is_trained_once(tokenizer):
    """Turn 2 continues turn 1; then the agent rewrites turn 2's tool result (a retry): the third
    request forks at the end of turn 1. The fork holds turn 1's tokens as context (mask 0), so the
    branches together train every sampled token once; `branches=last` keeps the last alone."""
    call = turn_ids(tokenizer, CALL.format("2+3"))
    replies = [call, turn_ids(tokenizer, "Answer: 6"), turn_ids(tokenizer, "Answer: 5")]
    engine = ScriptedInference([Reply(r, version=i) for i, r in enumerate(replies)], tokenizer)
    served = Served(engine, tokenizer)

    async def main():
        ticket, client = await served.client()
        messages = [{"role": "user", "content": "2+3 =\n"}]
        first = (await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)).choices[0].message
        history = [*messages, first.model_dump(exclude_none=True)]
        tool = {"role": "tool", "tool_call_id": first.tool_calls[0].id}
        await client.chat.completions.create(model="m", messages=[*history, {**tool, "content": "6"}], tools=TOOLS)
        await client.chat.completions.create(model="m", messages=[*history, {**tool, "content": "5"}], tools=TOOLS)
        return served.sessions.close_session(ticket.session_id)

    record = run(main)
    assert len(record.branches) == 2 and record.turns == 3
    old, last = record.branches
    assert old.prompt_token_ids == last.prompt_token_ids
    assert old.response_token_ids[:len(call)] == last.response_token_ids[:len(call)] == call
    assert last.loss_mask[:len(call)] == [0] * len(call)  # shared: trained in `old` only
    assert last.response_token_ids[-len(replies[2]):] == replies[2]
    assert sum(old.loss_mask) + sum(last.loss_mask) == sum(map(len, replies))
    assert engine.requests[2].prompt_token_ids == last.prompt_token_ids + last.response_token_ids[:-len(replies[2])]


@pytest.mark.attack
def test_the_endpoint_refuses_what_it_does_not_honour_by_name_and_counts_it(tokenizer):
    engine = ScriptedInference(lambda request: Reply(turn_ids(tokenizer, "Answer: 1")), tokenizer)
    served = Served(engine, tokenizer, max_model_len=128)
    user = [{"role": "user", "content": "1 =\n"}]

    async def main():
        ticket, client = await served.client(SamplingSpec(max_new_tokens=8, temperature=1.0))
        other, other_client = await served.client()
        refused: list[tuple[int, str]] = []

        async def expect(status: int, words: str, **kwargs: Any) -> None:
            with pytest.raises(openai.APIStatusError) as e:
                await client.chat.completions.create(**{"model": "m", "messages": user, **kwargs})
            assert e.value.status_code == status and words in e.value.message, (kwargs, e.value.message)
            refused.append((status, words))

        await expect(400, "frequency_penalty", frequency_penalty=0.5)
        await expect(400, "seed: Extra inputs are not permitted", extra_body={"seed": 3})
        await expect(400, "temperature=0.5: this session samples at temperature=1", temperature=0.5)
        await expect(400, "n: Input should be less than or equal to 1", n=2)
        await expect(400, "tool_choice", tool_choice="required", tools=TOOLS)
        await expect(400, "messages.0.content", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
        await expect(400, "'shell' is not a tool of this request", tools=TOOLS, messages=[*user, {
            "role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"}])
        await expect(400, "tool_call_id 'nope' answers no call", messages=[*user, {"role": "tool",
                                                                                  "tool_call_id": "nope",
                                                                                  "content": "x"}])
        await expect(400, "the last message is the assistant's", messages=[*user, {"role": "assistant",
                                                                                  "content": "Answer:"}])
        await expect(400, "leaves no room to answer", messages=[{"role": "user", "content": "1 + " * 60}])
        answered = await client.chat.completions.create(model="m", messages=user, max_tokens=3)
        assert answered.choices[0].finish_reason == "length"  # within the session's budget of 8
        await client.chat.completions.create(model="m", messages=user)  # a second branch: 5 tokens left
        await expect(400, "sampled its 8 tokens", messages=[*user, answered.choices[0].message.model_dump(),
                                                            {"role": "user", "content": "again"}])
        async with httpx.AsyncClient() as http:
            base = ticket.base_url.removesuffix("/v1")
            root = base.split("/sessions/")[0]
            # a session's key is its own: not another session's, not the gateway's other routes
            r = await http.post(f"{other.base_url}/chat/completions", json={"messages": user},
                                headers={"Authorization": f"Bearer {ticket.api_key}"})
            assert r.status_code == 403
            r = await http.post(f"{root}/v1/completions", json={"prompt": [1, 2]},
                                headers={"Authorization": f"Bearer {ticket.api_key}"})
            assert r.status_code == 403
            # ... not through its own path either (the path is matched as decoded, never normalized)
            r = await http.post(f"{base}/%2e%2e/%2e%2e/v1/completions", json={"prompt": [1, 2]},
                                headers={"Authorization": f"Bearer {ticket.api_key}"})
            assert r.status_code == 404, r.text
            for body, status in [({"reward": "1"}, 400), ({"reward": 1e300}, 400), ({"reward": True}, 400),
                                 ({"reward": 1, "more": 2}, 400), ({"reward": 0.5}, 200), ({"reward": 0.5}, 409)]:
                r = await http.post(ticket.reward_url, json=body, headers={"Authorization": f"Bearer {ticket.api_key}"})
                assert r.status_code == status, (body, r.text)
            r = await http.post(ticket.reward_url, content=b'{"reward": NaN}',
                                headers={"Authorization": f"Bearer {ticket.api_key}"})
            assert r.status_code == 422  # the guard's strict JSON
        assert await served.sessions.rewarded(ticket.session_id) == 0.5
        record = served.sessions.close_session(ticket.session_id)
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="m", messages=user)
        served.sessions.close_session(other.session_id)
        return record, refused

    record, refused = run(main)
    assert record.reward == 0.5 and len(record.branches) == 2
    assert sum(record.refused.values()) == len(refused) + 5  # + the four bad rewards and the second one
    assert served.counts.get("chat_bad_request", 0) >= 8 and served.counts["chat_budget_spent"] == 1
    assert served.counts["chat_unknown_session"] == 1
    assert len(engine.requests) == 2  # nothing refused reached the engine


def test_a_streamed_answer_assembles_to_the_same_message(tokenizer):
    engine = ScriptedInference(lambda request: Reply(turn_ids(tokenizer, CALL.format("1+1"))), tokenizer)
    served = Served(engine, tokenizer)

    async def main():
        ticket, client = await served.client()
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}],
                                                      tools=TOOLS, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        served.sessions.close_session(ticket.session_id)
        return chunks

    chunks = run(main)
    calls = [c for chunk in chunks for choice in chunk.choices for c in choice.delta.tool_calls or []]
    assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "1+1"}]
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


# -- agent programs as processes ---------------------------------------------------------------

def _calculator_script(request: Request, tokenizer: Any) -> Reply:
    """The model of these tests: calls the calculator on the question, then answers its result."""
    text = tokenizer.decode(request.prompt_token_ids)
    if "<tool_response>" not in text:
        expression = text.rsplit("user\n", 1)[1].split(" =")[0]
        return Reply(turn_ids(tokenizer, CALL.format(expression)), version=1)
    result = text.rsplit("<tool_response>\n", 1)[1].split("\n")[0]
    return Reply(turn_ids(tokenizer, f"Answer: {result}"), version=2)


def _agent(cfg, tmp_path: Path, program: str | None = None, mode: str = "episode",
           example: str = "openai_calculator.py", **params: Any) -> AgentProcessAgent:
    """The recipe's agent, running an example (in `mode`; from its own virtualenv where it has one) or
    `program`."""
    spec = next(a for a in cfg.agents if a.env_id == "arith_openai")
    python = str(VERIFIERS_PYTHON) if example.startswith("verifiers") else "{python}"
    command = [python, str(EXAMPLES / example), *(["--serve"] if mode == "server" else [])]
    if program is not None:
        path = tmp_path / "agent.py"
        path.write_text(textwrap.dedent(program))
        command = [sys.executable, str(path)]
    merged = AgentConfig(env_id=spec.env_id, type=spec.type, weight=1.0,
                         params={**spec.params, "command": command, "mode": mode, **params})
    return build_agent(merged, cfg)


@pytest.mark.parametrize(("example", "mode"), [("openai_calculator.py", "episode"), ("openai_calculator.py", "server"),
                                               ("agents_sdk_calculator.py", "server"),
                                               ("verifiers_calculator.py", "server")])
def test_the_examples_play_groups_and_their_answers_are_scored(cfg, tokenizer, tmp_path, example, mode):
    """The example agents, written with the plain `openai` client, with the OpenAI Agents SDK and as a
    `verifiers` environment (from its own virtualenv: openai<3): whatever their libraries send, the
    endpoint honours; each episode is two turns (a call, then the answer), scored by the recipe's reward."""
    if example.startswith("verifiers") and not VERIFIERS_PYTHON.exists():
        pytest.fail(f"{VERIFIERS_PYTHON} is missing: `make venv` (scripts/setup_agent_venvs.sh) makes it")
    engine = ScriptedInference(lambda request: _calculator_script(request, tokenizer), tokenizer)
    served = Served(engine, tokenizer)
    agent = _agent(cfg, tmp_path, mode=mode, example=example)
    problems = agent.problems("train")[:2]

    async def main():
        groups = await asyncio.gather(*[agent.grouped_rollout(p, 2, served.gateway, f"g{i}")
                                        for i, p in enumerate(problems)])
        server = agent._server
        # server: one program played all four episodes, and exits at its stdin's end (a loaded machine's time)
        exit_code = await agent.close(timeout_s=120)
        await served.gateway.stop()
        return groups, server, exit_code

    groups, server, exit_code = run(main)
    assert (server is None) == (mode == "episode") and exit_code == (0 if mode == "server" else None)
    assert not served.counts, served.counts  # no request refused, no episode failed
    for i, group in enumerate(groups):
        assert [t.status for t in group.trajectories] == [TrajectoryStatus.OK] * 2
        for t in group.trajectories:
            assert t.group_id == f"g{i}" and t.env_id == "arith_openai" and t.info["session_turns"] == 2
            assert t.info["branches"] == 1  # the history the library resent was the session's, message for message
            assert t.reward == 1.0, t.info  # the calculator's result is the answer
            assert set(t.versions) == {1, 2, -1}
    assert served.sessions.sessions == {}  # every session closed


@pytest.mark.attack
def test_a_dying_a_hanging_and_a_silent_program_lose_no_prompt(cfg, tokenizer, tmp_path):
    """A program that crashes, or never asks anything, is run again (counted) and then fails its
    sample; one that hangs is stopped at its timeout: each sample still ends, counted."""
    engine = ScriptedInference(lambda request: _calculator_script(request, tokenizer), tokenizer)
    served = Served(engine, tokenizer)
    programs = {
        "crash": ("import sys; sys.exit('boom')", {"max_restarts": 1}, "agent_failed"),
        "server_crash": ("import sys; sys.stdin.readline(); sys.exit('boom')", {"max_restarts": 1, "mode": "server"},
                         "agent_failed"),
        "hang": ("import signal; signal.pause()", {"timeout_s": 1.0}, "agent_timeout"),  # blocks until killed
        "silent": ("print('nothing to say')", {"max_restarts": 1}, "agent_silent"),
    }

    async def main():
        out = {}
        for name, (program, params, _) in programs.items():
            (tmp_path / name).mkdir()
            agent = _agent(cfg, tmp_path / name, program, **params)
            out[name] = await agent.grouped_rollout(agent.problems("train")[0], 1, served.gateway, name)
        return out

    groups = run(main)
    for name, (_, _, code) in programs.items():
        (t,) = groups[name].trajectories
        assert t.status is TrajectoryStatus.FAILED and t.failure_reason.startswith(code), t.failure_reason
    assert served.counts["agent_failed"] == 2 and served.counts["agent_timeout"] == served.counts["agent_silent"] == 1
    assert "boom" in groups["crash"].trajectories[0].failure_reason
    assert "boom" in groups["server_crash"].trajectories[0].failure_reason
    assert served.counts["agent_restart"] == 3  # each crash and the silent episode ran again once
    # a program that is not there (an agent's virtualenv not made) is refused when the agent is built
    with pytest.raises(ValueError, match=r"params.command\[0\]=.*no-venv/bin/python' is not an executable program"):
        _agent(cfg, tmp_path, command=[str(tmp_path / "no-venv" / "bin" / "python"), "agent.py"])


def test_a_posted_reward_is_the_episodes_and_a_bad_one_is_refused(cfg, tokenizer, tmp_path):
    engine = ScriptedInference(lambda request: _calculator_script(request, tokenizer), tokenizer)
    served = Served(engine, tokenizer)
    program = """
        import json, os, sys, urllib.request
        from openai import OpenAI
        problem = json.load(sys.stdin)
        OpenAI().chat.completions.create(model=os.environ["ASYNCRL_MODEL"], messages=problem["messages"])
        def post(reward):
            request = urllib.request.Request(os.environ["ASYNCRL_REWARD_URL"], data=json.dumps(reward).encode(),
                                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                                      "Content-Type": "application/json"})
            try:
                return urllib.request.urlopen(request).status
            except urllib.error.HTTPError as e:
                return e.code
        assert post({"reward": float("1e300")}) == 400
        assert post({"reward": 0.25}) == 200
        given = {"PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "OPENAI_BASE_URL", "OPENAI_API_KEY", "ASYNCRL_MODEL",
                 "ASYNCRL_REWARD_URL", "PYTHONUNBUFFERED", "LC_CTYPE"}
        assert set(os.environ) <= given, set(os.environ) - given
    """
    agent = _agent(cfg, tmp_path, program)

    async def main():
        return await agent.grouped_rollout(agent.problems("train")[0], 1, served.gateway, "g")

    (t,) = run(main).trajectories
    assert t.status is not TrajectoryStatus.FAILED, t.failure_reason
    assert t.reward == 0.25 and t.info["agent_exit"] == 0 and t.info["refused_requests"] == {"bad_reward": 1}
    assert sum(t.loss_mask) == len(t.response_token_ids) > 0  # the one turn it asked for

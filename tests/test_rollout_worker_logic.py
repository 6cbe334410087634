"""RolloutWorker's own logic against a scripted engine (tests/scripted_inference.py):
grouping, scoring, rejected rows, failures by code, interruption and resume, and the
pending-prompt bookkeeping. No vLLM, no Ray: the worker is a plain class, given an
`inference` factory instead of engine handles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from asyncrl.agents.api import AgentSettings, run_sample
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.registry import agent_params, build_agents
from asyncrl.agents.remote import RemoteAgent
from asyncrl.config.schema import AgentConfig
from asyncrl.control.step_metrics import tool_call_validity
from asyncrl.inference.protocol import Endpoint
from asyncrl.messages import Failure, PendingGroupState, WorkerStats
from asyncrl.reward.recipe_hooks import RecipeHooks
from asyncrl.rollout.trust import TrajectoryLimits, group_problem
from asyncrl.rollout.worker import RolloutWorker, WorkerSettings
from asyncrl.run_config import load_config
from asyncrl.tasks import Problem
from asyncrl.types import RoutedExperts, Segment, Trajectory, TrajectoryGroup, TrajectoryStatus
from tests.scripted_inference import Reply, ScriptedInference


@pytest.fixture(scope="module")
def cfg(base_model):
    return load_config(["rollout.max_concurrent_loops=16"])


@pytest.fixture(scope="module")
def problems(cfg):
    agent = build_agents(cfg)[cfg.recipe.name]
    assert agent.tokenizer is not None  # loaded once here (seconds), shared by every worker and agent
    return agent.problems("heldout")[:4]


class Sink:
    """Stands in for the message queue's Ray handle: the worker awaits `put.remote(group)`."""

    def __init__(self):
        self.groups = []
        self.put = SimpleNamespace(remote=self._put)

    async def _put(self, group):
        self.groups.append(group)


def answering(worker, problems, wrong=(), hold=None, fail=()):
    """A scripted engine answering each problem "Answer: <its answer>" (a wrong number for the
    prompt ids in `wrong`; raising for those in `fail`), each reply held until `hold` is set."""
    by_prompt = {tuple(worker.tokenizer.encode(p.prompt)): p for p in problems}

    def reply(request):
        p = by_prompt[tuple(request.prompt_token_ids)]
        if p.prompt_id in fail:
            raise RuntimeError("engine died")
        return Reply(f"Answer: {int(p.answer) + 1 if p.prompt_id in wrong else p.answer}", hold=hold)

    return ScriptedInference(reply, worker.tokenizer)


def make_worker(cfg, agents=None, sink=None):
    """A worker whose engine is set afterwards (`worker.engine`): the script needs its tokenizer."""
    holder = SimpleNamespace(engine=None)
    worker = RolloutWorker(0, WorkerSettings.of(cfg), [], agents or build_agents(cfg), sink=sink,
                           inference=lambda: holder.engine)
    return worker, holder


def run_worker(cfg, problems, n=2, agents=None, sink=None, after_drain=None, **script):
    """Submit `problems` (n samples each) to a worker answering them (`answering(**script)`),
    drain it, call `after_drain`; returns the worker and its engine."""
    async def go():
        worker, holder = make_worker(cfg, agents=agents, sink=sink)
        holder.engine = answering(worker, problems, **script)
        await worker.submit(problems, n=n)
        await worker.drain()
        if after_drain is not None:
            after_drain()
        return worker, holder.engine

    return asyncio.run(go())


def with_reward(cfg, reward):
    """The recipe's agents with the reward replaced."""
    agents = build_agents(cfg)
    agent = agents[cfg.recipe.name]
    agent.hooks = RecipeHooks("test", agent.hooks.extract_answer, reward)
    return agents


def test_groups_of_n_go_to_the_sink_scored_by_the_task_scorer(cfg, problems):
    wrong, sink = {problems[1].prompt_id, problems[3].prompt_id}, Sink()
    worker, engine = run_worker(cfg, problems, n=3, sink=sink, wrong=wrong)
    assert sorted(g.prompt_id for g in sink.groups) == sorted(p.prompt_id for p in problems)
    assert worker.take_groups() == []  # with a sink, nothing is kept
    for g in sink.groups:
        assert len(g.trajectories) == 3 and g.env_id == cfg.recipe.name
        for t in g.trajectories:
            assert t.group_id == g.group_id and t.status is TrajectoryStatus.OK
            assert t.reward == (0.0 if g.prompt_id in wrong else 1.0)
            assert t.info["response"].startswith("Answer: ") and t.timings["generate_s"] >= 0
    assert len(engine.requests) == 12
    assert {r.max_new_tokens for r in engine.requests} == {cfg.rollout.max_new_tokens}
    stats = worker.get_stats()
    assert isinstance(stats, WorkerStats)
    assert (stats.prompts_submitted, stats.groups_emitted, stats.trajectories_finished) == (4, 4, 12)
    assert stats.generated_tokens == sum(t.num_response_tokens for g in sink.groups for t in g.trajectories)
    assert (stats.running_loops, stats.snapshots, stats.failures) == (0, 0, {})
    assert worker.pending_prompts() == []


def test_pending_prompts_and_the_loop_limit(cfg, problems):
    two = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_concurrent_loops=2))

    async def scenario():
        worker, holder = make_worker(two)
        release = asyncio.Event()
        holder.engine = engine = answering(worker, problems, hold=release)
        assert (await worker.submit(problems[:2], n=2)).accepted == 2
        await engine.wait_for_requests(2)
        await asyncio.sleep(0.01)
        assert len(engine.requests) == 2  # rollout.max_concurrent_loops: the other two wait for a slot
        assert sorted(worker.pending_prompts()) == sorted(p.prompt_id for p in problems[:2])
        assert worker.get_stats().running_loops == 4
        release.set()
        await worker.drain()
        assert len(engine.requests) == 4 and worker.pending_prompts() == []
        return worker

    assert len(asyncio.run(scenario()).take_groups()) == 2


def test_bad_rows_are_rejected_with_failure_codes(cfg, problems):
    good = problems[0]
    rows = [
        Problem("bad/empty", "basic_arithmetic", "", "   ", "0"),
        Problem("bad/long", "basic_arithmetic", "x", "1 + " * 100, "0"),
        dataclasses.replace(good, prompt_id="bad/loop", agent_loop="nope"),
        dataclasses.replace(good, prompt_id="bad/env", env_id="nope"),
        good,
    ]

    async def scenario():
        worker, holder = make_worker(cfg)
        holder.engine = answering(worker, [good])
        answer = await worker.submit(rows, n=2)
        assert answer.accepted == 1
        assert worker.pending_prompts() == [good.prompt_id]
        await worker.drain()
        return worker, answer.rejected

    worker, rejected = asyncio.run(scenario())
    assert [g.prompt_id for g in worker.take_groups()] == [good.prompt_id]
    assert rejected["bad/empty"] == Failure("empty_prompt")
    assert rejected["bad/long"] == Failure("prompt_too_long", "400 tokens, engine.max_model_len=128")
    assert rejected["bad/loop"].code == "unknown_agent_loop"
    assert rejected["bad/loop"].detail.startswith("unknown agent loop 'nope'")
    assert rejected["bad/env"] == Failure("unknown_env", "unknown env_id 'nope'; this run has arith")
    assert len(rejected) == 4
    stats = worker.get_stats()
    assert stats.failures == {"empty_prompt": 1, "prompt_too_long": 1, "unknown_agent_loop": 1, "unknown_env": 1}
    assert stats.prompts_submitted == 5 and stats.groups_emitted == 1


def test_a_raising_reward_gives_zero_and_a_counted_failure(cfg, problems):
    def raising(problem, response):
        raise RuntimeError("scorer bug")

    worker, _ = run_worker(cfg, problems[:2], agents=with_reward(cfg, raising))
    trajs = [t for g in worker.take_groups() for t in g.trajectories]
    assert [t.reward for t in trajs] == [0.0] * 4 and {t.status for t in trajs} == {TrajectoryStatus.OK}
    assert {t.info["reward_failure"] for t in trajs} == {"reward_error: RuntimeError: scorer bug"}
    assert worker.get_stats().failures == {"reward_error": 4}


def test_a_hanging_reward_times_out_to_zero_and_a_counted_failure(cfg, problems):
    fast = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, reward_timeout_s=0.05))
    stuck = threading.Event()

    def hanging(problem, response):
        stuck.wait(5)
        return 1.0

    # the reward threads are let go before the event loop closes (it waits for them)
    worker, _ = run_worker(fast, problems[:1], agents=with_reward(fast, hanging), after_drain=stuck.set)
    (group,) = worker.take_groups()
    assert [t.reward for t in group.trajectories] == [0.0, 0.0]
    assert group.trajectories[0].info["reward_failure"] == "reward_timeout: > 0.05s"
    assert worker.get_stats().failures == {"reward_timeout": 2}


def test_a_loop_error_fails_its_trajectories_and_is_counted(cfg, problems):
    worker, _ = run_worker(cfg, problems[:2], fail={problems[0].prompt_id})
    by_prompt = {g.prompt_id: g for g in worker.take_groups()}
    assert len(by_prompt) == 2  # the failed group is still emitted: its prompt is finished, not lost
    for t in by_prompt[problems[0].prompt_id].trajectories:
        assert t.status is TrajectoryStatus.FAILED and t.failure_reason == "loop_error: RuntimeError: engine died"
    assert {t.status for t in by_prompt[problems[1].prompt_id].trajectories} == {TrajectoryStatus.OK}
    assert worker.get_stats().failures == {"loop_error": 2}


def test_interrupted_loops_leave_snapshots_and_resume_for_what_remains(cfg, problems):
    async def scenario():
        sink = Sink()
        worker, holder = make_worker(cfg, sink=sink)
        sync = asyncio.Event()
        prompts = {tuple(worker.tokenizer.encode(p.prompt)): p for p in problems[:2]}

        def reply(request):
            p = prompts.get(tuple(request.prompt_token_ids))
            if p is not None:  # a first request: aborted by the weight sync once `sync` is set
                return Reply("Answer", "abort", version=0, hold=sync)
            return Reply(": " + next(q.answer for k, q in prompts.items()
                                     if request.prompt_token_ids[:len(k)] == list(k)), version=1)

        holder.engine = engine = ScriptedInference(reply, worker.tokenizer)
        await worker.submit(problems[:2], n=2)
        await engine.wait_for_requests(4)
        await worker.interrupt()
        sync.set()  # the engines pause in abort mode: in-flight requests end with what they have
        await worker.drain()
        stats = worker.get_stats()
        assert (stats.snapshots, stats.interruptions, stats.running_loops) == (4, 4, 0)
        assert sink.groups == [] and sorted(worker.pending_prompts()) == sorted(p.prompt_id for p in problems[:2])
        assert await worker.resume_interrupted() == 4
        await worker.drain()
        return worker, engine, sink

    worker, engine, sink = asyncio.run(scenario())
    assert len(sink.groups) == 2 and worker.pending_prompts() == []
    for request in engine.requests[4:]:  # resumed: prompt + "Answer", asking only for the rest of the budget
        assert worker.tokenizer.decode(request.prompt_token_ids).endswith("=\nAnswer")
        assert request.max_new_tokens == cfg.rollout.max_new_tokens - 6
    by_id = {p.prompt_id: p for p in problems}
    for g in sink.groups:
        for t in g.trajectories:
            assert t.info["response"] == f"Answer: {by_id[g.prompt_id].answer}" and t.reward == 1.0
            assert t.versions == [0] * 6 + [1] * (t.num_response_tokens - 6)
            assert t.info["num_interruptions"] == 1
    stats = worker.get_stats()
    assert (stats.resumes, stats.snapshots, stats.groups_emitted, stats.trajectories_finished) == (4, 0, 2, 4)


def test_a_remote_group_that_fails_is_counted_as_remote_error(cfg, problems, monkeypatch):
    monkeypatch.delenv("ASYNCRL_ENV_TOKEN", raising=False)  # the server is never reached
    spec = AgentConfig(env_id="far", type="remote", weight=1.0, params={"url": "http://127.0.0.1:9"})
    local = build_agents(cfg)[cfg.recipe.name]
    agents = WeightedMultiTask([local, RemoteAgent(spec, agent_params(spec), AgentSettings.of(cfg))], block_size=2)
    problem = dataclasses.replace(problems[0], prompt_id="far:0", env_id="far")  # as RemoteAgent names ids

    async def scenario():
        worker, holder = make_worker(cfg, agents=agents)
        holder.engine = answering(worker, [])
        await worker.submit([problem], n=2)
        await worker.drain()
        await worker.gateway.stop()
        return worker

    worker = asyncio.run(scenario())
    (group,) = worker.take_groups()
    assert [t.status for t in group.trajectories] == [TrajectoryStatus.FAILED] * 2
    assert group.trajectories[0].failure_reason.startswith("remote_error: env 'far': $ASYNCRL_ENV_TOKEN is not set")
    assert worker.get_stats().failures == {"remote_error": 1}


def test_agent_rollout_runs_the_same_sample_path(cfg, problems):
    agent = build_agents(cfg)[cfg.recipe.name]
    p = problems[0]
    engine = ScriptedInference([Reply(f"Answer: {p.answer}"), Reply("Answer", "abort")], agent.tokenizer)
    t = asyncio.run(agent.rollout(p, engine))
    assert t.reward == 1.0 and t.group_id == p.prompt_id and t.timings["generate_s"] >= 0
    with pytest.raises(RuntimeError, match="cannot resume it"):
        asyncio.run(agent.rollout(p, engine))

    dead = ScriptedInference(lambda request: (_ for _ in ()).throw(RuntimeError("engine died")))
    start = Trajectory(p.prompt_id, "g", agent.tokenizer.encode(p.prompt))
    done = asyncio.run(run_sample(agent, p, dead, agent.sampling(), start))
    assert done.failure == Failure("loop_error", "RuntimeError: engine died")
    assert done.trajectory.failure_reason == "loop_error: RuntimeError: engine died" and done.snapshot is None


def test_a_worker_whose_loops_run_tools_fails_at_start_on_a_host_that_cannot_sandbox(cfg, monkeypatch):
    from agent_loops.tools import SandboxUnavailable, python_sandbox

    tool_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, agent_loop="partial_tool"))
    make_worker(tool_cfg)  # bubblewrap is here
    monkeypatch.setattr(python_sandbox, "_bwrap", lambda: None)
    make_worker(cfg)  # no loop of this run calls tools
    with pytest.raises(SandboxUnavailable, match="needs bubblewrap"):
        make_worker(tool_cfg)


def test_tool_calls_and_their_errors_are_counted_by_reason(cfg, problems):
    tool_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, agent_loop="partial_tool",
                                                                    max_new_tokens=200))
    agents = build_agents(tool_cfg)

    async def go():
        worker, holder = make_worker(tool_cfg, agents=agents)

        def reply(request):  # a call to a tool that does not exist, then an answer
            answered = "<result>" in worker.tokenizer.decode(request.prompt_token_ids)
            return Reply("Answer: 1" if answered else "<tool:search>1</tool>")

        holder.engine = ScriptedInference(reply, worker.tokenizer)
        await worker.submit(problems[:2], n=2)
        await worker.drain()
        return worker.get_stats()

    stats = asyncio.run(go())
    assert stats.trajectories_finished == 4 and stats.tool_calls == 4 and stats.tool_errors == {"unknown_tool": 4}


def test_the_share_of_valid_tool_calls_is_that_of_the_calls_finished_in_the_step():
    before = {"rollout/tool_calls": 6, "rollout/tool_errors/unknown_tool": 2}
    now = {"rollout/tool_calls": 10, "rollout/tool_errors/unknown_tool": 3, "rollout/tool_errors/timeout": 1}
    assert tool_call_validity(now, before) == {"rollout/tool_call_validity": 1 - 2 / 4}
    assert tool_call_validity(now, {}) == {"rollout/tool_call_validity": 1 - 4 / 10}  # the first step
    assert tool_call_validity(before, before) == {}  # no call finished: no share


def test_a_checkpoint_holds_each_unfinished_group_and_another_worker_continues_it(cfg, problems):
    """Interrupted mid-generation: one sample finished, three aborted after "Answer". The
    checkpoint (through JSON, as it is written) restored in a new worker keeps the finished
    sample and asks the engine only for what each snapshot had not generated."""
    async def scenario():
        first, holder = make_worker(cfg)
        sync = asyncio.Event()
        problem = problems[0]

        def reply(request):  # the first request finishes; the others are aborted by the sync
            if len(holder.engine.requests) == 1:
                return Reply(f"Answer: {problem.answer}")
            return Reply("Answer", "abort", hold=sync)

        holder.engine = ScriptedInference(reply, first.tokenizer)
        await first.submit([problem], n=4)
        await holder.engine.wait_for_requests(4)
        async def first_scored() -> None:  # the first sample's reward is scored in a thread
            while first.get_stats().trajectories_finished < 1:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(first_scored(), timeout=60)
        # a mirror while loops run (keep mode's, at a sync) holds the finished sample only
        (running,) = await first.mirror()
        assert sum(t is not None for t in running.trajectories) == 1 and running.snapshots == {}
        await first.interrupt()
        sync.set()  # the engines pause in abort mode
        states = await first.checkpoint()
        assert first.get_stats().pending_tokens == states[0].generated_tokens() > 0
        # interrupted (abort mode's sync), the mirror is what a checkpoint holds
        assert [g.to_dict() for g in await first.mirror()] == [g.to_dict() for g in states]
        saved = json.loads(json.dumps([s.to_dict() for s in states]))

        second, holder2 = make_worker(cfg, sink=Sink())
        holder2.engine = ScriptedInference(lambda request: Reply(f": {problem.answer}"), second.tokenizer)
        restored = [PendingGroupState.from_dict(d) for d in saved]
        assert (await second.restore(restored, [problem])).accepted == 1
        await second.drain()

        # a crafted checkpoint: its finished sample's reward NaN, a snapshot's token id 2**70; those
        # two start again from their prompts, counted; the other snapshots resume
        crafted = json.loads(json.dumps(saved))
        finished = next(i for i, t in enumerate(crafted[0]["trajectories"]) if t is not None)
        crafted[0]["trajectories"][finished]["reward"] = float("nan")
        crafted[0]["snapshots"]["1"]["trajectory"]["segments"][0]["token_ids"][0] = 2**70
        third, holder3 = make_worker(cfg, sink=Sink())
        fresh = third.tokenizer.encode(problem.prompt)
        holder3.engine = ScriptedInference(lambda request: Reply(
            f"Answer: {problem.answer}" if request.prompt_token_ids == fresh else f": {problem.answer}"),
            third.tokenizer)
        assert (await third.restore([PendingGroupState.from_dict(d) for d in crafted], [problem])).accepted == 1
        await third.drain()
        return states, second, holder2.engine, third, holder3.engine

    states, second, engine, third, third_engine = asyncio.run(scenario())
    assert third.get_stats().failures == {"checkpoint_refused": 2} and third.get_stats().resumes == 2
    (group,) = third.sink.groups
    assert all(t.reward == 1.0 for t in group.trajectories)
    from_prompt = [r for r in third_engine.requests if r.max_new_tokens == cfg.rollout.max_new_tokens]
    assert len(from_prompt) == 2 and len(third_engine.requests) == 4
    (state,) = states
    assert sum(t is not None for t in state.trajectories) == 1 and sorted(state.snapshots) == [1, 2, 3]
    assert all(s.trajectory.response_token_ids == second.tokenizer.encode("Answer") for s in state.snapshots.values())
    (group,) = second.sink.groups
    assert group.group_id == state.group_id and len(group.trajectories) == 4
    assert all(t.info["response"] == f"Answer: {problems[0].answer}" and t.reward == 1.0 for t in group.trajectories)
    assert len(engine.requests) == 3  # the three snapshots, each asking for the rest of its budget only
    for request in engine.requests:
        assert second.tokenizer.decode(request.prompt_token_ids).endswith("=\nAnswer")
        assert request.max_new_tokens == cfg.rollout.max_new_tokens - 6
    assert second.get_stats().resumes == 3


def test_checkpoint_refuses_while_loops_run(cfg):
    worker, _ = make_worker(cfg)
    with pytest.raises(RuntimeError, match="interrupt"):
        asyncio.run(worker.checkpoint())


def test_a_loop_aborted_while_the_worker_is_not_interrupted_goes_on_at_once(cfg, problems):
    """An engine that fails ends its requests as aborted (the router's failover): the loop keeps
    its tokens and continues at once, without waiting for a weight sync's resume."""
    async def scenario():
        worker, holder = make_worker(cfg, sink=Sink())
        problem = problems[0]
        first = worker.tokenizer.encode(problem.prompt)

        def reply(request):
            if request.prompt_token_ids == first:
                return Reply("Answer", "abort")
            return Reply(f": {problem.answer}")

        holder.engine = ScriptedInference(reply, worker.tokenizer)
        await worker.submit([problem], n=2)
        await worker.drain()
        return worker

    worker = asyncio.run(scenario())
    (group,) = worker.sink.groups
    assert all(t.info["response"] == f"Answer: {problems[0].answer}" for t in group.trajectories)
    stats = worker.get_stats()
    assert (stats.interruptions, stats.resumes, stats.snapshots) == (2, 2, 0)


def test_a_bounded_evaluation_sends_at_most_its_limit_until_unbound():
    from asyncrl.rollout.worker import BoundedInference
    from asyncrl.types import GenerationResult, SamplingSpec

    class Held:
        """Requests that wait until released; the test awaits what it expects them to reach."""

        returns_token_ids = returns_logprobs = True

        def __init__(self):
            self.started = self.now = self.most = self.released = 0
            self.changed = asyncio.Condition()

        async def until(self, reached) -> None:
            async with self.changed:
                await asyncio.wait_for(self.changed.wait_for(reached), timeout=30)

        async def release(self, n: int) -> None:
            async with self.changed:
                self.released += n
                self.changed.notify_all()

        async def agenerate(self, prompt_token_ids, sampling, request_id):
            async with self.changed:
                self.started, self.now = self.started + 1, self.now + 1
                self.most = max(self.most, self.now)
                self.changed.notify_all()
                ticket = self.started
                await self.changed.wait_for(lambda: ticket <= self.released)
                self.now -= 1
            return GenerationResult([1], [0.0], [0], "stop")

    async def main():
        inner = Held()
        bounded = BoundedInference(inner, 3)
        spec = SamplingSpec(max_new_tokens=1)
        tasks = [asyncio.create_task(bounded.agenerate([1], spec, f"r{i}")) for i in range(10)]
        await inner.until(lambda: inner.started >= 3)
        await inner.release(1)  # one ends: exactly one more goes (every task has reached the bound by now)
        await inner.until(lambda: inner.started >= 4)
        assert inner.most == 3 and inner.now == 3
        await bounded.unbound()  # the run stopped training: every waiting request goes at once
        await inner.until(lambda: inner.started == 10)
        assert inner.now == 9
        await inner.release(10)
        await asyncio.gather(*tasks)

    asyncio.run(main())


# -- what a remote env server answers (asyncrl/rollout/trust.py) ------------------------------------

def _remote_group(n: int = 2, **change) -> TrajectoryGroup:
    """A well-formed answer of `n` trajectories, with `change` applied to the first (field -> value)."""
    trajs = [Trajectory("far:0", "g", [1, 2, 3], [Segment.from_policy([7, 8], [-0.5, -1.5], 2)], reward=float(i % 2))
             for i in range(n)]
    for name, value in change.items():
        if name in ("token_ids", "logprobs", "versions", "loss_mask"):
            setattr(trajs[0].segments[0], name, value)
        else:
            setattr(trajs[0], name, value)
    return TrajectoryGroup("g", "far:0", trajs)


def _regrouped(group: TrajectoryGroup, group_id: str) -> TrajectoryGroup:
    return TrajectoryGroup(group_id, group.prompt_id, [dataclasses.replace(t, group_id=group_id)
                                                       for t in group.trajectories])


ROUTES = RoutedExperts.from_array(np.zeros((4, 2, 2), dtype=np.uint8))
LIMITS = TrajectoryLimits(vocab_size=512, newest_version=3, routes=(2, 2, 8), max_tokens=128)
LONG = 128 * 20  # a response 20x the context
UNTRAINABLE = {  # what a hostile or buggy server can send, and the reason it is refused for
    "no trajectories": (_remote_group(0), "0 trajectories for a group of 2"),
    "one too many": (_remote_group(3), "3 trajectories for a group of 2"),
    "NaN reward": (_remote_group(reward=float("nan")), "reward nan is not a finite number"),
    "infinite reward": (_remote_group(reward=float("inf")), "reward inf"),
    "NaN logprob": (_remote_group(logprobs=[float("nan"), -1.0]), "segments.0.logprobs.0: Input should be a finite"),
    "positive logprob": (_remote_group(logprobs=[0.5, -1.0]), "logprobs that are not finite numbers <= 0"),
    "token id of 2**70": (_remote_group(token_ids=[2**70, 8]), "token ids outside the vocabulary [0, 512)"),
    "token past the vocabulary": (_remote_group(token_ids=[512, 8]), "token ids outside the vocabulary"),
    "negative token id": (_remote_group(token_ids=[-1, 8]), "token ids outside the vocabulary"),
    "empty prompt": (_remote_group(prompt_token_ids=[]), "an empty prompt"),
    "version from the future": (_remote_group(versions=[2, 4]), "policy version 4, newer than any engine's (3)"),
    "loss mask of 2": (_remote_group(loss_mask=[2, 1]), "a loss mask of other values"),
    "routes of the wrong shape": (_remote_group(routes=RoutedExperts(bytes(12), 3, 2)),
                                  "routes of 3 layers x top-2, the model's are 2 x 2"),
    "expert id out of range": (_remote_group(routes=RoutedExperts(bytes([9]) + bytes(15), 2, 2)),
                               "expert ids outside [0, 8)"),
    # types first: what numpy would have turned into a number, and the trainer's packing crashed on
    "token id as a string": (_remote_group(token_ids=["12", 8]), "segments.0.token_ids.0: Input should be a valid "
                                                                 "integer (got str)"),
    "token id as a float": (_remote_group(token_ids=[11.5, 8]), "segments.0.token_ids.0: Input should be a valid "
                                                                "integer (got float)"),
    "token id as a bool": (_remote_group(token_ids=[True, 8]), "segments.0.token_ids.0: Input should be a valid "
                                                               "integer (got bool)"),
    "prompt token id as a string": (_remote_group(prompt_token_ids=[1, "2", 3]), "prompt_token_ids.1: Input should"),
    "logprob as a string": (_remote_group(logprobs=["-0.5", -1.0]), "segments.0.logprobs.0: Input should be a valid "
                                                                    "number"),
    "version as a string": (_remote_group(versions=["0", 2]), "segments.0.versions.0: Input should be a valid "
                                                              "integer"),
    "loss mask as a string": (_remote_group(loss_mask="11"), "segments.0.loss_mask: Input should be a valid list"),
    "reward of 1e200": (_remote_group(reward=1e200), "reward 1e+200 outside [-1e+06, 1e+06] (reward.max_abs)"),
    "reward of 1.7e308": (_remote_group(reward=1.7e308), "reward 1.7e+308 outside"),
    "NaN teacher logprob": (_remote_group(teacher_logprobs=[float("nan"), -1.0]), "teacher_logprobs.0: Input "
                                                                                   "should be a finite number"),
    "positive teacher logprob": (_remote_group(teacher_logprobs=[0.5, -1.0]), "teacher logprobs"),
    "teacher logprobs of another length": (_remote_group(teacher_logprobs=[-1.0]), "1 teacher logprobs for 2"),
    "tool_calls as a string": (_remote_group(info={"tool_calls": "3"}), "info.tool_calls: Input should be a valid "
                                                                        "integer"),
    "tool_errors counted by strings": (_remote_group(info={"tool_errors": {"x": "1"}}), "info.tool_errors.x"),
    "reward_metrics as a string": (_remote_group(info={"reward_metrics": "x"}), "info.reward_metrics: Input should "
                                                                                "be a valid dictionary"),
    "a response 20x the context": (_remote_group(token_ids=[7] * LONG, logprobs=[-0.5] * LONG, versions=[2] * LONG,
                                                 loss_mask=[1] * LONG),
                                   f"{LONG + 3} tokens, more than the context holds (engine.max_model_len=128)"),
    "group id other than asked": (_regrouped(_remote_group(), "h"), "group id 'h', not the 'g' asked for"),
}


@pytest.mark.attack
@pytest.mark.parametrize("what", UNTRAINABLE)
def test_an_untrainable_remote_group_is_refused_with_its_reason(what):
    group, reason = UNTRAINABLE[what]
    assert reason in (group_problem(group, 2, LIMITS, "g") or "")


def test_a_well_formed_remote_group_passes():
    assert group_problem(_remote_group(), 2, LIMITS) is None
    assert group_problem(_remote_group(routes=ROUTES), 2, LIMITS) is None
    dense = TrajectoryLimits(vocab_size=512)
    assert "routes, for a model without experts" in group_problem(_remote_group(routes=ROUTES), 2, dense)
    # an agent whose samples branch (agent_process) may answer more trajectories than samples, never fewer
    assert group_problem(_remote_group(), 1, LIMITS, at_least=True) is None
    assert group_problem(_remote_group(), 1, LIMITS) == "2 trajectories for a group of 1"
    assert group_problem(_remote_group(), 3, LIMITS, at_least=True) == "2 trajectories for a group of 3"


@pytest.mark.attack
@pytest.mark.parametrize("what", ["NaN reward", "one too many", "no trajectories", "token id of 2**70",
                                  # each lost its group in silence: an exception in the group's task
                                  "loss mask as a string", "tool_calls as a string", "group id other than asked",
                                  "reward_metrics as a string", "token id as a string"])
def test_the_worker_counts_an_untrainable_remote_group_as_a_failed_one(cfg, problems, monkeypatch, what):
    """Through the worker: the group ends as n failed trajectories (never queued for training), one
    remote_error counted with its reason; n + 1 trajectories no longer raise, 0 no longer hang."""
    monkeypatch.setenv("ASYNCRL_ENV_TOKEN", "t")
    spec = AgentConfig(env_id="far", type="remote", weight=1.0, params={"url": "http://127.0.0.1:9"})
    remote = RemoteAgent(spec, agent_params(spec), AgentSettings.of(cfg))
    agents = WeightedMultiTask([build_agents(cfg)[cfg.recipe.name], remote], block_size=2)
    answer, reason = UNTRAINABLE[what]

    async def grouped_rollout(problem, group_size, inference, group_id="", sampling=None):
        return answer if what == "group id other than asked" else _regrouped(answer, group_id)  # as a server echoes

    monkeypatch.setattr(remote, "grouped_rollout", grouped_rollout)
    problem = dataclasses.replace(problems[0], prompt_id="far:0", env_id="far")

    async def scenario():
        worker, holder = make_worker(cfg, agents=agents)
        holder.engine = answering(worker, [])
        await worker.submit([problem], n=2)
        await asyncio.wait_for(worker.drain(), 30)
        await worker.gateway.stop()
        return worker

    worker = asyncio.run(scenario())
    (group,) = worker.take_groups()
    assert [t.status for t in group.trajectories] == [TrajectoryStatus.FAILED] * 2
    assert "env 'far' answered an untrainable group" in group.trajectories[0].failure_reason
    assert reason.split(" (")[0].split(",")[0] in group.trajectories[0].failure_reason
    assert worker.get_stats().failures == {"remote_error": 1}


# -- every task ends: a trained group, a counted failure, or a prompt the account sees lost -----------

class FailingSink(Sink):
    """A queue whose put raises its first `failures` calls (every call: None)."""

    def __init__(self, failures: int | None):
        super().__init__()
        self.failures = failures

    async def _put(self, group):
        if self.failures is None or self.failures > 0:
            self.failures = None if self.failures is None else self.failures - 1
            raise RuntimeError("the queue refused the group")
        await super()._put(group)


@pytest.mark.attack
def test_an_exception_in_a_groups_task_is_a_counted_failure_and_the_group_still_ends(cfg, problems):
    """It used to vanish into drain()'s gather: no group, nothing counted, the prompt pending forever."""
    sink = FailingSink(failures=1)
    worker, _ = run_worker(cfg, problems[:1], n=2, sink=sink)
    (group,) = sink.groups
    failed = [t for t in group.trajectories if t.status is TrajectoryStatus.FAILED]
    assert len(failed) == 1 and failed[0].failure_reason == "task_error: RuntimeError: the queue refused the group"
    assert worker.get_stats().failures == {"task_error": 1}
    assert worker.pending_prompts() == []


@pytest.mark.attack
def test_a_group_that_cannot_end_is_counted_and_the_prompt_account_sees_it_lost(cfg, problems):
    from asyncrl.rollout.admission import InvariantBroken, PromptAccount, StalenessController

    sink = FailingSink(failures=None)
    worker, _ = run_worker(cfg, problems[:1], n=2, sink=sink)
    assert sink.groups == [] and worker.get_stats().failures == {"task_error": 1, "group_lost": 1}
    account = PromptAccount(StalenessController(max_staleness=0, prompts_per_step=1))
    account.admit([problems[0].prompt_id], {}, 0)
    with pytest.raises(InvariantBroken, match="1 running prompts are neither queued nor in a worker"):
        account.check(0, held=set(worker.pending_prompts()))


@pytest.mark.attack
def test_a_remote_answer_past_its_cap_is_refused_without_reading_the_rest(cfg, monkeypatch):
    """The remote agent read a whole answer, however long; now at most params.max_answer_mb."""
    import http.server

    sent = {"bytes": 0}

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # 64 MiB of a JSON string, unless the client stops reading
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            try:
                self.wfile.write(b'{"groups": "')
                for _ in range(64):
                    self.wfile.write(b"x" * (1 << 20))
                    sent["bytes"] += 1 << 20
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("ASYNCRL_ENV_TOKEN", "t")
    spec = AgentConfig(env_id="far", type="remote", weight=1.0,
                       params={"url": f"http://127.0.0.1:{server.server_port}", "max_answer_mb": 1})
    remote = RemoteAgent(spec, agent_params(spec), AgentSettings.of(cfg))
    try:
        with pytest.raises(RuntimeError, match=r"answered more than 1 MiB \(params.max_answer_mb\)"):
            remote.load_splits()
        with pytest.raises(RuntimeError, match=r"answered more than 1 MiB"):
            asyncio.run(remote.grouped_rollout(Problem("far:0", "", "q", "q", ""), 2,
                                               SimpleNamespace(endpoint=Endpoint("http://127.0.0.1:9", "m"))))
    finally:
        server.shutdown()
    assert sent["bytes"] < 64 << 20  # the rest was never read

"""RolloutWorker: runs many agent loops at once and turns prompts into scored groups.

Runs as a Ray async actor (one asyncio loop). Receives problems from the driver and
engine handles at construction; each problem's agent (by env id, see asyncrl/agents/)
gives its loop and its reward. Emits `TrajectoryGroup`s (the n samples of one prompt)
to a sink (a Ray actor with `put(group)`, e.g. the message queue) or, without a sink,
keeps them for `take_groups()`. Keeps the snapshots of interrupted loops until
`resume_interrupted()`.

Lifecycle of a submitted problem:
  1) Check the row: an empty prompt, a prompt that leaves no room in the context, or
     an unknown env or agent loop fails the prompt with a counted `Failure` (no group
     emitted).
  2) Start n loops, at most `rollout.max_concurrent_loops` at a time in this worker,
     each on the engine the router picks. Steps 2-4 of one sample are `run_sample`
     (asyncrl/agents/api.py); the worker keeps the slots, snapshots, groups and counts.
  3) A loop that is interrupted (engine paused with abort, or `interrupt()`) leaves a
     snapshot; `resume_interrupted()` continues it, on any engine. A loop whose engine
     failed (the worker not interrupted) continues at once on a live engine.
  4) A finished trajectory is scored by its agent's reward in a thread, under
     `rollout.reward_timeout_s`; an exception or a timeout gives reward 0 and a counted
     failure. A loop that raises becomes a failed trajectory (counted), never a crash.
     With served models (asyncrl/reward/services.py: a reward model, a process reward
     model, a judge), their scores join the env's reward, under the same timeout; a
     distillation teacher adds its logprob of each response token.
  5) When all n trajectories are finished, the group goes to the sink.
Every task ends its samples: an exception no step above handles (a bug, the sink refusing) fails
the samples the task ran (`task_error`, counted); a group that cannot end even so is counted
(`group_lost`) and dropped from `pending_prompts`, which the driver's prompt account then reports.
`checkpoint()` (while interrupted) hands the driver every unfinished group: its finished
samples and its loops' snapshots; `restore()` continues such groups, in any worker.
A remote agent's group is one HTTP request to its env server instead (steps 2-4 happen
there); the server generates through this worker's inference gateway, which carries
its requests across weight syncs.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from agent_loops import any_uses_tools, get_agent_loop
from agent_loops.chat import ChatTemplateError, prompt_token_ids
from agent_loops.tools import check_sandbox
from asyncrl.agents.api import Agent, AgentSettings, EvaluationResponse, load_tokenizer, run_sample
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.registry import build_agents
from asyncrl.config.schema import Config, RewardConfig
from asyncrl.cpu_cores import bind_this_process
from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.interfaces import EngineHandle, QueueHandle, ServiceHandle
from asyncrl.messages import Admitted, Failure, PendingGroupState, WorkerStats, error_line
from asyncrl.reward.clients import RewardServices
from asyncrl.reward.services import Served, served
from asyncrl.rollout.chat_sessions import ChatSettings
from asyncrl.rollout.gateway import InferenceGateway
from asyncrl.rollout.router import EngineRouter
from asyncrl.rollout.trust import TrajectoryLimits, group_problem, model_limits, trajectory_problem
from asyncrl.tasks import Problem
from asyncrl.types import (
    AgentLoopSnapshot,
    GenerationResult,
    SamplingSpec,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)

logger = logging.getLogger(__name__)


@dataclass
class _PendingGroup:
    group_id: str
    problem: Problem
    agent: Agent
    prompt_token_ids: list[int]
    trajectories: list[Trajectory | None]

    def complete(self) -> bool:
        return all(t is not None for t in self.trajectories)


class BoundedInference(InferenceInterface):
    """At most `limit` requests of an inference interface at once (0: any number), until
    `unbound()`; and the policy versions its answers carried (an evaluation's record)."""

    def __init__(self, inner: InferenceInterface, limit: int):
        self.inner, self.limit, self.running = inner, limit, 0
        self.changed = asyncio.Condition()
        self.returns_token_ids, self.returns_logprobs = inner.returns_token_ids, inner.returns_logprobs
        self.endpoint: Endpoint | None = None  # an HTTP gateway of its own, for env servers (RolloutWorker.evaluate)
        self.versions: set[int] = set()

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        async with self.changed:
            await self.changed.wait_for(lambda: not self.limit or self.running < self.limit)
            self.running += 1
        try:
            result = await self.inner.agenerate(prompt_token_ids, sampling, request_id)
        finally:
            async with self.changed:
                self.running -= 1
                self.changed.notify()
        if result.versions:  # a request's versions never decrease: its first and last say which it spans
            self.versions.update((result.versions[0], result.versions[-1]))
        return result

    async def unbound(self) -> None:
        """Every waiting request goes now."""
        async with self.changed:
            self.limit = 0
            self.changed.notify_all()


@dataclass(frozen=True)
class WorkerSettings:
    """What a rollout worker reads of the run's config (`of`: actors.py makes it)."""

    agents: AgentSettings  # the tokenizer, sampling, max_model_len and tools its loops run with
    model_path: str  # its config.json bounds a remote group's tokens
    n_samples_per_prompt: int
    max_concurrent_loops: int
    cpu_cores: str  # rollout.cpu_cores
    reward: RewardConfig  # the env's reward's weight, reward.max_abs
    services: tuple[Served, ...] = ()  # the run's served models: each a client, its weight in the reward

    @classmethod
    def of(cls, cfg: Config) -> WorkerSettings:
        r = cfg.rollout
        return cls(AgentSettings.of(cfg), cfg.model.path, cfg.algorithm.n_samples_per_prompt, r.max_concurrent_loops,
                   r.cpu_cores, cfg.reward, served(cfg))


def agents_of(cfg: Config) -> Callable[[], WeightedMultiTask]:
    """The run's agents, built where they are called (in a worker's process: they hold tokenizers and
    the recipe's hooks)."""
    return functools.partial(build_agents, cfg)


class RolloutWorker:
    """Runs agent loops for submitted problems; see the module docstring for the lifecycle."""

    def __init__(self, worker_id: int, settings: WorkerSettings, engines: list[EngineHandle | None],
                 agents: WeightedMultiTask | Callable[[], WeightedMultiTask], sink: QueueHandle | None = None,
                 sampling: SamplingSpec | None = None, inference: Callable[[], InferenceInterface] | None = None,
                 services: dict[str, list[ServiceHandle]] | None = None):
        """`engines`: EngineActor handles, routed by an `EngineRouter`. `agents`: built, or how to
        build them here (`agents_of`). `inference`: where each sample generates instead (called once
        per sample; tests give a scripted engine and no engines). `services`: the actors of each of
        the run's served models (`settings.services`) by name, which score every finished training
        sample too, each through its client (asyncrl/reward/services.py)."""
        self.worker_id = worker_id
        self.settings = s = settings
        bind_this_process(s.cpu_cores)
        self.router = EngineRouter(engines) if inference is None else None
        self.inference = inference or self.router.client
        self.sink = sink
        self.agents = agents if isinstance(agents, WeightedMultiTask) else agents()
        if any_uses_tools(a.agent_loop for a in self.agents.agents.values()):
            check_sandbox(s.agents.tools.sandbox)  # a host that cannot sandbox fails the run here, saying why
        self.tokenizer = load_tokenizer(s.agents.tokenizer_path, s.agents.chat_template)  # the agents' too
        self.sampling = sampling or replace(s.agents.sampling)
        clients = [(one.spec.client(one.name, list(services[one.name]), one.section), one.weight)
                   for one in s.services if services and services.get(one.name)]
        self.rewards = RewardServices(s.reward.env_weight, s.agents.reward_timeout_s, clients,
                                      s.reward.max_abs) if clients else None
        self.stats = WorkerStats(worker_id)  # counters; running_loops and snapshots are filled in get_stats
        self._slots = asyncio.Semaphore(s.max_concurrent_loops)
        self._interrupt = asyncio.Event()
        self._running = asyncio.Event()  # the opposite of _interrupt, for the gateway's waiting requests
        self._bounded_evaluations: set[BoundedInference] = set()  # evaluations beside training, running
        self._running.set()
        self._snapshots: list[tuple[_PendingGroup, int, AgentLoopSnapshot]] = []
        self._groups: list[TrajectoryGroup] = []  # emitted groups, when there is no sink
        self._tasks: set[asyncio.Task] = set()
        self._sample_tasks: set[asyncio.Task] = set()  # of them, the local loops (not remote groups)
        self._pending: dict[str, _PendingGroup] = {}  # admitted groups not yet emitted
        self._group_counter = itertools.count()
        self._model_limits: TrajectoryLimits | None = None  # read from the model's config when first needed
        # Engines behind one routed interface that waits out weight syncs: evaluation, and
        # (served over HTTP on first use) the env servers of remote agents.
        self.gateway = InferenceGateway(self.inference, self.tokenizer, self._resumed, chat=self._chat_settings(),
                                        count=self._count_code)

    # -- driver-facing API -----------------------------------------------------------

    async def submit(self, problems: list[Problem], n: int | None = None) -> Admitted:
        """Start n samples of each problem (default: algorithm.n_samples_per_prompt). Answers
        how many problems were accepted and why each other one was refused (also counted)."""
        n = n or self.settings.n_samples_per_prompt
        answer = Admitted()
        for problem in problems:
            self.stats.prompts_submitted += 1
            group = self._admit(problem, n)  # 1)
            if isinstance(group, Failure):
                answer.rejected[problem.prompt_id] = group
                continue
            answer.accepted += 1
            self._pending[group.group_id] = group
            if group.agent.remote:
                self._spawn_remote(group, n)
                continue
            for i in range(n):  # 2)
                start = Trajectory(problem.prompt_id, group.group_id, list(group.prompt_token_ids),
                                   env_id=group.agent.env_id, timings={"submitted": time.time()})
                self._spawn(group, i, start)
        return answer

    async def interrupt(self) -> None:
        """Ask every loop to stop at its next state transition (running tool calls finish)."""
        self._interrupt.set()
        self._running.clear()

    async def resume_interrupted(self) -> int:
        """Continue every snapshotted loop; returns how many were resumed."""
        self._interrupt.clear()
        self._running.set()
        snapshots, self._snapshots = self._snapshots, []
        for group, index, snapshot in snapshots:
            self.stats.resumes += 1
            self._spawn(group, index, snapshot)
        return len(snapshots)

    async def checkpoint(self) -> list[PendingGroupState]:
        """Every unfinished local group as it stands, for a checkpoint: its finished samples and
        the snapshot of each of its loops. Call it while interrupted (`interrupt()`, engines
        paused): it waits until every loop finished or left its snapshot. Remote groups are not
        included (their env server holds their state): their prompts start again on restore."""
        if not self._interrupt.is_set():
            raise RuntimeError("checkpoint() while loops run: interrupt() first")
        while self._sample_tasks:
            await asyncio.gather(*list(self._sample_tasks), return_exceptions=True)
        return self._pending_states()

    async def mirror(self) -> list[PendingGroupState]:
        """The unfinished local groups for the driver to keep, so that a replacement of this worker
        continues them if it dies: while interrupted (a sync in abort mode) once every loop left
        its snapshot, as `checkpoint()`; otherwise at once (finished samples, snapshots taken)."""
        if self._interrupt.is_set():
            return await self.checkpoint()
        return self._pending_states()

    def _pending_states(self) -> list[PendingGroupState]:
        """The unfinished local groups as they stand: finished samples and the snapshots taken."""
        snapshots: dict[str, dict[int, AgentLoopSnapshot]] = collections.defaultdict(dict)
        for group, index, snapshot in self._snapshots:
            snapshots[group.group_id][index] = snapshot
        return [PendingGroupState(g.group_id, g.problem.prompt_id, list(g.trajectories), snapshots[g.group_id])
                for g in self._pending.values() if not g.agent.remote]

    async def restore(self, groups: list[PendingGroupState], problems: list[Problem]) -> Admitted:
        """Continue groups a checkpoint holds (`problems[i]` is `groups[i]`'s problem): finished
        samples are kept, each snapshot resumes where it stopped (a sample with neither, or one
        that fails the checks of asyncrl/rollout/trust.py, starts from its prompt). Answers as
        `submit` (a row refused now, e.g. by a smaller context, is refused as at submit)."""
        answer = Admitted()
        for state, problem in zip(groups, problems, strict=True):
            group = self._admit(problem, len(state.trajectories))
            if isinstance(group, Failure):
                answer.rejected[problem.prompt_id] = group
                continue
            answer.accepted += 1
            group.group_id, group.trajectories = state.group_id, list(state.trajectories)
            self._pending[group.group_id] = group
            for i, done in enumerate(group.trajectories):
                start = state.snapshots.get(i)
                kept = done if done is not None else start.trajectory if start is not None else None
                # versions unchecked: a restored worker's engines have answered nothing yet
                why = None if kept is None else trajectory_problem(kept, replace(self._remote_limits(),
                                                                                 newest_version=None))
                if why is not None:  # a corrupt or crafted checkpoint: the sample starts again from its prompt
                    logger.warning("worker-%d: sample %d of %s in the checkpoint refused (%s): it starts again",
                                   self.worker_id, i, group.group_id, why)
                    self._count(Failure("checkpoint_refused", why))
                    group.trajectories[i] = done = start = None
                if done is not None:
                    continue
                if start is not None:
                    self.stats.resumes += 1
                else:
                    start = Trajectory(problem.prompt_id, group.group_id, list(group.prompt_token_ids),
                                       env_id=group.agent.env_id, timings={"submitted": time.time()})
                self._spawn(group, i, start)
        return answer

    def health(self) -> None:
        """Answers while the worker's event loop runs (the driver's health check)."""

    def replace_engine(self, index: int, engine: Any) -> None:
        """Route to `engine` in engine slot `index`: a replacement, or an engine added to the run."""
        self.router.replace(index, engine)

    def retire_engine(self, index: int) -> None:
        """Route nothing more to engine slot `index` (it is being removed from the run)."""
        self.router.retire(index)

    async def drain(self) -> None:
        """Wait until no loop is running (finished, failed or snapshotted)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def evaluate(self, problems: list[Problem], n_sampled: int, temperature: float,
                       pass_k: list[int], max_concurrent: int = 0) -> list[EvaluationResponse]:
        """Each agent's pass@k evaluation of its problems (one greedy rollout and `n_sampled` at
        `temperature` each), outside training: no groups emitted. `max_concurrent`: at most
        that many of its requests at once (0: all), the share of the engines it takes beside
        the rollouts."""
        remote = any(self.agents.agent_for(p).remote for p in problems)
        inference, http = BoundedInference(self.gateway, max_concurrent), None
        self._bounded_evaluations.add(inference)
        if remote:  # env servers' requests come over HTTP: through a gateway of their own, bounded too
            http = InferenceGateway(lambda: inference, self.tokenizer, chat=self._chat_settings(),
                                    count=self._count_code)
            inference.endpoint, inference.sessions = await http.serve(), http.sessions
        try:
            responses = await self.agents.evaluate(problems, inference, n_sampled, temperature, pass_k)
            for response in responses:  # what its samples were generated with, env servers' included
                response.versions = sorted(inference.versions)
            return responses
        finally:
            self._bounded_evaluations.discard(inference)
            if http is not None:
                await http.stop()

    async def unbound_evaluations(self) -> None:
        """Evaluations running beside training may send all their requests at once (training is
        over, waits for them, or holds a weight sync back for them)."""
        for inference in list(self._bounded_evaluations):
            await inference.unbound()

    async def _resumed(self) -> None:
        """Returns once a weight sync in abort mode is over (the gateway's requests wait here)."""
        await self._running.wait()

    def pending_prompts(self) -> list[str]:
        """Prompt ids of admitted groups not yet emitted (generating, waiting or snapshotted)."""
        return [g.problem.prompt_id for g in self._pending.values()]

    def take_groups(self) -> list[TrajectoryGroup]:
        """Finished groups, when the worker has no sink."""
        groups, self._groups = self._groups, []
        return groups

    def get_stats(self) -> WorkerStats:
        return replace(self.stats, running_loops=len(self._tasks), snapshots=len(self._snapshots),
                       pending_tokens=sum(g.generated_tokens() for g in self._pending_states()),
                       engine_failovers=self.router.failovers if self.router else 0,
                       failures=dict(self.stats.failures),
                       tool_errors=dict(self.stats.tool_errors),
                       engine_outstanding=list(self.router.outstanding) if self.router else [],
                       cpu_s=time.process_time(),
                       services={name: (st.calls, st.seconds) for name, st in self.rewards.stats.items()}
                       if self.rewards else {})

    def replace_service(self, name: str, index: int, actor: ServiceHandle) -> None:
        """Replica `index` of served model `name` died: its replacement."""
        if self.rewards is not None and (client := self.rewards.client(name)) is not None:
            client.replace(index, actor)

    def _count(self, failure: Failure) -> None:
        self.stats.failures[failure.code] = self.stats.failures.get(failure.code, 0) + 1

    def _count_code(self, code: str, detail: str) -> None:
        """The gateway's count: an agent process's failure, a refused chat request."""
        self._count(Failure(code, detail))

    def _chat_settings(self) -> ChatSettings:
        s = self.settings
        return ChatSettings(s.agents.tools.parser, s.agents.max_model_len, s.reward.max_abs)

    # -- one problem, one sample -------------------------------------------------------

    def _admit(self, problem: Problem, n: int) -> _PendingGroup | Failure:
        """The row's pending group, or why it is refused (counted)."""
        failure, agent, ids = None, None, []
        try:
            agent = self.agents.agent_for(problem)
            get_agent_loop(problem.agent_loop or agent.agent_loop)
            ids = prompt_token_ids(problem, self.tokenizer)
        except KeyError as e:
            failure = Failure("unknown_env" if agent is None else "unknown_agent_loop", str(e.args[0]))
        except ChatTemplateError as e:
            failure = Failure("bad_chat_template", str(e))
        if failure is None and not ids:
            failure = Failure("empty_prompt")
        elif failure is None and len(ids) >= (limit := self.settings.agents.max_model_len):
            failure = Failure("prompt_too_long", f"{len(ids)} tokens, engine.max_model_len={limit}")
        if failure is not None:
            self._count(failure)
            logger.warning("worker-%d rejected prompt %s: %s", self.worker_id, problem.prompt_id, failure)
            return failure
        group_id = f"{problem.prompt_id}@w{self.worker_id}.{next(self._group_counter)}"
        return _PendingGroup(group_id, problem, agent, ids, [None] * n)

    def _spawn(self, group: _PendingGroup, index: int, start: Trajectory | AgentLoopSnapshot) -> None:
        work = self._guarded(group, [index], self._run_sample(group, index, start))
        task = asyncio.get_running_loop().create_task(work)
        for tasks in (self._tasks, self._sample_tasks):
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _guarded(self, group: _PendingGroup, indices: list[int], work: Awaitable[None]) -> None:
        """Run a group's task; an exception in it (a bug, a sample no check foresaw) fails the samples
        `indices` it ran, counted with its reason, so that the group still ends. If even that fails,
        the group is given up: counted, and no longer reported as held (`pending_prompts`), so the
        driver's prompt account sees a lost prompt instead of waiting for it forever."""
        try:
            await work
            return
        except Exception as e:  # never swallowed: drain() gathers with return_exceptions
            failure = Failure("task_error", error_line(e))
            logger.exception("worker-%d: a task of %s raised: %s", self.worker_id, group.group_id, failure)
        self._count(failure)
        try:
            for i in indices:
                group.trajectories[i] = None  # what raised may have been its own result
                await self._finish(group, i, self._failed(group, failure))
        except Exception as e:
            lost = Failure("group_lost", error_line(e))
            logger.exception("worker-%d: group %s could not end (%s): its prompt is lost", self.worker_id,
                             group.group_id, lost)
            self._count(lost)
            self._pending.pop(group.group_id, None)

    @staticmethod
    def _failed(group: _PendingGroup, failure: Failure) -> Trajectory:
        return Trajectory(group.problem.prompt_id, group.group_id, list(group.prompt_token_ids),
                          status=TrajectoryStatus.FAILED, env_id=group.agent.env_id, failure_reason=str(failure))

    async def _run_sample(self, group: _PendingGroup, index: int, start: Trajectory | AgentLoopSnapshot) -> None:
        done = await run_sample(group.agent, group.problem, self.inference(), self.sampling, start,
                                self._interrupt, self._slots)
        if done.snapshot is not None:  # 3)
            self.stats.interruptions += 1
            if self._interrupt.is_set():
                self._snapshots.append((group, index, done.snapshot))
            else:  # not asked to stop: its engine failed (or was paused by someone else)
                self.stats.resumes += 1
                self._spawn(group, index, done.snapshot)
            return
        scored = done.failure is None and done.trajectory.status is not TrajectoryStatus.FAILED
        if scored and self.rewards is not None:
            done.failure = await self.rewards.score(group.problem, done.trajectory)  # 4)
        if done.failure is not None:  # 4)
            self._count(done.failure)
            logger.warning("worker-%d: %s on %s", self.worker_id, done.failure, group.group_id)
        await self._finish(group, index, done.trajectory)

    def _spawn_remote(self, group: _PendingGroup, n: int) -> None:
        async def run() -> None:
            async with self._slots:
                try:
                    await self.gateway.serve()
                    done = await group.agent.grouped_rollout(group.problem, n, self.gateway, group.group_id,
                                                             self.sampling)
                    trajs = done.trajectories
                    # an answer our engines and model cannot have produced is refused like a failed server
                    bad = group_problem(done, n, self._remote_limits(), group.group_id,
                                        at_least=group.agent.branching)
                    why = None if bad is None else f"env {group.agent.env_id!r} answered an untrainable group: {bad}"
                except Exception as e:  # the server or the network failed: a failed group, counted
                    why = str(e)
                if why is not None:
                    logger.warning("worker-%d: remote group %s failed: %s", self.worker_id, group.group_id, why)
                    failure = Failure("remote_error", why)
                    self._count(failure)
                    trajs = [self._failed(group, failure) for _ in range(n)]
            for i, t in enumerate(trajs):
                await self._finish(group, i, t)

        task = asyncio.get_running_loop().create_task(self._guarded(group, list(range(n)), run()))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remote_limits(self) -> TrajectoryLimits:
        """What a remote group's tokens may be: the model's vocabulary and experts, and no version
        newer than the engines have answered this worker with."""
        if self._model_limits is None:
            self._model_limits = model_limits(self.settings.model_path, self.settings.agents.max_model_len,
                                              self.settings.reward.max_abs)
        newest = self.router.newest_version if self.router is not None else None
        return replace(self._model_limits, newest_version=newest)

    async def _finish(self, group: _PendingGroup, index: int, traj: Trajectory) -> None:
        self.stats.trajectories_finished += 1
        self.stats.generated_tokens += sum(traj.loss_mask)
        self.stats.tool_calls += traj.info.get("tool_calls", 0)
        for reason, calls in traj.info.get("tool_errors", {}).items():
            self.stats.tool_errors[reason] = self.stats.tool_errors.get(reason, 0) + calls
        group.trajectories[index] = traj
        if not group.complete():
            return
        done = TrajectoryGroup(group.group_id, group.problem.prompt_id, list(group.trajectories),
                               env_id=group.agent.env_id)
        self.stats.groups_emitted += 1
        if self.sink is None:  # 5)
            self._groups.append(done)
        else:
            await self.sink.put.remote(done)  # waits while the queue is full
        self._pending.pop(group.group_id, None)

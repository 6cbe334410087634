"""The agent process: an agent that is a program of its own, talking OpenAI chat completions.

    agents:
      - env_id: arith_openai
        type: agent_process
        params:
          command: ["{python}", "${asyncrl_root:}/examples/agents/openai_calculator.py"]
          tasks: [...]          # the problems and the reward: a dataset agent's params
          tools: [calculator]   # the tools' schemas the problem offers (the program runs them)

Problems and the reward are a dataset agent's (`DatasetParams`). Each episode (one sample of a
group, an evaluation's included) opens a chat session on the rollout worker's gateway
(asyncrl/rollout/chat_sessions.py) and starts `command` in a process of its own, with:

  stdin            the problem as JSON: {"prompt_id", "prompt", "messages", "tools"} (never its answer)
  OPENAI_BASE_URL  the session's base URL (…/sessions/<id>/v1): the `openai` client reads it
  OPENAI_API_KEY   the session's key, valid on that session's paths only
  ASYNCRL_MODEL    the model name to ask for
  ASYNCRL_REWARD_URL  where it may POST {"reward": <number>}

and a clean environment otherwise (PATH, HOME, LANG, TMPDIR and `params.env`; none of the run's
own secrets). The program needs no asyncrl import: any OpenAI chat client works. `"{python}"` in
the command is the worker's interpreter; a program with pins of its own runs from its own
virtualenv's interpreter instead.

`params.mode: server` starts the program once per rollout worker instead (a process start costs an
interpreter and its imports, 1.5 CPU-s for `openai`; a CPU run plays hundreds of episodes a step):
it reads one JSON line per episode on stdin, {"episode", "problem", "base_url", "api_key", "model",
"reward_url"}, may play many at once, and writes {"episode": <id>} on a line of its stdout when
one is over (other lines are its own); it exits at the end of its stdin. If it dies, its running
episodes count as exits with its code and it is started again for the next.

The episode ends when the program exits, or `params.reward_grace_s` after it posted its reward
(then it is stopped). Its reward is the posted one, or else the dataset's reward of the last
branch's response (decoded as the in-process chat loops' are). Failures are counted and never lose
the prompt: a program that exits non-zero (or is killed) before posting a reward, or an episode
that sent no chat request (its first request lost with its connection, say), runs its episode
again in a fresh session, at most `params.max_restarts` times (`agent_restart`), then the sample
fails (`agent_failed`, `agent_silent`); an episode past `params.timeout_s` is stopped and fails
(`agent_timeout`). The group always ends.

Branches (the program rewrote its history): `params.branches` = all (default) makes every branch a
trajectory of the group with the episode's reward (a branch's tokens shared with an earlier branch
are context there, so each sampled token is trained once); last keeps only the branch the episode
ended on (the others are counted in info["branches"], not trained).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from agent_loops.chat import prompt_token_ids
from asyncrl.agents.api import AgentSettings, EvaluationResponse
from asyncrl.agents.dataset import DatasetAgent, DatasetParams
from asyncrl.config.schema import AgentConfig
from asyncrl.inference.protocol import ChatSessionHost, InferenceInterface, SessionTicket
from asyncrl.tasks import Problem
from asyncrl.types import SamplingSpec, Trajectory, TrajectoryGroup, TrajectoryStatus

logger = logging.getLogger(__name__)

BRANCHES = ("all", "last")
MODES = ("episode", "server")
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")  # of the worker's environment; the rest is not passed
OUTPUT_TAIL_BYTES = 4096  # of a failed program's output, kept for its failure's detail
MAX_LINE_BYTES = 1 << 20  # of what a program writes on one line


@dataclass
class AgentProcessParams(DatasetParams):
    command: list[str] = MISSING  # argv; "{python}" is the worker's interpreter
    env: dict[str, str] = field(default_factory=dict)  # added to the program's environment
    timeout_s: float = 600.0  # an episode's wall time, at most
    max_restarts: int = 2  # an episode whose program dies before its reward (or asks nothing) runs again
    reward_grace_s: float = 10.0  # after posting its reward, the program has this long to exit
    branches: str = "all"  # all | last (module docstring)
    mode: str = "episode"  # episode: a process per episode | server: one per rollout worker (module docstring)
    max_episodes: int = 64  # of this agent at once in one rollout worker (the others wait)


class AgentProcessAgent(DatasetAgent):
    params_class = AgentProcessParams
    remote = True  # its groups run outside the loops (not checkpointed: a restored run starts them again)
    branching = True  # a group may hold more trajectories than samples (its sessions' branches)

    def __init__(self, spec: AgentConfig, params: AgentProcessParams, settings: AgentSettings):
        super().__init__(spec, params, settings)
        p = params
        if not p.command or not all(isinstance(a, str) and a for a in p.command):
            raise ValueError(f"env {self.env_id!r}: params.command must be a non-empty list of arguments")
        if p.command[0] != "{python}" and shutil.which(p.command[0]) is None:
            raise ValueError(f"env {self.env_id!r}: params.command[0]={p.command[0]!r} is not an executable program "
                             f"here (an agent's virtualenv is made by `make venv`: scripts/setup_agent_venvs.sh)")
        if p.mode not in MODES:
            raise ValueError(f"env {self.env_id!r}: params.mode={p.mode!r}: must be one of {', '.join(MODES)}")
        if p.branches not in BRANCHES:
            raise ValueError(f"env {self.env_id!r}: params.branches={p.branches!r}: must be one of "
                             f"{', '.join(BRANCHES)}")
        if not (p.timeout_s > 0 and p.reward_grace_s >= 0 and p.max_restarts >= 0 and p.max_episodes >= 1):
            raise ValueError(f"env {self.env_id!r}: params.timeout_s must be > 0, reward_grace_s and max_restarts "
                             ">= 0, max_episodes >= 1")
        self._server: _Server | None = None
        self._slots: asyncio.Semaphore | None = None  # made in the worker's event loop, on first use

    @staticmethod
    def _host(inference: InferenceInterface) -> ChatSessionHost:
        if inference.sessions is None:
            raise RuntimeError(f"an agent process needs chat sessions (a rollout worker's gateway); "
                               f"got {type(inference).__name__}")
        return inference.sessions

    async def grouped_rollout(self, problem: Problem, group_size: int, inference: InferenceInterface,
                              group_id: str = "", sampling: SamplingSpec | None = None) -> TrajectoryGroup:
        group_id = group_id or problem.prompt_id
        episodes = await asyncio.gather(*[self.episode(problem, inference, sampling or self.sampling(), group_id)
                                          for _ in range(group_size)])
        trajectories = [t for episode in episodes for t in episode]
        return TrajectoryGroup(group_id, problem.prompt_id, trajectories, env_id=self.env_id)

    async def rollout(self, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec | None = None,
                      group_id: str = "") -> Trajectory:
        """One episode; its last branch (an evaluation's sample)."""
        return (await self.episode(problem, inference, sampling or self.sampling(), group_id or problem.prompt_id))[-1]

    async def evaluate(self, problems: list[Problem], inference: InferenceInterface, n_samples: int,
                       temperature: float, pass_k: list[int]) -> EvaluationResponse:
        self._host(inference)  # fail here, once, rather than in every episode
        return await super().evaluate(problems, inference, n_samples, temperature, pass_k)

    async def episode(self, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec,
                      group_id: str) -> list[Trajectory]:
        """One sample: the program run in a session until it ends (module docstring); its
        trajectories (the branches kept), scored, or one failed trajectory saying why."""
        host = self._host(inference)
        p = self.params
        why = ""
        for attempt in range(p.max_restarts + 1):
            async with self._episodes():
                ticket = await host.open_session(sampling)
                t0 = time.time()
                try:
                    code, output, timed_out = await self._run(ticket, problem, host)
                finally:
                    record = host.close_session(ticket.session_id)
            if timed_out:
                why = f"agent_timeout: the episode ran past params.timeout_s={p.timeout_s:g}"
                break
            if code != 0 and record.reward is None:
                why = f"agent_failed: {p.command[-1]} exited with {code}: {_tail(output)}"
            elif not record.branches:  # e.g. its first request never reached the endpoint (connection lost)
                why = f"agent_silent: the episode ended (exit code {code}) without a chat request: {_tail(output)}"
            if why:
                if attempt < p.max_restarts:
                    host.count("agent_restart", why)
                    logger.warning("env %s: %s; its episode runs again", self.env_id, why)
                    why = ""
                    continue
                break
            kept = record.branches if p.branches == "all" else record.branches[-1:]
            for t in kept:
                t.prompt_id, t.group_id, t.env_id = problem.prompt_id, group_id, self.env_id
                t.info.update(branches=len(record.branches), session_turns=record.turns, agent_exit=code,
                              **({"refused_requests": record.refused} if record.refused else {}))
                t.timings["generate_s"] = time.time() - t0
            last = kept[-1]
            if record.reward is not None:
                for t in kept:
                    t.reward = record.reward
            else:
                failure = await self.score(problem, last)
                if failure is not None:
                    host.count(failure.code, failure.detail)
                for t in kept[:-1]:
                    t.reward = last.reward
            return kept
        host.count(why.split(":")[0], why)
        logger.warning("env %s: an episode of %s failed: %s", self.env_id, group_id, why)
        return [Trajectory(problem.prompt_id, group_id, prompt_token_ids(problem, self.tokenizer),
                           status=TrajectoryStatus.FAILED, env_id=self.env_id, failure_reason=why)]

    def _episodes(self) -> asyncio.Semaphore:
        """At most `params.max_episodes` episodes of this agent at once in this process: an evaluation
        starts all of its samples together, and each episode holds a session, a connection and, in
        `mode: episode`, a process."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.params.max_episodes)
        return self._slots

    async def close(self, timeout_s: float = 10.0) -> int | None:
        """`mode: server`: end the program's stdin and wait for it to exit (stopped after `timeout_s`);
        its exit code (None: none was running)."""
        program, self._server = (self._server.program if self._server else None), None
        if program is None or program.exited.done():
            return None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            program.proc.stdin.close()
        try:
            return await asyncio.wait_for(asyncio.shield(program.exited), timeout_s)
        except asyncio.TimeoutError:
            await program.stop()
            return program.code

    def _argv_env(self) -> tuple[list[str], dict[str, str]]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(self.params.env, PYTHONUNBUFFERED="1")
        return [sys.executable if a == "{python}" else a for a in self.params.command], env

    async def _run(self, ticket: SessionTicket, problem: Problem, host: ChatSessionHost) -> tuple[int, bytes, bool]:
        """Run one episode of the program: (its exit code, 0 if it finished the episode; the tail of its
        output; whether it timed out)."""
        info = {"prompt_id": problem.prompt_id, "prompt": problem.prompt, "messages": problem.messages,
                "tools": problem.tools}
        rewarded = asyncio.ensure_future(host.rewarded(ticket.session_id))
        try:
            if self.params.mode == "server":
                if self._server is None:
                    self._server = _Server(*self._argv_env())
                return await self._server.run(ticket, info, rewarded, self.params)
            argv, env = self._argv_env()
            env.update(OPENAI_BASE_URL=ticket.base_url, OPENAI_API_KEY=ticket.api_key, ASYNCRL_MODEL=ticket.model,
                       ASYNCRL_REWARD_URL=ticket.reward_url)
            program = _Program(argv, env)
            await program.start()
            try:
                await program.send(json.dumps(info).encode(), close=True)
                timed_out = not await _until_done(program.exited, rewarded, self.params)
            finally:
                await program.stop()
            return program.code, bytes(program.output), timed_out
        finally:
            rewarded.cancel()


class _Program:
    """A started agent program: its output read (a full pipe would block it) and its tail kept, in
    its own process group (stopped with what it started). `lines`: called with each line it writes."""

    def __init__(self, argv: list[str], env: dict[str, str], lines: Callable[[bytes], None] | None = None):
        self.argv, self.env, self.lines = argv, env, lines
        self.output = bytearray()
        self.proc: asyncio.subprocess.Process | None = None
        self.exited: asyncio.Future[int] | None = None
        self.code = 0

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True, limit=MAX_LINE_BYTES)
        self.exited = asyncio.ensure_future(self._read())

    async def _read(self) -> int:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except ValueError:  # a line past MAX_LINE_BYTES: what was buffered is dropped
                continue
            if not line:
                break
            self.output.extend(line)
            del self.output[:-OUTPUT_TAIL_BYTES]
            if self.lines is not None:
                self.lines(line)
        self.code = await self.proc.wait()
        return self.code

    async def send(self, data: bytes, close: bool = False) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program that ignores its stdin
            self.proc.stdin.write(data)
            await self.proc.stdin.drain()
            if close:
                self.proc.stdin.close()

    async def stop(self) -> None:
        if self.proc is None:
            return
        _stop(self.proc.pid)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exited), 5)  # a grandchild holding the pipe: give up


class _Server:
    """`mode: server`: one program for all of this worker's episodes (module docstring), started on
    the first and again after it dies."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.argv, self.env = argv, env
        self.program: _Program | None = None
        self.starting = asyncio.Lock()
        self.finished: dict[str, asyncio.Future[int]] = {}  # by session id: an episode's end

    async def run(self, ticket: SessionTicket, info: dict[str, Any], rewarded: asyncio.Future[float],
                  params: AgentProcessParams) -> tuple[int, bytes, bool]:
        async with self.starting:  # episodes arrive together: one start
            if self.program is None or self.program.exited.done():
                self.program = _Program(self.argv, self.env, self._line)
                await self.program.start()
                self.program.exited.add_done_callback(self._died)
        program = self.program
        finished = self.finished[ticket.session_id] = asyncio.get_running_loop().create_future()
        line = {"episode": ticket.session_id, "problem": info, "base_url": ticket.base_url,
                "api_key": ticket.api_key, "model": ticket.model, "reward_url": ticket.reward_url}
        try:
            await program.send(json.dumps(line).encode() + b"\n")
            timed_out = not await _until_done(finished, rewarded, params)
        finally:
            self.finished.pop(ticket.session_id, None)
        code = finished.result() if finished.done() else 0
        return code, bytes(program.output), timed_out

    def _line(self, line: bytes) -> None:
        """`{"episode": <id>}` ends that episode; other lines are the program's own output."""
        try:
            episode = json.loads(line).get("episode")
        except (ValueError, AttributeError):
            return
        future = self.finished.get(episode) if isinstance(episode, str) else None
        if future is not None and not future.done():
            future.set_result(0)

    def _died(self, exited: asyncio.Future[int]) -> None:
        """Every episode it was running ends with its exit code (never 0: it did not finish them)."""
        code = (exited.result() if not exited.cancelled() else -1) or 1
        for future in self.finished.values():
            if not future.done():
                future.set_result(code)


async def _until_done(done: asyncio.Future[int], rewarded: asyncio.Future[float], params: AgentProcessParams) -> bool:
    """Wait until the episode is done, or `params.reward_grace_s` after its reward was posted;
    False if neither happened within `params.timeout_s`."""
    finished, _ = await asyncio.wait({done, rewarded}, timeout=params.timeout_s, return_when=asyncio.FIRST_COMPLETED)
    if done not in finished and rewarded in finished:  # posted: it has the grace to finish
        await asyncio.wait({done}, timeout=params.reward_grace_s)
    return bool(finished)


def _stop(pid: int) -> None:
    """Kill a program's process group (it and what it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(output: bytes) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:])[-500:] or "(no output)"

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

The episode ends when the program exits, or `params.reward_grace_s` after it posted its reward
(then it is stopped). Its reward is the posted one, or else the dataset's reward of the last
branch's response (decoded as the in-process chat loops' are). Failures are counted and never lose
the prompt: a program that exits non-zero (or is killed) before posting a reward runs its episode
again in a fresh session, at most `params.max_restarts` times (`agent_restart`), then the sample
fails (`agent_failed`); an episode past `params.timeout_s` is stopped and fails (`agent_timeout`);
an episode that sent no chat request fails (`agent_silent`). The group always ends.

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
import signal
import sys
import time
from dataclasses import dataclass, field

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
PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")  # of the worker's environment; the rest is not passed
OUTPUT_TAIL_BYTES = 4096  # of a failed program's output, kept for its failure's detail


@dataclass
class AgentProcessParams(DatasetParams):
    command: list[str] = MISSING  # argv; "{python}" is the worker's interpreter
    env: dict[str, str] = field(default_factory=dict)  # added to the program's environment
    timeout_s: float = 600.0  # an episode's wall time, at most
    max_restarts: int = 2  # a program that dies before its reward runs its episode again, this many times
    reward_grace_s: float = 10.0  # after posting its reward, the program has this long to exit
    branches: str = "all"  # all | last (module docstring)


class AgentProcessAgent(DatasetAgent):
    params_class = AgentProcessParams
    remote = True  # its groups run outside the loops (not checkpointed: a restored run starts them again)
    branching = True  # a group may hold more trajectories than samples (its sessions' branches)

    def __init__(self, spec: AgentConfig, params: AgentProcessParams, settings: AgentSettings):
        super().__init__(spec, params, settings)
        p = params
        if not p.command or not all(isinstance(a, str) and a for a in p.command):
            raise ValueError(f"env {self.env_id!r}: params.command must be a non-empty list of arguments")
        if p.branches not in BRANCHES:
            raise ValueError(f"env {self.env_id!r}: params.branches={p.branches!r}: must be one of "
                             f"{', '.join(BRANCHES)}")
        if not (p.timeout_s > 0 and p.reward_grace_s >= 0 and p.max_restarts >= 0):
            raise ValueError(f"env {self.env_id!r}: params.timeout_s must be > 0, reward_grace_s and max_restarts "
                             ">= 0")

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
                if attempt < p.max_restarts:
                    host.count("agent_restart", why)
                    logger.warning("env %s: %s; its episode runs again", self.env_id, why)
                    continue
                break
            if not record.branches:
                why = f"agent_silent: {p.command[-1]} exited with {code} without a chat request: {_tail(output)}"
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

    async def _run(self, ticket: SessionTicket, problem: Problem, host: ChatSessionHost) -> tuple[int, bytes, bool]:
        """Run the program for one session: (its exit code, the tail of its output, whether it timed out)."""
        p = self.params
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env.update(p.env, OPENAI_BASE_URL=ticket.base_url, OPENAI_API_KEY=ticket.api_key, ASYNCRL_MODEL=ticket.model,
                   ASYNCRL_REWARD_URL=ticket.reward_url, PYTHONUNBUFFERED="1")
        argv = [sys.executable if a == "{python}" else a for a in p.command]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env=env, start_new_session=True)  # its own process group: stopped with its children
        output = bytearray()

        async def read() -> None:  # the whole output is read (a full pipe would block it), its tail kept
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                output.extend(chunk)
                del output[:-OUTPUT_TAIL_BYTES]

        problem_json = json.dumps({"prompt_id": problem.prompt_id, "prompt": problem.prompt,
                                   "messages": problem.messages, "tools": problem.tools}).encode()
        reader = asyncio.ensure_future(read())
        try:
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a program that ignores its stdin
                proc.stdin.write(problem_json)
                await proc.stdin.drain()
                proc.stdin.close()
            exited = asyncio.ensure_future(proc.wait())
            rewarded = asyncio.ensure_future(host.rewarded(ticket.session_id))
            try:
                done, _ = await asyncio.wait({exited, rewarded}, timeout=p.timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if exited not in done and rewarded in done:  # posted: it has the grace to exit
                    await asyncio.wait({exited}, timeout=p.reward_grace_s)
            finally:
                rewarded.cancel()
            timed_out = not done
            if not exited.done():
                _stop(proc.pid)
            code = await exited
        finally:
            if proc.returncode is None:
                _stop(proc.pid)
                await proc.wait()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(reader, 5)  # a grandchild holding the pipe: give up on the rest
        return code, bytes(output), timed_out


def _stop(pid: int) -> None:
    """Kill a program's process group (it and what it started)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _tail(output: bytes) -> str:
    lines = output.decode(errors="replace").strip().splitlines()
    return " | ".join(lines[-3:])[-500:] or "(no output)"

"""The clients a rollout worker asks the run's served models through (asyncrl/reward/services.py),
which score every finished training sample beside its env (docs/algorithms.md):

- a reward model (`reward.model`; asyncrl/engine/reward_model.py): replicas scoring batches;
- a process reward model (`reward.prm`): the same actor scoring each step of the response, the
  steps' scores aggregated (min, mean or last) into the sample's;
- a judge (`reward.judge`): a model on vLLM engines of its own, asked with the judge's prompt
  template through its own tokenizer (and chat template, where it has one); its answer parsed
  into a score in [0, 1];
- a teacher (`algorithm.distill`): a model on vLLM engines of its own that gives the logprob of
  each of the sample's tokens (`Trajectory.teacher_logprobs`): no score, the trainer reads them
  (on-policy distillation).

Each request goes to the service's actor with the fewest of this worker's requests outstanding. A
sample's reward becomes

    reward.env_weight x the env's reward + the sum over scoring services of weight x score

(`info["reward_metrics"]` keeps every part). The services are asked at once, under
rollout.reward_timeout_s; a timeout, a failing actor, or a judge's answer the parser cannot read
gives the sample reward 0 and a counted failure (`<service>_timeout`, `<service>_error`,
`judge_unparsable`; a sample without the teacher's logprobs has no distillation term), as an
env's own reward does. Held-out evaluations do not come here: they measure the envs' rewards.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncrl.config.schema import DEFAULT_MAX_ABS_REWARD, JudgeConfig
from asyncrl.interfaces import EngineHandle
from asyncrl.messages import Failure, RewardRequest, error_line
from asyncrl.tasks import Problem
from asyncrl.types import SamplingSpec, Trajectory

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ScoreFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(str(failure))
        self.failure = failure


@dataclass
class ServiceStats:
    calls: int = 0  # samples scored (or failed)
    seconds: float = 0.0  # the time they took


class Client:
    """A service's actors (`name` in asyncrl/reward/services.py), each request sent to the one
    with the fewest of this worker's requests outstanding; a dead one's replacement takes its
    index (the supervisor's). `section`: the service's config section."""

    def __init__(self, name: str, actors: list[Any], section: Any = None):
        self.name, self.actors, self.section = name, actors, section
        self.outstanding = [0] * len(actors)

    def replace(self, index: int, actor: Any) -> None:
        self.actors[index] = actor

    @contextlib.contextmanager
    def pick(self) -> Iterator[Any]:
        i = min(range(len(self.actors)), key=lambda k: self.outstanding[k])
        self.outstanding[i] += 1
        try:
            yield self.actors[i]
        finally:
            self.outstanding[i] -= 1

    async def score(self, problem: Problem, traj: Trajectory) -> float | None:
        raise NotImplementedError


class RewardModelClient(Client):
    """A reward model's replicas (RewardModelActor: outcome or process)."""

    async def score(self, problem: Problem, traj: Trajectory) -> float:
        request = RewardRequest(problem.prompt, traj.info.get("response", ""), list(problem.messages or []))
        try:
            with self.pick() as replica:
                (score,) = await replica.score.remote([request])
        except Exception as e:  # a dead or failing replica: this sample's reward is 0, the run goes on
            raise ScoreFailed(Failure(f"{self.name}_error", error_line(e))) from None
        return float(score)


class JudgeClient(Client):
    """A judge's engines (EngineActor), asked with its template; its answer parsed."""

    def __init__(self, name: str, engines: list[EngineHandle], judge: JudgeConfig):
        from transformers import AutoTokenizer

        super().__init__(name, engines, judge)
        self.judge = judge
        self.tokenizer = AutoTokenizer.from_pretrained(judge.path)
        self.sampling = SamplingSpec(max_new_tokens=judge.max_new_tokens, temperature=judge.temperature)

    def prompt_ids(self, problem: Problem, response: str) -> list[int]:
        """The judge's request: its template filled in, through its chat template where it has one."""
        users = [m.get("content", "") for m in problem.messages or [] if m.get("role") == "user"]
        text = self.judge.prompt_template.format(prompt=users[-1] if users else problem.prompt, response=response)
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text)["input_ids"]

    def parse(self, answer: str, response: str = "") -> float:
        """The judge's answer as a score in [0, 1] (reward.judge.parser), for `response`."""
        j = self.judge
        if j.parser == "match":  # the judge's own answer to the problem (its last number: it may work
            if mine := NUMBER.findall(answer):  # it out first), against the response's
                theirs = NUMBER.findall(response)
                return float(bool(theirs) and float(theirs[-1]) == float(mine[-1]))
        elif j.parser == "yes_no":
            word = answer.strip().lower()
            if word.startswith(("yes", "no")):
                return 1.0 if word.startswith("yes") else 0.0
        elif match := NUMBER.search(answer):
            clamped = min(max(float(match.group()), j.min_score), j.max_score)
            return (clamped - j.min_score) / (j.max_score - j.min_score)
        raise ScoreFailed(Failure(f"{self.name}_unparsable", f"{answer[:80]!r} ({j.parser})"))

    async def score(self, problem: Problem, traj: Trajectory) -> float:
        response = traj.info.get("response", "")
        try:
            with self.pick() as engine:
                result = await engine.generate.remote(self.prompt_ids(problem, response), self.sampling,
                                                      f"{self.name}-{uuid.uuid4().hex}")
        except Exception as e:  # a dead engine: this sample's reward is 0, the run goes on
            raise ScoreFailed(Failure(f"{self.name}_error", error_line(e))) from None
        return self.parse(self.tokenizer.decode(result.token_ids, skip_special_tokens=True), response)


class TeacherClient(Client):
    """The distillation teacher's engines (EngineActor.score_tokens)."""

    async def score(self, problem: Problem, traj: Trajectory) -> None:
        """The teacher's logprob of each response token, kept in `traj.teacher_logprobs`."""
        tokens = list(traj.prompt_token_ids) + traj.response_token_ids
        try:
            with self.pick() as engine:
                logprobs = await engine.score_tokens.remote(tokens, len(traj.prompt_token_ids),
                                                             f"{self.name}-{uuid.uuid4().hex}")
        except Exception as e:  # a dead engine: no distillation term for this sample, the run goes on
            raise ScoreFailed(Failure(f"{self.name}_error", error_line(e))) from None
        if len(logprobs) != traj.num_response_tokens or not np.isfinite(logprobs).all():  # a NaN: no finite advantage
            raise ScoreFailed(Failure(f"{self.name}_error", f"{len(logprobs)} logprobs for {traj.num_response_tokens} "
                                                       "response tokens, or some not finite"))
        traj.teacher_logprobs = logprobs


class RewardServices:
    """The services a worker scores with, and their weights in the reward (None: the teacher's
    logprobs are no score)."""

    def __init__(self, env_weight: float, timeout_s: float, services: list[tuple[Client, float | None]],
                 max_abs_reward: float = DEFAULT_MAX_ABS_REWARD):
        self.env_weight, self.timeout_s, self.services = env_weight, timeout_s, services
        self.max_abs_reward = max_abs_reward  # reward.max_abs
        self.stats = {client.name: ServiceStats() for client, _ in services}

    def client(self, name: str) -> Client | None:
        return next((c for c, _ in self.services if c.name == name), None)

    async def _timed(self, client: Client, problem: Problem, traj: Trajectory) -> float | None:
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(client.score(problem, traj), self.timeout_s)
        except asyncio.TimeoutError:
            raise ScoreFailed(Failure(f"{client.name}_timeout",
                                      f"> {self.timeout_s:g}s (rollout.reward_timeout_s)")) from None
        finally:
            self.stats[client.name].calls += 1
            self.stats[client.name].seconds += time.monotonic() - t0

    async def score(self, problem: Problem, traj: Trajectory) -> Failure | None:
        """Add the services' scores to the env's reward of a finished sample; the failure, or None."""
        answers = await asyncio.gather(*(self._timed(c, problem, traj) for c, _ in self.services),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException):
                failure = answer.failure if isinstance(answer, ScoreFailed) else Failure("reward_error",
                                                                                        error_line(answer))
                traj.reward = 0.0
                traj.info["reward_failure"] = str(failure)
                return failure
        env = traj.reward
        scores = [(c.name, w, s) for (c, w), s in zip(self.services, answers) if w is not None]
        reward = self.env_weight * env + sum(w * s for _, w, s in scores)
        if not abs(reward) <= self.max_abs_reward:  # NaN too
            failure = Failure("reward_error", f"the reward is {reward:g}, outside [-{self.max_abs_reward:g}, "
                                              f"{self.max_abs_reward:g}] (reward.max_abs)")
            traj.reward = 0.0
            traj.info["reward_failure"] = str(failure)
            return failure
        traj.reward = reward
        traj.info["reward_metrics"] = {**traj.info.get("reward_metrics", {}), "env_reward": env,
                                       **{name: s for name, _, s in scores}}
        return None

"""The agent API: what an environment (an *agent*) gives training and evaluation.

An agent is a source of problems, a reward and the agent loop that turns a problem
into a trajectory. The trainer never sees it: rollout workers run its loop and score
with its reward, the driver draws its problems, and evaluation asks it for metrics.

  requests    ProblemsRequest, RolloutRequest, GroupedRolloutRequest, EvaluationRequest   (plain data;
              the env server's bodies, with their bounds)
  results     a rollout is a `Trajectory` (tokens, logprobs, loss mask, policy versions, reward,
              status, env_id, prompt_id = problem id); grouped rollouts are `TrajectoryGroup`s;
              an evaluation is an `EvaluationResponse` with `metrics()`
  inference   `InferenceInterface` (asyncrl/inference/protocol.py): EngineActors in training, any
              OpenAI-compatible endpoint for standalone evaluation and on the env server
  one sample  `run_sample`: the loop (started or resumed), then the reward, with failures as
              `Failure`s; `Agent.rollout` and the rollout workers both run samples through it

Agent types are registered by name (asyncrl/agents/registry.py); configs and env-server
requests can only name registered types and configured env ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal, get_args

from pydantic import ConfigDict, Field, GetPydanticSchema

from agent_loops.chat import load_named_template, prompt_token_ids
from asyncrl.clock import Clock
from asyncrl.config.schema import DEFAULT_MAX_ABS_REWARD, AgentConfig, Config, ToolsConfig
from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.messages import Failure
from asyncrl.metrics import pass_at_k
from asyncrl.tasks import Problem
from asyncrl.types import AgentLoopSnapshot, SamplingSpec, Trajectory, TrajectoryGroup, TrajectoryStatus

logger = logging.getLogger(__name__)

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = get_args(Split)


# -- requests: what a remote agent sends and, as they are, the env server's request bodies -----
# The pydantic annotations are the server's validation (FastAPI reads them off these dataclasses);
# building a request in Python checks nothing.

MAX_ROLLOUTS_PER_REQUEST = 4096
MAX_SAMPLES_PER_PROBLEM = 1024
MAX_NEW_TOKENS = 1 << 16

# Unknown fields are refused, in the nested Endpoints and SamplingSpecs too (they have no pydantic
# config of their own, so they take this one).
_BODY_CONFIG = ConfigDict(extra="forbid")


@dataclass
class _RequestEndpoint(Endpoint):
    """An `Endpoint` as a request carries it: only http(s)."""

    base_url: Annotated[str, Field(pattern=r"^https?://")]


@dataclass
class _RequestSampling(SamplingSpec):
    """A `SamplingSpec` as a request carries it: its fields, bounded."""

    max_new_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
    temperature: Annotated[float, Field(ge=0)] = SamplingSpec.temperature
    top_p: Annotated[float, Field(gt=0, le=1)] = SamplingSpec.top_p


def _validated_as(bounded: type) -> GetPydanticSchema:
    """Validate a field as `bounded`, a subclass of the field's type that adds bounds (so the
    declared type stays the plain one, and the value is still an instance of it)."""
    return GetPydanticSchema(lambda _source, handler: handler(bounded))


RequestEndpoint = Annotated[Endpoint, _validated_as(_RequestEndpoint)]
RequestSampling = Annotated[SamplingSpec, _validated_as(_RequestSampling)]


@dataclass
class ProblemsRequest:
    """A split's problem ids and prompts (never answers)."""

    __pydantic_config__ = _BODY_CONFIG

    env_id: str
    split: Split = "train"


@dataclass
class RolloutRequest:
    """One rollout per named train problem (or of the first `num_rollouts`), generated through
    `inference`, sampled with `sampling` (None: the agent's default)."""

    __pydantic_config__ = _BODY_CONFIG

    env_id: str
    inference: RequestEndpoint
    problem_ids: list[str] = field(default_factory=list)
    num_rollouts: Annotated[int, Field(ge=1, le=MAX_ROLLOUTS_PER_REQUEST)] = 1
    sampling: RequestSampling | None = None


@dataclass
class GroupedRolloutRequest:
    """`group_size` rollouts of each named train problem (or of the first `num_groups`)."""

    __pydantic_config__ = _BODY_CONFIG

    env_id: str
    inference: RequestEndpoint
    problem_ids: list[str] = field(default_factory=list)
    num_groups: Annotated[int, Field(ge=1, le=MAX_ROLLOUTS_PER_REQUEST)] = 1
    group_size: Annotated[int, Field(ge=1, le=MAX_SAMPLES_PER_PROBLEM)] = 8
    group_ids: list[str] = field(default_factory=list)  # the caller's ids for the groups; empty: the problem ids
    sampling: RequestSampling | None = None


@dataclass
class EvaluationRequest:
    """Greedy plus `n_samples` sampled rollouts of held-out problems; pass@k for each k
    (the server refuses a k outside [1, max(1, n_samples)])."""

    __pydantic_config__ = _BODY_CONFIG

    env_id: str
    inference: RequestEndpoint
    problem_ids: list[str] = field(default_factory=list)  # empty: the first `num_problems` held-out
    num_problems: Annotated[int, Field(ge=0)] = 0  # 0: the whole held-out split
    n_samples: Annotated[int, Field(ge=0, le=MAX_SAMPLES_PER_PROBLEM)] = 8
    pass_k: list[int] = field(default_factory=lambda: [1, 8])  # eval.pass_k's default, for n_samples=8
    temperature: Annotated[float, Field(ge=0)] = 1.0


# -- results ----------------------------------------------------------------------------

@dataclass
class ProblemInfo:
    """What a client may see of a problem (never its answer): its prompt text, or the
    conversation and the tools' schemas it offers (rendered by the model's chat template)."""

    prompt_id: str
    prompt: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, problem: Problem) -> ProblemInfo:
        return cls(problem.prompt_id, problem.prompt, problem.messages, problem.tools)


@dataclass
class ProblemResult:
    """One evaluated problem: the greedy sample's reward and every sampled reward."""

    prompt_id: str
    env_id: str
    greedy_reward: float
    sampled_rewards: list[float]
    response_tokens: list[int]  # per sample, greedy first


@dataclass
class EvaluationResponse:
    env_id: str
    results: list[ProblemResult]
    pass_k: list[int]
    temperature: float
    seconds: float = 0.0
    # The policy versions the engines tagged its samples' tokens with (a rollout worker's record of
    # what its engines answered; empty where none was kept)
    versions: list[int] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Greedy accuracy, unbiased pass@k (a sample is correct only at reward 1.0), mean sampled
        reward and response length. pass@k and the mean reward are over the problems that were
        sampled (`num_problems_sampled`: the others were evaluated greedily only); pass@k is left
        out for k above the samples collected."""
        rs = self.results
        if not rs:
            return {"num_problems": 0}
        sampled = [r for r in rs if r.sampled_rewards]
        n = min((len(r.sampled_rewards) for r in sampled), default=0)
        out = {"num_problems": len(rs), "greedy_accuracy": sum(r.greedy_reward >= 1.0 for r in rs) / len(rs),
               "mean_response_tokens": sum(sum(r.response_tokens) for r in rs)
               / max(1, sum(len(r.response_tokens) for r in rs))}
        if n:
            out["num_problems_sampled"] = len(sampled)
            out["mean_reward"] = sum(sum(r.sampled_rewards[:n]) for r in sampled) / (n * len(sampled))
            for k in self.pass_k:
                if k <= n:
                    out[f"pass@{k}"] = sum(pass_at_k(n, sum(x >= 1.0 for x in r.sampled_rewards[:n]), k)
                                           for r in sampled) / len(sampled)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "metrics": self.metrics()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvaluationResponse:
        return cls(env_id=d["env_id"], results=[ProblemResult(**r) for r in d["results"]], pass_k=list(d["pass_k"]),
                   temperature=d["temperature"], seconds=d.get("seconds", 0.0),
                   versions=[int(v) for v in d.get("versions", [])])


# -- the agent --------------------------------------------------------------------------

@functools.cache
def load_tokenizer(path: str, chat_template: str = "") -> Any:
    """One tokenizer per path (and chat template) and process, shared by every agent (and the
    rollout worker); `chat_template` names a shipped template that replaces the tokenizer's own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if chat_template:
        tokenizer.chat_template = load_named_template(chat_template)
    return tokenizer


@dataclass(frozen=True)
class AgentSettings:
    """What agents read of the run's config; `of` makes it (registry.build_agents, once a run)."""

    agent_loop: str  # rollout.agent_loop: the loop of agents that name none
    tokenizer_path: str  # model.tokenizer_path, or model.path
    chat_template: str
    sampling: SamplingSpec  # rollout.max_new_tokens, temperature, top_p
    max_model_len: int  # engine.max_model_len
    tools: ToolsConfig
    time_scale: float  # cluster.time_scale
    reward_timeout_s: float  # rollout.reward_timeout_s
    recipe_module: str  # recipe.module: the hooks of dataset agents that name none
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD  # reward.max_abs: a reward past it is a failure (as a NaN is)

    @classmethod
    def of(cls, cfg: Config) -> AgentSettings:
        r = cfg.rollout
        return cls(agent_loop=r.agent_loop, tokenizer_path=cfg.model.tokenizer_path or cfg.model.path,
                   chat_template=cfg.model.chat_template,
                   sampling=SamplingSpec(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p),
                   max_model_len=cfg.engine.max_model_len, tools=cfg.tools, time_scale=cfg.cluster.time_scale,
                   reward_timeout_s=r.reward_timeout_s, recipe_module=cfg.recipe.module,
                   max_abs_reward=cfg.reward.max_abs)


class Agent(ABC):
    """An environment. Subclasses give `problems` and `reward` (and, multi-turn, `observe`);
    running the loop, scoring, grouped rollouts and pass@k evaluation are shared."""

    params_class: type = dict  # the dataclass `AgentConfig.params` must fit
    remote: bool = False  # True: rollouts happen elsewhere (the env server), already scored
    branching: bool = False  # True: a group may hold more trajectories than samples (agent_process.py)

    def __init__(self, spec: AgentConfig, params: Any, settings: AgentSettings):
        self.env_id = spec.env_id
        self.weight = spec.weight
        self.agent_loop = spec.agent_loop or settings.agent_loop
        self.params = params
        self.settings = settings

    def problems(self, split: str) -> list[Problem]:
        """The problems of a split ("train" or "heldout"); ids are stable across calls."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: must be one of {', '.join(SPLITS)}")
        return self._splits[split]

    @abstractmethod
    def load_splits(self) -> dict[str, list[Problem]]:
        """Every split's problems, built once (on first use)."""

    @functools.cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        return self.load_splits()

    @functools.cached_property
    def _by_id(self) -> dict[str, dict[str, Problem]]:
        return {split: {p.prompt_id: p for p in self.problems(split)} for split in SPLITS}

    @abstractmethod
    def reward(self, problem: Problem, response: str) -> float:
        """The response's reward (1.0 = correct). May raise: callers count it as a failure."""

    def reward_and_metrics(self, problem: Problem, response: str) -> tuple[float, dict[str, float]]:
        """The reward and per-sample metrics of the response (a verl reward function's extra keys);
        none by default. May raise, like `reward`."""
        return self.reward(problem, response), {}

    def observe(self, problem: Problem, response: str, turn: int) -> str | None:
        """Multi-turn: the environment's reply after the model's `turn`-th turn (response so far),
        or None to end the episode. Single-turn agents never reply."""
        return None

    @functools.cached_property
    def tokenizer(self) -> Any:
        return load_tokenizer(self.settings.tokenizer_path, self.settings.chat_template)

    def sampling(self, temperature: float | None = None) -> SamplingSpec:
        s = self.settings.sampling  # a copy each time: loops may set stop strings on theirs
        return dataclasses.replace(s, temperature=s.temperature if temperature is None else temperature)

    def make_loop(self, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec,
                  interrupt: asyncio.Event | None = None) -> Any:
        """The problem's agent loop, bound to this environment."""
        from agent_loops import get_agent_loop

        loop_cls = get_agent_loop(problem.agent_loop or self.agent_loop)
        return loop_cls(inference, self.tokenizer, sampling, self.settings.max_model_len, interrupt=interrupt,
                        env=functools.partial(self.observe, problem), tools=self.settings.tools,
                        chat_prompt=bool(problem.messages), clock=Clock(self.settings.time_scale))

    async def score(self, problem: Problem, traj: Trajectory) -> Failure | None:
        """Set the trajectory's reward (and info["reward_metrics"], when the reward gives some) from
        its decoded response; a reward function that raises, returns no finite number, one past
        reward.max_abs or exceeds rollout.reward_timeout_s gives reward 0. Returns the failure, or None."""
        response = self.tokenizer.decode(traj.response_token_ids, skip_special_tokens=True)
        traj.info["response"] = response
        timeout = self.settings.reward_timeout_s
        failure = None
        try:
            reward, metrics = await asyncio.wait_for(asyncio.to_thread(self.reward_and_metrics, problem, response),
                                                     timeout)
            reward = float(reward)
            bound = self.settings.max_abs_reward
            if not math.isfinite(reward):  # a NaN would poison the group's advantages
                raise ValueError(f"the reward is {reward!r}, not a finite number")
            if abs(reward) > bound:  # 1e200 overflows the group's variance, 1e308 its mean
                raise ValueError(f"the reward is {reward:g}, outside [-{bound:g}, {bound:g}] (reward.max_abs)")
            traj.reward = reward
            if metrics:
                traj.info["reward_metrics"] = metrics
        except asyncio.TimeoutError:
            failure = Failure("reward_timeout", f"> {timeout:g}s")
        except Exception as e:  # a buggy reward function must not stop the run
            failure = Failure("reward_error", f"{type(e).__name__}: {e}")
        if failure is not None:
            traj.reward = 0.0
            traj.info["reward_failure"] = str(failure)
        return failure

    async def rollout(self, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec | None = None,
                      group_id: str = "") -> Trajectory:
        """Run the problem's loop to the end (never interrupted) and score it. A loop that raises
        gives a failed trajectory."""
        ids = prompt_token_ids(problem, self.tokenizer)  # a conversation through the chat template
        start = Trajectory(problem.prompt_id, group_id or problem.prompt_id, ids, env_id=self.env_id)
        done = await run_sample(self, problem, inference, sampling or self.sampling(), start)
        if done.trajectory is None:
            raise RuntimeError(f"env {self.env_id!r}: the inference aborted a request of {problem.prompt_id}; "
                               "Agent.rollout cannot resume it: generate through an interface that waits out "
                               "weight syncs (a rollout worker's gateway)")
        return done.trajectory

    async def grouped_rollout(self, problem: Problem, group_size: int, inference: InferenceInterface,
                              group_id: str = "", sampling: SamplingSpec | None = None) -> TrajectoryGroup:
        group_id = group_id or problem.prompt_id
        trajs = await asyncio.gather(*[self.rollout(problem, inference, sampling, group_id)
                                       for _ in range(group_size)])
        return TrajectoryGroup(group_id, problem.prompt_id, list(trajs), env_id=self.env_id)

    async def evaluate(self, problems: list[Problem], inference: InferenceInterface, n_samples: int,
                       temperature: float, pass_k: list[int]) -> EvaluationResponse:
        """The pass@k evaluation: per problem one greedy rollout and `n_samples` at `temperature`."""
        t0 = time.time()

        async def one(problem: Problem) -> ProblemResult:
            temps = [0.0] + [temperature] * n_samples
            trajs = await asyncio.gather(*[self.rollout(problem, inference, self.sampling(t), f"eval-{j}")
                                           for j, t in enumerate(temps)])
            return ProblemResult(problem.prompt_id, self.env_id, trajs[0].reward, [t.reward for t in trajs[1:]],
                                 [sum(t.loss_mask) for t in trajs])

        results = await asyncio.gather(*[one(p) for p in problems])
        return EvaluationResponse(self.env_id, list(results), list(pass_k), temperature, time.time() - t0)

    def find_problems(self, split: str, problem_ids: list[str], count: int) -> list[Problem]:
        """The named problems of a split (KeyError naming an unknown id), or its first `count`."""
        if not problem_ids:
            problems = self.problems(split)
            return problems[:count] if count else problems
        by_id = self._by_id[split]
        missing = [i for i in problem_ids if i not in by_id]
        if missing:
            raise KeyError(f"env {self.env_id!r} has no {split} problem {missing[0]!r}"
                           + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [by_id[i] for i in problem_ids]


# -- one sample: the loop, then the reward -----------------------------------------------

@dataclass
class SampleOutcome:
    """How one sample ended: a finished trajectory (scored, or failed), or the snapshot of an
    interrupted loop (not scored)."""

    trajectory: Trajectory | None = None
    snapshot: AgentLoopSnapshot | None = None
    # loop_error (the trajectory failed), reward_error or reward_timeout (reward 0); None: none
    failure: Failure | None = None


async def run_sample(agent: Agent, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec,
                     start: Trajectory | AgentLoopSnapshot, interrupt: asyncio.Event | None = None,
                     slots: asyncio.Semaphore | None = None) -> SampleOutcome:
    """Run one sample of `problem` with `agent`'s loop and reward: the rollout worker's and
    `Agent.rollout`'s one path.

      1) Start the loop on `start` (a trajectory holding only the prompt) or resume `start`
         (a snapshot), holding one of `slots` if given (they bound concurrent loops; scoring
         does not hold one).
      2) Interrupted (the engine aborted, or `interrupt` was set): return the snapshot.
      3) A loop that raises: the trajectory fails with a loop_error.
      4) Finished: add this run's time to timings["generate_s"] and score the trajectory; a
         reward that raises or times out gives 0 and the failure.
    """
    traj = start if isinstance(start, Trajectory) else start.trajectory
    async with slots or contextlib.nullcontext():
        t0 = time.time()
        try:
            loop = agent.make_loop(problem, inference, sampling, interrupt)
            outcome = await (loop.run(start) if isinstance(start, Trajectory) else loop.resume(start))  # 1)
        except Exception as e:  # an engine or loop error fails this sample, not its caller
            logger.exception("env %s: the agent loop failed on %s", agent.env_id, traj.group_id)
            failure = Failure("loop_error", f"{type(e).__name__}: {e}")
            traj.status, traj.failure_reason = TrajectoryStatus.FAILED, str(failure)  # 3)
            return SampleOutcome(traj, failure=failure)
    if outcome.snapshot is not None:  # 2)
        return SampleOutcome(snapshot=outcome.snapshot)
    traj = outcome.trajectory
    traj.timings["generate_s"] = traj.timings.get("generate_s", 0.0) + time.time() - t0
    return SampleOutcome(traj, failure=await agent.score(problem, traj))  # 4)

"""The remote agent: an agent hosted by `asyncrl serve-env`, called over HTTP.

    agents:
      - env_id: arith_remote
        type: remote
        params: {url: "http://127.0.0.1:8765", remote_env_id: arith}   # token: $ASYNCRL_ENV_TOKEN

Problems come from the server; rollouts run there, generating through the inference
endpoint this side hands over (in training: the rollout worker's gateway to the engines),
and come back scored, with their token ids, logprobs and policy versions.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from omegaconf import MISSING

from asyncrl.agents.api import (
    MAX_ROLLOUTS_PER_REQUEST,
    SPLITS,
    Agent,
    AgentSettings,
    EvaluationRequest,
    EvaluationResponse,
    GroupedRolloutRequest,
    ProblemInfo,
    ProblemsRequest,
    Split,
)
from asyncrl.agents.openai_inference import read_head
from asyncrl.config.schema import AgentConfig
from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.tasks import Problem
from asyncrl.types import SamplingSpec, TrajectoryGroup

_Request = ProblemsRequest | GroupedRolloutRequest | EvaluationRequest


@dataclass
class RemoteParams:
    url: str = MISSING  # the env server, e.g. http://127.0.0.1:8765
    remote_env_id: str = ""  # the env id on the server; empty: this agent's env_id
    token_env: str = "ASYNCRL_ENV_TOKEN"  # the environment variable holding the server's bearer token
    timeout_s: float = 600.0
    # The most of an answer read (a group of n trajectories of engine.max_model_len tokens is
    # ~30 bytes a token as JSON); a longer one is a failed request, the rest never read.
    max_answer_mb: int = 256


class RemoteError(RuntimeError):
    """The env server refused a request or could not be reached; the message says which and why."""


class RemoteAgent(Agent):
    params_class = RemoteParams
    remote = True

    def __init__(self, spec: AgentConfig, params: RemoteParams, settings: AgentSettings):
        super().__init__(spec, params, settings)
        if not params.url.startswith(("http://", "https://")):
            raise ValueError(f"env {spec.env_id!r}: params.url={params.url!r}: must start with http:// or https://")
        self.remote_env_id = params.remote_env_id or spec.env_id

    def _headers(self) -> dict[str, str]:
        token = os.environ.get(self.params.token_env, "")
        if not token:
            raise RemoteError(f"env {self.env_id!r}: ${self.params.token_env} is not set; it must hold the env "
                              "server's bearer token")
        return {"Authorization": f"Bearer {token}"}

    # Requests go out as the api's request dataclasses, which are the server's bodies: the JSON
    # a client sends and the fields a server accepts are one definition.
    def _post_sync(self, path: str, request: _Request) -> Any:
        limit = self.params.max_answer_mb << 20
        try:
            with httpx.stream("POST", self.params.url.rstrip("/") + path, json=asdict(request),
                              headers=self._headers(), timeout=self.params.timeout_s) as r:
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        break
        except httpx.HTTPError as e:
            raise RemoteError(f"env {self.env_id!r}: {self.params.url}{path}: {type(e).__name__}: {e}") from None
        return self._answer(path, r.status_code, bytes(body), limit)

    async def _post(self, path: str, request: _Request) -> Any:
        limit = self.params.max_answer_mb << 20
        try:
            async with httpx.AsyncClient(timeout=self.params.timeout_s) as client:
                async with client.stream("POST", self.params.url.rstrip("/") + path, json=asdict(request),
                                         headers=self._headers()) as r:
                    body = await read_head(r, limit + 1)
        except httpx.HTTPError as e:
            raise RemoteError(f"env {self.env_id!r}: {self.params.url}{path}: {type(e).__name__}: {e}") from None
        return self._answer(path, r.status_code, body, limit)

    def _answer(self, path: str, status: int, body: bytes, limit: int) -> Any:
        """The answer's JSON; a refusal, an answer past `limit` bytes or one that is not JSON raise."""
        where = f"env {self.env_id!r}: {self.params.url}{path}"
        if status != 200:
            raise RemoteError(f"{where} answered {status}: {body[:500].decode(errors='replace')}")
        if len(body) > limit:
            raise RemoteError(f"{where} answered more than {self.params.max_answer_mb} MiB "
                              "(params.max_answer_mb): the rest was not read")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise RemoteError(f"{where} answered 200 with a body that is not JSON ({type(e).__name__})") from None

    # -- the agent API over HTTP ----------------------------------------------------------

    def load_splits(self) -> dict[str, list[Problem]]:
        return {split: self._fetch(split) for split in SPLITS}

    def _fetch(self, split: Split) -> list[Problem]:
        rows = self._post_sync("/problems/", ProblemsRequest(self.remote_env_id, split))["problems"]
        try:
            infos = [ProblemInfo(**r) for r in rows]
        except TypeError as e:
            raise RemoteError(f"env {self.env_id!r}: {self.params.url}/problems/ answered an unexpected problem: "
                              f"{e}") from None
        # Ids are the server's, prefixed with this env id so that they stay unique in the run.
        return [Problem(prompt_id=f"{self.env_id}:{p.prompt_id}", task="", question=p.prompt, prompt=p.prompt,
                        answer="", env_id=self.env_id, messages=p.messages, tools=p.tools) for p in infos]

    def reward(self, problem: Problem, response: str) -> float:
        raise RemoteError(f"env {self.env_id!r} is remote: its server scores its rollouts")

    def _remote_id(self, prompt_id: str) -> str:
        return prompt_id.split(":", 1)[1].partition("#e")[0]

    @staticmethod
    def _endpoint(inference: InferenceInterface) -> Endpoint:
        endpoint = getattr(inference, "endpoint", None)
        if not isinstance(endpoint, Endpoint):
            raise RemoteError("a remote agent needs an inference interface reachable over HTTP "
                              f"(with an `endpoint`); got {type(inference).__name__}")
        return endpoint

    async def grouped_rollout(self, problem: Problem, group_size: int, inference: InferenceInterface,
                              group_id: str = "", sampling: SamplingSpec | None = None) -> TrajectoryGroup:
        group_id = group_id or problem.prompt_id
        out = await self._post("/grouped_rollouts/", GroupedRolloutRequest(
            self.remote_env_id, self._endpoint(inference), problem_ids=[self._remote_id(problem.prompt_id)],
            group_size=group_size, group_ids=[group_id], sampling=sampling or self.sampling()))
        group = TrajectoryGroup.from_dict(out["groups"][0])
        group.prompt_id, group.env_id = problem.prompt_id, self.env_id
        for t in group.trajectories:
            t.prompt_id, t.env_id = problem.prompt_id, self.env_id
        return group

    async def rollout(self, problem: Problem, inference: InferenceInterface, sampling: SamplingSpec | None = None,
                      group_id: str = "") -> Any:
        return (await self.grouped_rollout(problem, 1, inference, group_id, sampling)).trajectories[0]

    async def evaluate(self, problems: list[Problem], inference: InferenceInterface, n_samples: int,
                       temperature: float, pass_k: list[int]) -> EvaluationResponse:
        # the server takes at most MAX_ROLLOUTS_PER_REQUEST rollouts (greedy + samples) a request
        per_request = max(1, MAX_ROLLOUTS_PER_REQUEST // (1 + n_samples))
        chunks = [problems[i:i + per_request] for i in range(0, len(problems), per_request)]
        # a k above n_samples has no pass@k (a local agent's metrics leave it out); the server refuses it
        pass_k = [k for k in pass_k if k <= n_samples]
        outs = await asyncio.gather(*[self._post("/evaluation/", EvaluationRequest(
            self.remote_env_id, self._endpoint(inference), problem_ids=[self._remote_id(p.prompt_id) for p in chunk],
            n_samples=n_samples, temperature=temperature, pass_k=pass_k)) for chunk in chunks])
        parts = [EvaluationResponse.from_dict(out) for out in outs]
        response = parts[0] if parts else EvaluationResponse(self.env_id, [], pass_k, temperature)
        response.results = [r for part in parts for r in part.results]
        response.seconds = max((part.seconds for part in parts), default=0.0)
        response.env_id = self.env_id
        for r, p in zip(response.results, problems):
            r.prompt_id, r.env_id = p.prompt_id, self.env_id
        return response

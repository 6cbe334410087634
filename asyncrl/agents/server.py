"""The env server: registered agents over HTTP (FastAPI), for remote rollouts (`asyncrl serve-env`,
asyncrl/serve_env.py, starts it).

    export ASYNCRL_ENV_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    asyncrl serve-env --config recipes/multi_task/env_server.yaml --port 8765 [--host 127.0.0.1] [key=value ...]

The config file is a recipe-style YAML over the defaults (the `agents` list, `model` for
the tokenizer, `rollout` for sampling). Endpoints (JSON; all but /health need
`Authorization: Bearer $ASYNCRL_ENV_TOKEN`):
    GET  /health                 liveness
    GET  /envs/                  the env ids served, with weights and loops
    POST /problems/              {env_id, split}: the problems' ids and prompts (no answers)
    POST /rollouts/              {env_id, problem_ids | num_rollouts, inference, sampling?}
    POST /grouped_rollouts/      {env_id, problem_ids | num_groups, group_size, group_ids?, inference, sampling?}
    POST /evaluation/            {env_id, problem_ids | num_problems, n_samples, pass_k, temperature, inference}
The bodies are the request dataclasses of asyncrl/agents/api.py (`ProblemsRequest`,
`RolloutRequest`, `GroupedRolloutRequest`, `EvaluationRequest`), which a remote agent sends;
`inference` is an OpenAI-compatible endpoint ({base_url, model, api_key}) the agents
generate through. The server binds to 127.0.0.1 unless told otherwise, refuses bodies
over --max-request-bytes (413), answers a missing token with 401, a wrong one with 403,
a malformed body with 422, an unknown env or problem with 404, and builds agents only
from the registry, from its own config at start: a request can only name an env id.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse

from asyncrl.agents.api import (
    MAX_ROLLOUTS_PER_REQUEST,
    Agent,
    EvaluationRequest,
    GroupedRolloutRequest,
    ProblemsRequest,
    RolloutRequest,
)
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.inference.protocol import Endpoint
from asyncrl.types import SamplingSpec

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


# -- the app -----------------------------------------------------------------------------

class _BodyLimit:
    """Refuses request bodies over `max_bytes` (413), declared or streamed."""

    class TooLarge(Exception):
        pass

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._refuse(send)
        seen = 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise self.TooLarge
            return message

        try:
            await self.app(scope, limited, send)
        except self.TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        body = json.dumps({"detail": f"request body over the server's limit of {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(agents: WeightedMultiTask, token: str, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Any:
    """The env server's ASGI app over already-built agents."""
    if not token:
        raise ValueError("the env server needs a bearer token")
    app = FastAPI(title="asyncrl env server")

    def authorized(request: Request) -> None:
        header = request.headers.get("authorization")
        if not header:
            raise HTTPException(401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(403, "invalid bearer token")

    def agent(env_id: str) -> Agent:
        if env_id not in agents.agents:
            raise HTTPException(404, f"unknown env_id {env_id!r}; this server hosts: {', '.join(agents.agents)}")
        return agents.agents[env_id]

    @contextlib.asynccontextmanager
    async def inference(a: Agent, endpoint: Endpoint) -> AsyncIterator[OpenAIInference]:
        """The request's inference endpoint, for the request's lifetime."""
        engine = OpenAIInference(endpoint, tokenizer=a.tokenizer)
        try:
            yield engine
        finally:
            await engine.aclose()

    def sampling(a: Agent, spec: SamplingSpec | None) -> SamplingSpec:
        return spec if spec is not None else a.sampling()

    def problems(a: Agent, split: str, ids: list[str], count: int) -> list:
        try:
            return a.find_problems(split, ids, count)
        except KeyError as e:
            raise HTTPException(404, e.args[0]) from None

    @app.exception_handler(RuntimeError)
    async def inference_failed(request: Request, e: RuntimeError) -> JSONResponse:
        logger.warning("%s: %s", request.url.path, e)
        return JSONResponse({"detail": f"inference failed: {e}"}, status_code=502)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/envs/", dependencies=[Depends(authorized)])
    async def envs() -> dict[str, Any]:
        return {"envs": [{"env_id": a.env_id, "weight": a.weight, "agent_loop": a.agent_loop,
                          "type": type(a).__name__} for a in agents.agents.values()]}

    @app.post("/problems/", dependencies=[Depends(authorized)])
    async def list_problems(body: ProblemsRequest) -> dict[str, Any]:
        return {"problems": [{"prompt_id": p.prompt_id, "prompt": p.prompt}
                             for p in agent(body.env_id).problems(body.split)]}

    @app.post("/rollouts/", dependencies=[Depends(authorized)])
    async def rollouts(body: RolloutRequest) -> dict[str, Any]:
        a = agent(body.env_id)
        chosen = problems(a, "train", body.problem_ids, body.num_rollouts)
        spec = sampling(a, body.sampling)
        async with inference(a, body.inference) as engine:
            trajs = await asyncio.gather(*[a.rollout(p, engine, spec) for p in chosen])
        return {"rollouts": [t.to_dict() for t in trajs]}

    @app.post("/grouped_rollouts/", dependencies=[Depends(authorized)])
    async def grouped_rollouts(body: GroupedRolloutRequest) -> dict[str, Any]:
        a = agent(body.env_id)
        chosen = problems(a, "train", body.problem_ids, body.num_groups)
        if body.group_ids and len(body.group_ids) != len(chosen):
            raise HTTPException(422, f"group_ids has {len(body.group_ids)} entries for {len(chosen)} groups")
        if len(chosen) * body.group_size > MAX_ROLLOUTS_PER_REQUEST:
            raise HTTPException(422, f"{len(chosen)} groups x {body.group_size} exceeds "
                                f"{MAX_ROLLOUTS_PER_REQUEST} rollouts per request")
        ids, spec = body.group_ids or [p.prompt_id for p in chosen], sampling(a, body.sampling)
        async with inference(a, body.inference) as engine:
            groups = await asyncio.gather(*[a.grouped_rollout(p, body.group_size, engine, gid, spec)
                                            for p, gid in zip(chosen, ids)])
        return {"groups": [g.to_dict() for g in groups]}

    @app.post("/evaluation/", dependencies=[Depends(authorized)])
    async def evaluation(body: EvaluationRequest) -> dict[str, Any]:
        a = agent(body.env_id)
        bad = [k for k in body.pass_k if not 1 <= k <= max(1, body.n_samples)]
        if bad:
            raise HTTPException(422, f"pass_k {bad[0]} must be in [1, n_samples={body.n_samples}]")
        chosen = problems(a, "heldout", body.problem_ids, body.num_problems)
        async with inference(a, body.inference) as engine:
            response = await a.evaluate(chosen, engine, body.n_samples, body.temperature, body.pass_k)
        return response.to_dict()

    return _BodyLimit(app, max_request_bytes)


"""The env server: registered agents over HTTP (FastAPI), for remote rollouts (`asyncrl serve-env`,
asyncrl/serve_env.py, starts it).

    export ASYNCRL_ENV_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    asyncrl serve-env --config recipes/multi_task/env_server.yaml --port 8765 [--host 127.0.0.1] \
        [--allow-inference-host HOST ...] [key=value ...]

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
generate through. Agents are built only from the registry, from the server's own config at
start: a request can only name an env id. The server binds to 127.0.0.1 unless told otherwise.

The rules, in the order they are applied (`ServerLimits` holds the numbers):
  connection, token, body
              the guard's, in front of the app (asyncrl/agents/http_guard.py, whose docstring
              states them): a budget of connections by authentication and client address,
              deadlines for requests and answers, the bearer token checked from the headers
              before any of the body is read, bodies bounded in size and time, strict JSON only.
  request     a field out of its bounds or unknown -> 422; unknown env or problem -> 404; a
              pass_k out of [1, n_samples] or repeated -> 422; an `inference.base_url` that is
              not a URL -> 422, whose host is neither loopback nor allowed at start
              (--allow-inference-host) -> 403; more than MAX_ROLLOUTS_PER_REQUEST rollouts,
              counted after expanding repeated problem ids, groups and (evaluation) 1 greedy +
              n_samples per problem -> 422; more than `max_rollouts_in_flight` across the
              server's requests -> 503 with Retry-After.
  inference   rollouts run on an event loop of their own (a thread), so that their work never
              holds up /health or the other requests; at most `max_concurrent_generations`
              requests to inference endpoints at once, server-wide; an endpoint's failure is
              reported by endpoint and status code, never with the body it answered (the server
              must not relay what a URL it was pointed at says).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from asyncrl.agents.api import (
    MAX_ROLLOUTS_PER_REQUEST,
    Agent,
    EvaluationRequest,
    GroupedRolloutRequest,
    ProblemInfo,
    ProblemsRequest,
    RolloutRequest,
)
from asyncrl.agents.http_guard import ServerLimits, guarded
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.inference.protocol import Endpoint
from asyncrl.types import SamplingSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")


# -- where inference may be sent -----------------------------------------------------------

_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*$")


class InferenceHosts:
    """The hosts an `inference.base_url` may name: loopback (127.0.0.0/8, ::1, localhost) and those
    given at start. A name is compared as written (never resolved), so it is allowed only by name."""

    def __init__(self, allowed: Iterable[str] = ()):
        self.names: set[str] = {"localhost"}
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allowed:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip().strip("[]"), strict=False))
            except ValueError:
                name = entry.strip().lower().rstrip(".")
                if not _HOST_NAME.match(name):
                    raise ValueError(f"allowed inference host {entry!r}: not a host name, IP address or "
                                     "network (e.g. gpu-node-3, 10.0.0.7, 10.0.0.0/24)") from None
                self.names.add(name)

    def check(self, base_url: str) -> None:
        """Raise the HTTPException that refuses `base_url`, if it is refused."""
        try:
            url = httpx.URL(base_url)
            if url.port is not None and not 0 < url.port < 65536:
                raise httpx.InvalidURL(f"port {url.port} out of range")
        except httpx.InvalidURL as e:
            raise HTTPException(422, f"inference.base_url is not a valid URL: {e}") from None
        host = url.host
        if not self.allows(host):
            raise HTTPException(403, f"inference.base_url host {host!r} is not allowed: this server sends "
                                "inference requests only to loopback and to the hosts it was started with "
                                "(asyncrl serve-env --allow-inference-host HOST)")

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return bool(host) and host in self.names
        return address.is_loopback or any(address in n for n in self.networks)




# -- the app -----------------------------------------------------------------------------

class _Admission:
    """The rollouts the server's requests have under way, bounded."""

    def __init__(self, limit: int):
        self.limit, self.in_flight = limit, 0

    @contextlib.contextmanager
    def admit(self, rollouts: int) -> Iterator[None]:
        if self.in_flight + rollouts > self.limit:
            raise HTTPException(503, f"busy: {self.in_flight} rollouts in flight and {rollouts} asked for, over "
                                f"the server's limit of {self.limit}; retry later", headers={"Retry-After": "5"})
        self.in_flight += rollouts
        try:
            yield
        finally:
            self.in_flight -= rollouts


async def _json(payload: Callable[[], Any]) -> Response:
    """The rollout endpoints' answer, built and encoded off the event loop: thousands of
    trajectories (and pass@k over them) would hold it for seconds. FastAPI's own encoding of a
    returned dict walks it in Python, on the loop."""
    body = await asyncio.to_thread(lambda: json.dumps(payload(), allow_nan=False, separators=(",", ":")).encode())
    return Response(body, media_type="application/json")


class _RolloutLoop:
    """A second event loop, on a thread of its own (started on first use), where the agents'
    rollouts run. On the server's loop their work (tokenizing, agent loops, the tracebacks of
    failed samples: milliseconds each, thousands at once) would delay every other request,
    /health included; here it only shares the interpreter, which switches threads every 5 ms."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="env-server-rollouts", daemon=True).start()
        # cancelling the caller cancels the work
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self._loop))


def _capped(rollouts: int, what: str) -> None:
    if rollouts > MAX_ROLLOUTS_PER_REQUEST:
        raise HTTPException(422, f"{what} = {rollouts} rollouts, over {MAX_ROLLOUTS_PER_REQUEST} per request")


def create_app(agents: WeightedMultiTask, token: str, limits: ServerLimits | None = None) -> Any:
    """The env server's ASGI app over already-built agents (`.app` is the FastAPI app behind the guard)."""
    if not token:
        raise ValueError("the env server needs a bearer token")
    limits = limits or ServerLimits()
    hosts = InferenceHosts(limits.inference_hosts)
    admission = _Admission(limits.max_rollouts_in_flight)
    rollout_loop = _RolloutLoop()
    generations = asyncio.Semaphore(limits.max_concurrent_generations)  # used on the rollout loop only
    app = FastAPI(title="asyncrl env server", docs_url=None, redoc_url=None, openapi_url=None)

    def agent(env_id: str) -> Agent:
        if env_id not in agents.agents:
            raise HTTPException(404, f"unknown env_id {env_id!r}; this server hosts: {', '.join(agents.agents)}")
        return agents.agents[env_id]

    async def generate(a: Agent, endpoint: Endpoint, rollouts: int,
                       work: Callable[[OpenAIInference], Awaitable[T]]) -> T:
        """`work` with the request's inference endpoint, once its rollouts are admitted, on the rollout loop."""
        async def on_engine() -> T:
            engine = OpenAIInference(endpoint, tokenizer=a.tokenizer, slots=generations)
            try:
                return await work(engine)
            finally:
                await engine.aclose()

        with admission.admit(rollouts):
            return await rollout_loop.run(on_engine())

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

    @app.get("/envs/")
    async def envs() -> dict[str, Any]:
        return {"envs": [{"env_id": a.env_id, "weight": a.weight, "agent_loop": a.agent_loop,
                          "type": type(a).__name__} for a in agents.agents.values()]}

    @app.post("/problems/")
    async def list_problems(body: ProblemsRequest) -> dict[str, Any]:
        return {"problems": [asdict(ProblemInfo.of(p)) for p in agent(body.env_id).problems(body.split)]}

    @app.post("/rollouts/")
    async def rollouts(body: RolloutRequest) -> Response:
        a = agent(body.env_id)
        hosts.check(body.inference.base_url)
        chosen = problems(a, "train", body.problem_ids, body.num_rollouts)
        _capped(len(chosen), f"{len(chosen)} problems")
        spec = sampling(a, body.sampling)
        trajs = await generate(a, body.inference, len(chosen),
                               lambda engine: asyncio.gather(*[a.rollout(p, engine, spec) for p in chosen]))
        return await _json(lambda: {"rollouts": [t.to_dict() for t in trajs]})

    @app.post("/grouped_rollouts/")
    async def grouped_rollouts(body: GroupedRolloutRequest) -> Response:
        a = agent(body.env_id)
        hosts.check(body.inference.base_url)
        chosen = problems(a, "train", body.problem_ids, body.num_groups)
        if body.group_ids and len(body.group_ids) != len(chosen):
            raise HTTPException(422, f"group_ids has {len(body.group_ids)} entries for {len(chosen)} groups")
        _capped(len(chosen) * body.group_size, f"{len(chosen)} groups x {body.group_size}")
        ids, spec = body.group_ids or [p.prompt_id for p in chosen], sampling(a, body.sampling)
        groups = await generate(a, body.inference, len(chosen) * body.group_size, lambda engine: asyncio.gather(
            *[a.grouped_rollout(p, body.group_size, engine, gid, spec) for p, gid in zip(chosen, ids)]))
        return await _json(lambda: {"groups": [g.to_dict() for g in groups]})

    @app.post("/evaluation/")
    async def evaluation(body: EvaluationRequest) -> Response:
        a = agent(body.env_id)
        hosts.check(body.inference.base_url)
        bad = [k for k in body.pass_k if not 1 <= k <= max(1, body.n_samples)]
        if bad:
            raise HTTPException(422, f"pass_k {bad[0]} must be in [1, n_samples={body.n_samples}]")
        if len(set(body.pass_k)) != len(body.pass_k):
            raise HTTPException(422, "pass_k repeats a k")
        chosen = problems(a, "heldout", body.problem_ids, body.num_problems)
        rollouts = len(chosen) * (1 + body.n_samples)
        _capped(rollouts, f"{len(chosen)} problems x (1 greedy + {body.n_samples} samples)")
        response = await generate(a, body.inference, rollouts, lambda engine: a.evaluate(
            chosen, engine, body.n_samples, body.temperature, body.pass_k))
        return await _json(response.to_dict)

    return guarded(app, token, limits)

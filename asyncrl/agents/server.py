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
  connection  request headers must be complete within `read_timeout_s` of the connection (or
              of the previous response), else the connection is dropped, and fit in 16 KiB, else
              431 (400 while they arrive); idle keep-alive connections close after 5 s; at most `max_connections`
              connections and requests at once (503 beyond).
  token       checked from the headers alone, before any of the body is read: missing -> 401,
              wrong -> 403, both with `Connection: close` (the body is never parsed). Only
              /health needs none.
  body        over `max_request_bytes`, declared or streamed -> 413; not all there within
              `read_timeout_s` -> 408 (both close the connection); not strict JSON (NaN and
              Infinity, numbers that overflow a float, integers over 64 digits, nesting over
              32 levels, bad UTF-8) -> 422; a field out of its bounds or unknown -> 422.
  request     unknown env or problem -> 404; a pass_k out of [1, n_samples] or repeated -> 422;
              an `inference.base_url` that is not a URL -> 422, whose host is neither loopback
              nor allowed at start (--allow-inference-host) -> 403; more than
              MAX_ROLLOUTS_PER_REQUEST rollouts, counted after expanding repeated problem ids,
              groups and (evaluation) 1 greedy + n_samples per problem -> 422; more than
              `max_rollouts_in_flight` across the server's requests -> 503 with Retry-After.
  inference   rollouts run on an event loop of their own (a thread), so that their work never
              holds up /health or the other requests; at most `max_concurrent_generations`
              requests to inference endpoints at once, server-wide; an endpoint's failure is
              reported by endpoint and status code, never with the body it answered (the server
              must not relay what a URL it was pointed at says).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import asdict, dataclass
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
from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.agents.openai_inference import OpenAIInference
from asyncrl.inference.protocol import Endpoint
from asyncrl.types import SamplingSpec

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 * 1024
MAX_JSON_DEPTH = 32  # the request bodies nest 3 levels deep
MAX_JSON_INT_DIGITS = 64

T = TypeVar("T")
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """What one client may make the env server do (the module docstring says what happens past each)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    read_timeout_s: float = 10.0  # for a request's headers, and again for its body
    max_connections: int = 512
    max_rollouts_in_flight: int = 2 * MAX_ROLLOUTS_PER_REQUEST
    # Below httpx's pool of 100 connections a client: a pool with a long queue of waiting requests
    # costs time quadratic in its length (4096 waiting: minutes of a busy event loop).
    max_concurrent_generations: int = 64
    inference_hosts: tuple[str, ...] = ()  # besides loopback: host names, IP addresses or networks (CIDR)


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


# -- the ASGI layer in front of the app: token, body size, body time, strict JSON ------------

class _NotStrictJSON(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotStrictJSON(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _NotStrictJSON(f"number {text[:20]}{'...' if len(text) > 20 else ''} overflows a float")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _NotStrictJSON(f"integer of {len(text.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS})")
    return int(text)


def json_problem(body: bytes) -> str | None:
    """Why `body` is not strict JSON (RFC 8259 without NaN / Infinity, finite floats, integers of
    at most 64 digits, nesting at most 32 levels), or None when it is."""
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except json.JSONDecodeError as e:
        return f"{e.msg} at position {e.pos}"
    except RecursionError:
        return f"nested deeper than {MAX_JSON_DEPTH} levels"
    except _NotStrictJSON as e:
        return str(e)
    except UnicodeDecodeError:
        return "not UTF-8 text"
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return None


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class _Guard:
    """Answers, before the app sees a request, what needs no app: a missing or wrong token (from
    the headers; the body is not read), a body too large or too slow, a body that is not strict
    JSON. The app then gets the body as read here."""

    def __init__(self, app: Any, token: str, limits: ServerLimits):
        self.app, self.limits = app, limits
        self._token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # h11 bounds headers that arrive in parts; these came in one read
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return await _respond(send, 431, f"request headers over {MAX_HEADER_BYTES} bytes")
        if scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        header = headers.get(b"authorization", b"")
        if not header:
            return await _respond(send, 401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                  [(b"www-authenticate", b"Bearer")])
        scheme, _, given = header.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self._token):
            return await _respond(send, 403, "invalid bearer token")
        too_large = f"request body over the server's limit of {self.limits.max_request_bytes} bytes"
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limits.max_request_bytes):
            return await _respond(send, 413, too_large)
        try:
            body = await asyncio.wait_for(self._body(receive), self.limits.read_timeout_s)
        except _TooLarge:
            return await _respond(send, 413, too_large)
        except asyncio.TimeoutError:
            return await _respond(send, 408, f"request body not received within {self.limits.read_timeout_s:g} s")
        except _Disconnected:
            return None
        problem = json_problem(body) if body else None
        if problem is not None:
            return await _respond(send, 422, [{"type": "json_invalid", "loc": ["body"], "msg": "JSON decode error",
                                               "ctx": {"error": problem}}], close=False)
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


async def _respond(send: Send, status: int, detail: Any, headers: list[tuple[bytes, bytes]] | None = None,
                   close: bool = True) -> None:
    """A JSON error answered by the guard; `close`: the connection closes after it (its body,
    if any, unread or unwanted)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *([(b"connection", b"close")] if close else []), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


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

    return _Guard(app, token, limits)


# -- the HTTP server ---------------------------------------------------------------------

def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, log_level: str = "info") -> Any:
    """uvicorn's settings for the env server: h11 with a deadline for request headers, bounded
    header size and connections, no websockets, no proxy headers."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=_header_deadline(limits.read_timeout_s),
                          ws="none", lifespan="off", proxy_headers=False, server_header=False,
                          timeout_keep_alive=5, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          limit_concurrency=limits.max_connections)


def _header_deadline(timeout_s: float) -> type:
    """uvicorn's h11 protocol, dropping a connection whose request headers are not complete within
    `timeout_s` of its start (or of the previous response). uvicorn's own keep-alive timeout is
    disarmed by any byte received, so a client sending a byte now and then would hold it forever."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline

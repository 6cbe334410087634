"""The guard in front of asyncrl's HTTP servers, the env server (asyncrl/agents/server.py) and
the rollout worker's inference gateway (asyncrl/rollout/gateway.py): a request guard (ASGI) and
a connection budget with deadlines (in uvicorn's h11 protocol, through uvicorn_compat.py).

    app = guarded(fastapi_app, token, limits)
    uvicorn.Server(uvicorn_config(app, host, port, limits)).run()

The rules, in the order they are applied (`ServerLimits` holds the numbers; the servers'
own rules follow them):
  connection  at most `max_connections` connections; of them at most `max_unauthenticated` on
              which no request has carried the token yet (/health's included), and of those
              `max_unauthenticated_per_peer` from one client address (an IPv6 /64). Past a share,
              an unauthenticated connection is closed: the one whose request began longest ago,
              of the address holding the most; over `max_connections` at once, over the others
              after 0.5 s (a client's burst of new connections has sent its token by then); when
              all `max_connections` are authenticated, a new one is closed at once.
              A request without the token must be complete, headers, body and answer, within
              `read_timeout_s` of its start (the connection's, or the previous answer's), else
              the connection is dropped; one with the token must have its headers in within
              `read_timeout_s` (its body: below). Headers over 16 KiB: 431 (400 while they
              arrive); idle keep-alive connections close after `keep_alive_s` (5 s). An answer the client does not
              read (the server's buffers full) for `write_timeout_s` drops the connection, what
              is unsent discarded.
  token       checked from the headers alone, before any of the body is read: missing -> 401,
              wrong -> 403, both with `Connection: close` (the body is never parsed). Only
              /health needs none; a /health with a body (declared or chunked) -> 400, closed,
              the body not waited for. With `scoped` (the gateway's chat sessions), a path
              /<scoped>/<id>/... also takes `scoped_key(token, id)`, valid on that id's paths alone:
              a program handed one session's key reaches no other session and no other route.
  body        over `max_request_bytes`, declared or streamed -> 413; not all there within
              `read_timeout_s` -> 408 (both close the connection); not strict JSON (NaN and
              Infinity, numbers that overflow a float, integers over 64 digits, nesting over
              32 levels, bad UTF-8) -> 422.

Why close the oldest unauthenticated connection rather than refuse a new one: until its
headers arrive, a client's connection cannot be told from an attacker's. Refusing new ones
hands the share to whoever came first (a flood that holds it); closing the oldest hands it to
whoever is sending now (a client sends its request as soon as it connects, a flood's connection
has been waiting), and an address flooding alone closes its own first. Under a flood that
reconnects as fast as it is closed, from a client's own address, a client may still lose the
race: no server can tell the two apart before the token.

Why a connection layer of our own over uvicorn's h11 protocol: uvicorn's limit_concurrency
counts idle connections too and answers 503 to everyone past it (so any flood shuts every
client out), its keep-alive timer is disarmed by any byte received, and it has no deadline for
a request as a whole nor for an answer nobody reads. An ASGI middleware cannot help: it runs
only once a request's headers are in, and never sees a connection that sends nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncrl.agents.api import MAX_ROLLOUTS_PER_REQUEST
from asyncrl.agents.uvicorn_compat import h11_protocol

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 * 1024
MAX_JSON_DEPTH = 32  # the request bodies nest 3 levels deep
MAX_JSON_INT_DIGITS = 64

# ASGI's callables
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ServerLimits:
    """What one client may make the env server do (the module docstring says what happens past each
    of the guard's; asyncrl/agents/server.py's, past the rollouts and generations)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # with the token: for a request's headers, and again for its body; without: for all of it, answer included
    read_timeout_s: float = 10.0
    write_timeout_s: float = 30.0  # an answer's client not reading, at most (a trainer's pause included)
    max_connections: int = 512
    max_unauthenticated: int = 256  # of max_connections: so a flood leaves the rest to clients with the token
    # above httpx's pool of 100 connections: a client's burst of new connections is not cut
    max_unauthenticated_per_peer: int = 128
    max_rollouts_in_flight: int = 2 * MAX_ROLLOUTS_PER_REQUEST
    # Below httpx's pool of 100 connections a client: a pool with a long queue of waiting requests
    # costs time quadratic in its length (4096 waiting: minutes of a busy event loop).
    max_concurrent_generations: int = 64
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this long
    inference_hosts: tuple[str, ...] = ()  # besides loopback: host names, IP addresses or networks (CIDR)

    def __post_init__(self) -> None:
        if not 1 <= self.max_unauthenticated_per_peer <= self.max_unauthenticated <= self.max_connections:
            raise ValueError(f"server limits: need 1 <= max_unauthenticated_per_peer "
                             f"({self.max_unauthenticated_per_peer}) <= max_unauthenticated "
                             f"({self.max_unauthenticated}) <= max_connections ({self.max_connections})")
        if not (self.read_timeout_s > 0 and self.write_timeout_s > 0):
            raise ValueError(f"server limits: read_timeout_s ({self.read_timeout_s:g}) and write_timeout_s "
                             f"({self.write_timeout_s:g}) must be positive")



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


def scoped_key(token: str, scope_id: str) -> str:
    """The bearer key valid on the paths /<scoped>/<scope_id>/... of a server guarded with `token`."""
    return hmac.new(token.encode(), scope_id.encode(), hashlib.sha256).hexdigest()


class _Guard:
    """Answers, before the app sees a request, what needs no app: a missing or wrong token (from
    the headers; the body is not read), a body too large or too slow, a body that is not strict
    JSON. The app then gets the body as read here."""

    def __init__(self, app: Any, token: str, limits: ServerLimits, scoped: str = ""):
        self.app, self.limits = app, limits
        self._secret, self._token = token, token.encode()
        self._scoped = f"/{scoped}/" if scoped else ""

    def authorized(self, headers: Iterable[tuple[bytes, bytes]], path: str) -> bool:
        """Whether request headers (names in lower case) carry a token valid for `path`."""
        return self._token_refusal(dict(headers), path) is None

    def _token_refusal(self, headers: dict[bytes, bytes], path: str) -> int | None:
        """401 without a bearer token, 403 with a wrong one, None with the server's (or, on a
        scoped path, its scope's)."""
        header = headers.get(b"authorization", b"")
        if not header:
            return 401
        scheme, _, given = header.partition(b" ")
        given = given.strip()
        if scheme.lower() != b"bearer":
            return 403
        if hmac.compare_digest(given, self._token):
            return None
        if self._scoped and path.startswith(self._scoped):
            scope_id = path[len(self._scoped):].partition("/")[0]
            if scope_id and hmac.compare_digest(given, scoped_key(self._secret, scope_id).encode()):
                return None
        return 403

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # h11 bounds headers that arrive in parts; these came in one read
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            return await _respond(send, 431, f"request headers over {MAX_HEADER_BYTES} bytes")
        headers = dict(scope["headers"])
        if scope["path"] == "/health":
            # whoever calls it has no body to send: one declared would only hold the connection
            declared = headers.get(b"content-length", b"0").strip()
            if not declared.isdigit() or int(declared) > 0 or b"transfer-encoding" in headers:
                return await _respond(send, 400, "/health takes no body")
            return await self.app(scope, receive, send)
        refusal = self._token_refusal(headers, scope["path"])
        if refusal == 401:
            return await _respond(send, 401, "missing bearer token: send 'Authorization: Bearer <token>'",
                                  [(b"www-authenticate", b"Bearer")])
        if refusal == 403:
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


def guarded(app: Any, token: str, limits: ServerLimits, scoped: str = "") -> Any:
    """`app` behind the request guard: the bearer `token` checked from the headers before any of
    the body is read, bodies bounded in size and time, strict JSON only. Served with
    `uvicorn_config`, its connections are held to the budget and deadlines of `limits` too.
    `scoped`: a path segment whose ids have keys of their own (`scoped_key`)."""
    return _Guard(app, token, limits, scoped)


# -- the connections: a budget by authentication and peer, deadlines per request -----------

SETTLE_S = 0.5  # how long a connection over an unauthenticated share has to send its token


def uvicorn_config(app: Any, host: str, port: int, limits: ServerLimits, log_level: str = "info") -> Any:
    """uvicorn's settings for a guarded app: h11 with our connection budget and deadlines
    (`_GuardedConnection`), bounded header size, no websockets, no proxy headers."""
    import uvicorn

    authorized = app.authorized if isinstance(app, _Guard) else lambda headers, path: False
    budget = _Budget(limits)
    http = h11_protocol(lambda: _GuardedConnection(budget, limits, authorized))
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=http,
                          ws="none", lifespan="off", proxy_headers=False, server_header=False,
                          timeout_keep_alive=limits.keep_alive_s, h11_max_incomplete_event_size=MAX_HEADER_BYTES)


def _peer(transport: asyncio.BaseTransport) -> str:
    """The client address a connection counts against: its IP address, or its /64 for IPv6 (one
    host commonly holds a whole /64)."""
    peer = transport.get_extra_info("peername")
    host = peer[0] if isinstance(peer, tuple) and peer else str(peer or "")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


class _Connection:
    """What the budget needs of a connection (`_GuardedConnection`)."""

    peer: str

    def drop(self, why: str) -> None:
        raise NotImplementedError


class _Budget:
    """The server's open connections: the authenticated ones (a request on them carried the
    token), and the others by peer, each peer's in the order their current requests began."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.authenticated: set[_Connection] = set()
        self.unauthenticated: dict[str, dict[_Connection, None]] = {}  # a dict: ordered, O(1) removal
        self.unauthenticated_count = 0
        self._settle: asyncio.TimerHandle | None = None
        self._warned_full = float("-inf")

    def admit(self, conn: _Connection) -> bool:
        """Count a new connection (unauthenticated), closing another if the server is full;
        False when all are authenticated (the caller closes `conn`)."""
        if len(self.authenticated) + self.unauthenticated_count >= self.limits.max_connections:
            victim = self._oldest()
            if victim is None:
                now = time.monotonic()
                if now - self._warned_full > 60:  # once a minute: every refused connection would flood the log
                    self._warned_full = now
                    logger.warning("all %d connections are authenticated: new ones are closed at once",
                                   self.limits.max_connections)
                return False
            victim.drop("the server's connections are full")
        self.unauthenticated.setdefault(conn.peer, {})[conn] = None
        self.unauthenticated_count += 1
        if (self.unauthenticated_count > self.limits.max_unauthenticated
                or len(self.unauthenticated[conn.peer]) > self.limits.max_unauthenticated_per_peer):
            if self._settle is None:
                self._settle = asyncio.get_running_loop().call_later(SETTLE_S, self.settle)
        return True

    def began(self, conn: _Connection) -> None:
        """A request begins on `conn`: it is its peer's youngest."""
        conns = self.unauthenticated.get(conn.peer)
        if conns is not None and conn in conns:
            del conns[conn]
            conns[conn] = None

    def authenticate(self, conn: _Connection) -> None:
        if self._forget(conn):
            self.authenticated.add(conn)

    def remove(self, conn: _Connection) -> None:
        self.authenticated.discard(conn)
        self._forget(conn)

    def settle(self) -> None:
        """Close unauthenticated connections past their shares, the oldest first."""
        self._settle = None
        for conns in list(self.unauthenticated.values()):
            while len(conns) > self.limits.max_unauthenticated_per_peer:
                next(iter(conns)).drop("its address's unauthenticated connections are full")
        while self.unauthenticated_count > self.limits.max_unauthenticated:
            self._oldest().drop("the server's unauthenticated connections are full")  # type: ignore[union-attr]

    def _forget(self, conn: _Connection) -> bool:
        conns = self.unauthenticated.get(conn.peer)
        if conns is None or conn not in conns:
            return False
        del conns[conn]
        if not conns:
            del self.unauthenticated[conn.peer]
        self.unauthenticated_count -= 1
        return True

    def _oldest(self) -> _Connection | None:
        """The unauthenticated connection whose request began longest ago, of the peer that holds the most."""
        if not self.unauthenticated:
            return None
        return next(iter(max(self.unauthenticated.values(), key=len)))


class _GuardedConnection(_Connection):
    """One connection under the rules of the module docstring: counted in the budget by
    authentication and peer, a deadline for each request (the whole of it without the token,
    its headers with it) and one for writes. uvicorn's h11 protocol tells it what happens
    (uvicorn_compat.ConnectionEvents)."""

    def __init__(self, budget: _Budget, limits: ServerLimits,
                 authorized: Callable[[list[tuple[bytes, bytes]], str], bool]):
        self.budget, self.limits, self.authorized = budget, limits, authorized
        self.transport: asyncio.Transport | None = None  # these two (and peer): set by opened()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._write_deadline: asyncio.TimerHandle | None = None

    def opened(self, transport: asyncio.Transport) -> None:
        self.transport, self.peer = transport, _peer(transport)
        self._loop = asyncio.get_running_loop()
        if not self.budget.admit(self):
            self.drop("all connections are authenticated")
            return
        self._begin()

    def request_headers(self, headers: list[tuple[bytes, bytes]], path: str) -> None:
        if self.authorized(headers, path):
            self.budget.authenticate(self)
            self._cancel_deadline()  # its body has the guard's deadline; the app's work, none
        # without the token, the deadline armed at the request's start runs on: body and answer

    def response_complete(self) -> None:
        if not self.transport.is_closing():
            self._begin()  # before uvicorn starts the next request (pipelined), which may have the token

    def writing_paused(self) -> None:
        if self._write_deadline is None:
            self._write_deadline = self._loop.call_later(self.limits.write_timeout_s, self.drop,
                                                         f"its answer unread for {self.limits.write_timeout_s:g} s")

    def writing_resumed(self) -> None:
        self._cancel_write_deadline()

    def lost(self) -> None:
        self.budget.remove(self)
        self._cancel_deadline()
        self._cancel_write_deadline()

    def drop(self, why: str) -> None:
        """Close now, discarding what is unsent: close() would wait for a reader that may never
        read. A reset (linger 0) frees the kernel's buffers at once too."""
        self.lost()
        logger.debug("%s: connection dropped: %s", self.peer, why)  # debug: a flood would flood the log
        with contextlib.suppress(AttributeError, OSError):
            self.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                                               struct.pack("ii", 1, 0))
        self.transport.abort()

    def _begin(self) -> None:
        """A request begins (the connection's first, or the next after an answer)."""
        self.budget.began(self)
        self._cancel_deadline()
        self._deadline = self._loop.call_later(self.limits.read_timeout_s, self.drop,
                                               f"no request complete within {self.limits.read_timeout_s:g} s")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _cancel_write_deadline(self) -> None:
        if self._write_deadline is not None:
            self._write_deadline.cancel()
            self._write_deadline = None

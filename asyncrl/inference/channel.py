"""The request channel: generation requests from a rollout worker to one engine, and their
results, over one TCP connection beside Ray.

Ray stays the control plane (start, pause, resume, weights); generation, one request per
sample and turn, is the data plane. A request as a Ray actor call costs about 1.5 ms of CPU
across the two processes, over the channel 0.12 ms (`python scripts/request_cost.py`,
docs/benchmarks.md); 1.5 ms is as much as vLLM's own front end spends on a 64-token request.

Wire: frames of a 4-byte big-endian length and a msgpack body.
  worker -> engine: the engine's token (first frame), then one `_Request` frame a request;
  engine -> worker: one `_Reply` frame a request, in completion order.
The address and the token travel through Ray (`EngineActor.open_channel()`), so only a process
that may call the actor can generate. Bodies are typed msgpack, never pickle.

What a peer without the token can make the engine do: the first frame must arrive within
AUTH_TIMEOUT_S and claim at most MAX_TOKEN_FRAME_BYTES, checked from its 4-byte length before
any of it is read; a frame claiming more, a wrong token or a stall drops the connection. After
the token, frames are up to MAX_FRAME_BYTES, and one that is not a `_Request` drops it too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec

from asyncrl.types import GenerationResult, SamplingSpec

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 2**20  # a frame claiming more is not ours: the connection is dropped
MAX_TOKEN_FRAME_BYTES = 256  # the token is 32 hex characters
AUTH_TIMEOUT_S = 10.0


@dataclass
class ChannelAddress:
    """Where an engine's channel listens, and the token a connection must send first."""

    host: str
    port: int
    token: str


class _Request(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec


class _Reply(msgspec.Struct, array_like=True):
    request_id: str
    result: GenerationResult | None  # None: `error` says why
    error: str = ""


_encode = msgspec.msgpack.Encoder().encode
_decode_request = msgspec.msgpack.Decoder(_Request).decode
_decode_reply = msgspec.msgpack.Decoder(_Reply).decode


class EngineUnavailable(ConnectionError):
    """The engine cannot answer: its channel broke with requests in flight, or cannot be opened
    (the engine actor died, or closed its channel because its vLLM processes died)."""


def _frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> bytes:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > limit:
        raise ValueError(f"frame of {length} bytes (limit {limit})")
    return await reader.readexactly(length)


Generate = Callable[[list[int], SamplingSpec, str], Awaitable[GenerationResult]]


class ChannelServer:
    """The engine's side: answers every request with `generate(prompt_token_ids, sampling,
    request_id)`, concurrently; a request that raises gets an error reply, not a closed channel."""

    def __init__(self, generate: Generate, name: str):
        self._generate = generate
        self._name = name
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> ChannelAddress:
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelAddress(host, port, self._token)

    def close(self) -> None:
        """Stop listening and drop every connection: the requests in flight fail at their callers."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        requests: set[asyncio.Task] = set()
        self._connections.add(writer)
        try:
            token = await asyncio.wait_for(_read_frame(reader, MAX_TOKEN_FRAME_BYTES), AUTH_TIMEOUT_S)
            if not hmac.compare_digest(token, self._token.encode()):
                logger.warning("%s: refused a channel connection from %s (wrong token)", self._name, peer)
                return
            while True:
                request = _decode_request(await _read_frame(reader))
                task = asyncio.create_task(self._answer(request, writer))
                requests.add(task)
                task.add_done_callback(requests.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker closed the connection (or went away)
        except (asyncio.TimeoutError, ValueError, msgspec.DecodeError) as e:
            logger.warning("%s: dropped the channel connection from %s: %s", self._name, peer, e)
        finally:
            for task in requests:  # nobody is waiting for them: cancelling aborts them in vLLM
                task.cancel()
            self._connections.discard(writer)
            writer.close()

    async def _answer(self, request: _Request, writer: asyncio.StreamWriter) -> None:
        try:
            reply = _Reply(request.request_id, await self._generate(
                request.prompt_token_ids, request.sampling, request.request_id))
        except Exception as e:  # one failed request, reported to its caller
            reply = _Reply(request.request_id, None, f"{type(e).__name__}: {e}")
        if not writer.is_closing():
            writer.write(_frame(_encode(reply)))


class EngineChannel:
    """A worker's side of one engine's channel: one connection (opened on first use, and again
    after it breaks), many requests in flight, each answered as soon as it finishes."""

    def __init__(self, open_channel: Callable[[], Awaitable[ChannelAddress]], name: str):
        self._open_channel = open_channel  # asks the engine (through Ray) for its address
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.Task | None = None
        self._connecting: asyncio.Lock | None = None
        self._pending: dict[str, asyncio.Future] = {}

    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                       request_id: str) -> GenerationResult:
        if request_id in self._pending:
            raise ValueError(f"{self.name}: request id {request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # first use, or a new event loop (each asyncio.run in a script)
            self._loop, self._writer, self._connecting = loop, None, asyncio.Lock()
        writer = await self._connected()
        result = loop.create_future()
        self._pending[request_id] = result
        try:
            writer.write(_frame(_encode(_Request(request_id, list(prompt_token_ids), sampling))))
            return await result
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    async def _connected(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                try:
                    address = await self._open_channel()
                    reader, writer = await asyncio.open_connection(address.host, address.port)
                except Exception as e:  # a dead actor (Ray's error), a refused connection
                    raise EngineUnavailable(f"{self.name}: cannot open its request channel: "
                                            f"{type(e).__name__}: {e}") from e
                writer.write(_frame(address.token.encode()))
                self._writer = writer
                self._reader = asyncio.get_running_loop().create_task(self._read_replies(reader, writer))
            return self._writer

    async def _read_replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        reason: BaseException | str = "closed by the engine"
        try:
            while True:
                reply = _decode_reply(await _read_frame(reader))
                waiting = self._pending.get(reply.request_id)
                if waiting is None or waiting.done():
                    continue  # its caller gave up
                if reply.result is not None:
                    waiting.set_result(reply.result)
                else:
                    waiting.set_exception(RuntimeError(f"{self.name}: {reply.error}"))
        except asyncio.IncompleteReadError:
            pass
        except Exception as e:  # a broken connection or a frame that is not ours
            reason = e
        finally:
            writer.close()
            if self._writer is writer:
                self._writer = None  # the next request reconnects
            for waiting in self._pending.values():
                if not waiting.done():
                    waiting.set_exception(EngineUnavailable(f"{self.name}'s request channel broke ({reason}) "
                                                          "with this request in flight"))

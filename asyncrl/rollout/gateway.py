"""The inference gateway: engines behind one routed interface, optionally over HTTP.

`agenerate` sends each request to an engine chosen by `pick()` and hides weight syncs:
a request aborted by `pause("abort")` waits until generation may resume, then continues
from prompt + tokens so far with what is left of its budget (ending at a stop string the
pause split: asyncrl/inference/stops.py), and the segments are joined (each token keeps the
policy version that produced it).

`serve()` exposes the same as an OpenAI-compatible `POST /v1/completions` on loopback
(prompt as token ids or text; `token_ids`, `logprobs.token_logprobs` and asyncrl's
`versions` in each choice), guarded by a random bearer key. Env-server agents generate
through it during training; `endpoint` is what a remote agent hands them. It is served as the
env server is (asyncrl/agents/http_guard.py: `guarded`, `uvicorn_config`): the key checked from the
headers before any of the body is read, bodies of at most `GATEWAY_LIMITS.max_request_bytes`
within its read deadline, strict JSON, and the env server's connection budget.

With `chat` settings it serves chat completions too (asyncrl/rollout/chat_sessions.py): `POST
/v1/chat/completions` (the gateway's key; a turn of no session) and, per episode of an agent that
is a program of its own, `POST /sessions/<id>/v1/chat/completions` and `POST /sessions/<id>/reward`
with that session's key, which reaches no other path.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from asyncrl.agents.http_guard import ServerLimits, guarded, uvicorn_config
from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.inference.stops import cut_at_split_stop
from asyncrl.rollout.chat_sessions import ChatRefusal, ChatSessions, ChatSettings, parse_body
from asyncrl.types import GenerationResult, SamplingSpec

# The env server's limits, but: for bodies, a prompt of engine.max_model_len (up to 2**20) token ids
# as JSON takes up to 8 bytes a token; every new connection may come from one address (on loopback
# all clients are 127.0.0.1, and an agent program opening 256 episodes' connections at once must not
# have half of them closed before their keys are read); and idle connections are kept longer than
# the clients' pools keep theirs (httpx, and so the openai SDK: 5 s), so that the server never
# closes one that a client is reusing at that moment (a "Connection error" of an agent's request).
GATEWAY_LIMITS = ServerLimits(max_request_bytes=8 << 20, max_unauthenticated_per_peer=256, keep_alive_s=30.0)


class CompletionBody(BaseModel):
    """The part of an OpenAI completions request the gateway honours (other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    prompt: list[int] | str
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: list[str] | str | None = None
    # vLLM's extension: tokens that end the generation (kept in it)
    stop_token_ids: list[NonNegativeInt] | None = Field(None, max_length=64)
    ignore_eos: bool = False


class InferenceGateway(InferenceInterface):
    def __init__(self, pick: Callable[[], InferenceInterface], tokenizer: Any,
                 resumed: Callable[[], Awaitable[None]] | None = None, model_name: str = "asyncrl",
                 chat: ChatSettings | None = None, count: Callable[[str, str], None] | None = None):
        """`chat`: serve chat completions and sessions with these settings (None: completions only);
        `count`: counts an episode's failures and refused chat requests by code."""
        self.pick = pick
        self.tokenizer = tokenizer
        self.resumed = resumed  # waits until a sync is over (abort mode); None: retry at once
        self.model_name = model_name
        self.endpoint: Endpoint | None = None
        self._server: Any = None
        self._task: asyncio.Task | None = None
        self._api_key = secrets.token_urlsafe(24)
        self.sessions = None if chat is None else ChatSessions(self.agenerate, tokenizer, chat, self.serve,
                                                                self._api_key, count)

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        engine = self.pick()
        out = GenerationResult([], [], [], "abort")
        for attempt in range(1000):
            left = sampling.max_new_tokens - len(out.token_ids)
            forwarded = list(prompt_token_ids) + out.token_ids
            part = await engine.agenerate(forwarded, replace(sampling, max_new_tokens=left), f"{request_id}.{attempt}")
            part = cut_at_split_stop(out.token_ids, part, sampling.stop, self.tokenizer, len(forwarded))
            routes = part.routes if out.routes is None else out.routes.extended(part.routes)
            out = GenerationResult(out.token_ids + part.token_ids, out.logprobs + part.logprobs,
                                   out.versions + part.versions, part.finish_reason, routes)
            if not part.interrupted:
                return out
            if len(out.token_ids) >= sampling.max_new_tokens:
                return replace(out, finish_reason="length")
            if self.resumed is not None:
                await self.resumed()
            else:
                await asyncio.sleep(0.01)
        raise RuntimeError(f"request {request_id}: aborted 1000 times in a row")

    # -- HTTP ------------------------------------------------------------------------------

    async def serve(self, host: str = "127.0.0.1") -> Endpoint:
        """Start serving on a free port of `host` (once); returns the endpoint."""
        if self.endpoint is not None:
            return self.endpoint
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        app = guarded(self._app(), self._api_key, GATEWAY_LIMITS, scoped="sessions")
        self._server = uvicorn.Server(uvicorn_config(app, host, 0, GATEWAY_LIMITS, log_level="warning"))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        self.endpoint = Endpoint(f"http://{host}:{sock.getsockname()[1]}/v1", self.model_name, self._api_key)
        return self.endpoint

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server, self.endpoint = None, None

    def _app(self) -> FastAPI:
        app = FastAPI(title="asyncrl inference gateway")

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request) -> dict[str, Any]:
            ids = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
            stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
            spec = SamplingSpec(max_new_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                                stop=stop, stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos)
            rid = request.headers.get("x-request-id") or secrets.token_hex(8)
            out = await self.agenerate(ids, spec, f"gw-{rid}")
            return {"object": "text_completion", "model": self.model_name, "choices": [{
                "index": 0, "text": self.tokenizer.decode(out.token_ids), "token_ids": out.token_ids,
                "prompt_token_ids": ids, "logprobs": {"token_logprobs": out.logprobs},
                "versions": out.versions, "finish_reason": out.finish_reason,
                **({"routes": out.routes.to_dict()} if out.routes is not None else {})}]}

        if self.sessions is None:
            return app
        sessions = self.sessions

        async def chat(session_id: str | None, request: Request) -> Response:
            try:
                body = parse_body(await request.json() if await request.body() else None)
                answer = await sessions.complete(session_id, body)
            except ChatRefusal as refusal:
                sessions.refused(session_id, refusal)
                return JSONResponse(refusal.body(), status_code=refusal.status)
            if body.stream:
                usage = bool((body.stream_options or {}).get("include_usage"))
                return StreamingResponse(_sse(answer, usage), media_type="text/event-stream")
            return JSONResponse(answer)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await chat(None, request)

        @app.post("/sessions/{session_id}/v1/chat/completions")
        async def session_chat_completions(session_id: str, request: Request) -> Response:
            return await chat(session_id, request)

        @app.post("/sessions/{session_id}/reward")
        async def session_reward(session_id: str, request: Request) -> Response:
            try:
                sessions.post_reward(session_id, await request.json() if await request.body() else None)
            except ChatRefusal as refusal:
                sessions.refused(session_id, refusal)
                return JSONResponse(refusal.body(), status_code=refusal.status)
            return JSONResponse({"ok": True})

        return app


def _sse(answer: dict[str, Any], usage: bool) -> Any:
    """A chat completion as OpenAI's stream: the whole message in one delta once generated, then the
    finish reason (and the usage, when asked): what the SDKs' stream readers assemble."""
    head = {k: answer[k] for k in ("id", "created", "model")}
    choice = answer["choices"][0]
    message = dict(choice["message"])
    if "tool_calls" in message:
        message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    chunks = [{"choices": [{"index": 0, "delta": message, "logprobs": choice["logprobs"], "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]
    if usage:
        chunks.append({"choices": [], "usage": answer["usage"]})

    async def stream() -> Any:
        for chunk in chunks:
            yield f"data: {json.dumps({**head, 'object': 'chat.completion.chunk', **chunk})}\n\n"
        yield "data: [DONE]\n\n"

    return stream()

"""The inference interface over any OpenAI-compatible completions endpoint.

Used by the env server (its agents generate through the rollout worker's gateway during
training) and by `asyncrl eval eval.endpoint=...` (e.g. a `vllm serve` process). Prompts
go as token ids; vLLM and the asyncrl gateway return the sampled token ids
(`return_token_ids`), their logprobs and, the gateway only, each token's policy version (and,
for an MoE model, each position's routed experts).
An endpoint that returns only text is re-tokenized (fine for evaluation, never for
training: `returns_token_ids` is then False).

The endpoint is not trusted with what it may make the caller say or hold: a reply is read up
to MAX_REPLY_BYTES, must have the shape of a completion (checked by type, without quoting it)
and at most `max_new_tokens` token ids; a failure names the endpoint and the status code,
never the body it answered (the env server passes these errors to its clients; the body goes
to this process's log only). Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import httpx
import msgspec

from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.types import GenerationResult, RoutedExperts, SamplingSpec

logger = logging.getLogger(__name__)

MAX_REPLY_BYTES = 32 * 2**20


class _Logprobs(msgspec.Struct):
    token_logprobs: list[float] | None = None


class _Routes(msgspec.Struct):
    data: str  # base64 of uint8 [positions, layers, top_k] (RoutedExperts.to_dict)
    layers: int
    top_k: int


class _Choice(msgspec.Struct):
    text: str = ""
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    versions: list[int] | None = None
    finish_reason: str | None = None
    routes: _Routes | None = None


class _Completion(msgspec.Struct):
    choices: list[_Choice]


class OpenAIInference(InferenceInterface):
    def __init__(self, endpoint: Endpoint, tokenizer: Any = None, timeout_s: float = 600.0,
                 slots: asyncio.Semaphore | None = None):
        self.endpoint = endpoint
        self.tokenizer = tokenizer  # for endpoints that return text only
        self.timeout_s = timeout_s
        self._slots = slots  # bounds the requests in flight (the env server shares one across requests)
        self._clients: dict[int, httpx.AsyncClient] = {}  # one per event loop (`generate` runs its own)

    def _client(self) -> httpx.AsyncClient:
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
            self._clients[loop] = httpx.AsyncClient(base_url=self.endpoint.base_url.rstrip("/"), headers=headers,
                                                    timeout=self.timeout_s, follow_redirects=False)
        return self._clients[loop]

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        body = {"model": self.endpoint.model, "prompt": list(prompt_token_ids), "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": sampling.ignore_eos,
                **({"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {})}
        where = f"{self.endpoint.base_url}/completions"
        async with self._slots or contextlib.nullcontext():
            async with self._client().stream("POST", "/completions", json=body,
                                             headers={"X-Request-Id": request_id}) as response:
                if response.status_code != 200:
                    logger.warning("%s answered %d: %r", where, response.status_code, await read_head(response, 500))
                    raise RuntimeError(f"{where} answered {response.status_code}")
                raw = await read_head(response, MAX_REPLY_BYTES + 1)
        if len(raw) > MAX_REPLY_BYTES:
            raise RuntimeError(f"{where} answered more than {MAX_REPLY_BYTES} bytes")
        try:
            choice = msgspec.convert(json.loads(raw), _Completion).choices[0]
        except (ValueError, RecursionError, IndexError, msgspec.ValidationError) as e:  # says where, not what
            reason = "no choices" if isinstance(e, IndexError) else type(e).__name__
            raise RuntimeError(f"{where} answered 200 with a reply that is not a completion ({reason})") from None
        ids = choice.token_ids
        if ids is None:
            if self.tokenizer is None:
                raise RuntimeError(f"{self.endpoint.base_url} returns no token ids; give a tokenizer to re-tokenize")
            self.returns_token_ids = False
            ids = self.tokenizer.encode(choice.text, add_special_tokens=False)
        elif len(ids) > sampling.max_new_tokens:
            raise RuntimeError(f"{where} answered {len(ids)} token ids for max_tokens={sampling.max_new_tokens}")
        lps = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        if lps is None or len(lps) != len(ids):
            self.returns_logprobs = False
            lps = [0.0] * len(ids)
        versions = choice.versions if choice.versions is not None and len(choice.versions) == len(ids) \
            else [-1] * len(ids)
        routes = None
        if choice.routes is not None:  # the gateway, for an MoE model: each position's experts
            try:
                routes = RoutedExperts.from_dict(msgspec.structs.asdict(choice.routes))
                if routes.positions * routes.layers * routes.top_k != len(routes.data):
                    raise ValueError("its length is not positions x layers x top_k")
            except ValueError as e:
                raise RuntimeError(f"{where} answered routes that do not decode ({e})") from None
        return GenerationResult(list(ids), list(lps), list(versions), choice.finish_reason or "stop", routes)

    async def aclose(self) -> None:
        client = self._clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()


async def read_head(response: httpx.Response, limit: int) -> bytes:
    """The first `limit` bytes of the response's body (the rest is not read)."""
    out = bytearray()
    async for chunk in response.aiter_bytes():
        out += chunk
        if len(out) >= limit:
            break
    return bytes(out[:limit])

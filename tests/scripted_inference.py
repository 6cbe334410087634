"""A scripted engine behind the inference interface: agent loops and rollout workers
tested in milliseconds, without vLLM or Ray.

    engine = ScriptedInference([Reply("<tool:calc", "abort"), Reply("ulator>1+1</tool>", version=1)],
                               tokenizer)

Each request takes the next reply of the script (a list, used in order) or asks the
script (a function of the `Request`; it may raise, as a dead engine would). A reply's
tokens are cut to the request's max_new_tokens (finish "length"), as an engine cuts
them. A reply with `hold` answers only once the test sets that event, so a test can
act while the request is in flight (set a worker's interrupt, then let the request end
with "abort" as `pause("abort")` ends it). Every request is kept in `requests`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.inference.protocol import InferenceInterface
from asyncrl.types import GenerationResult, SamplingSpec

DEFAULT_LOGPROB = -0.5


@dataclass
class Request:
    """What the engine was asked."""

    prompt_token_ids: list[int]
    sampling: SamplingSpec
    request_id: str

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens


@dataclass
class Reply:
    """One scripted answer."""

    tokens: list[int] | str  # token ids, or text the engine encodes (no special tokens)
    finish_reason: str = "stop"  # "stop", "length" or "abort"
    version: int | list[int] = 0  # the policy version of every token, or of each
    logprobs: list[float] | None = None  # None: DEFAULT_LOGPROB for each token
    hold: asyncio.Event | None = None  # answer only once this is set


class ScriptedInference(InferenceInterface):
    def __init__(self, script: list[Reply] | Callable[[Request], Reply], tokenizer: Any = None):
        self.script = script if callable(script) else list(script)
        self.tokenizer = tokenizer
        self.requests: list[Request] = []

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        request = Request(list(prompt_token_ids), sampling, request_id)
        self.requests.append(request)
        if callable(self.script):
            reply = self.script(request)
        else:
            assert self.script, f"the script has no reply left for request {len(self.requests)} ({request_id})"
            reply = self.script.pop(0)
        if reply.hold is not None:
            await reply.hold.wait()
        return self._result(reply, sampling.max_new_tokens)

    def _result(self, reply: Reply, max_new_tokens: int) -> GenerationResult:
        ids = self.encode(reply.tokens)
        versions = [reply.version] * len(ids) if isinstance(reply.version, int) else list(reply.version)
        logprobs = list(reply.logprobs) if reply.logprobs is not None else [DEFAULT_LOGPROB] * len(ids)
        assert len(versions) == len(logprobs) == len(ids), "a reply needs one version and logprob per token"
        if len(ids) > max_new_tokens:  # the engine stops at the request's budget
            n = max_new_tokens
            return GenerationResult(ids[:n], logprobs[:n], versions[:n], "length")
        return GenerationResult(ids, logprobs, versions, reply.finish_reason)

    def encode(self, tokens: list[int] | str) -> list[int]:
        if isinstance(tokens, str):
            assert self.tokenizer is not None, "a text reply needs ScriptedInference(..., tokenizer)"
            return self.tokenizer.encode(tokens, add_special_tokens=False)
        return list(tokens)

    async def wait_for_requests(self, n: int, timeout_s: float = 5.0) -> None:
        """Return once `n` requests have arrived (AssertionError after `timeout_s`)."""
        async def arrived() -> None:
            while len(self.requests) < n:
                await asyncio.sleep(0.001)

        try:
            await asyncio.wait_for(arrived(), timeout_s)
        except asyncio.TimeoutError:
            raise AssertionError(f"{len(self.requests)} requests arrived in {timeout_s:g}s, not {n}") from None

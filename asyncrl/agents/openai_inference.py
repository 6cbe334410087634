"""The inference interface over any OpenAI-compatible completions endpoint.

Used by the env server (its agents generate through the rollout worker's gateway during
training) and by `asyncrl eval eval.endpoint=...` (e.g. a `vllm serve` process). Prompts
go as token ids; vLLM and the asyncrl gateway return the sampled token ids
(`return_token_ids`), their logprobs and, the gateway only, each token's policy version.
An endpoint that returns only text is re-tokenized (fine for evaluation, never for
training: `returns_token_ids` is then False).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from asyncrl.inference.protocol import Endpoint, InferenceInterface
from asyncrl.types import GenerationResult, SamplingSpec


class OpenAIInference(InferenceInterface):
    def __init__(self, endpoint: Endpoint, tokenizer: Any = None, timeout_s: float = 600.0):
        self.endpoint = endpoint
        self.tokenizer = tokenizer  # for endpoints that return text only
        self.timeout_s = timeout_s
        self._clients: dict[int, httpx.AsyncClient] = {}  # one per event loop (`generate` runs its own)

    def _client(self) -> httpx.AsyncClient:
        loop = id(asyncio.get_running_loop())
        if loop not in self._clients:
            headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
            self._clients[loop] = httpx.AsyncClient(base_url=self.endpoint.base_url.rstrip("/"), headers=headers,
                                                    timeout=self.timeout_s)
        return self._clients[loop]

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        body = {"model": self.endpoint.model, "prompt": list(prompt_token_ids), "max_tokens": sampling.max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "logprobs": 0,
                "return_token_ids": True, "ignore_eos": sampling.ignore_eos,
                **({"stop": list(sampling.stop), "include_stop_str_in_output": True} if sampling.stop else {})}
        response = await self._client().post("/completions", json=body, headers={"X-Request-Id": request_id})
        if response.status_code != 200:
            raise RuntimeError(f"{self.endpoint.base_url}/completions answered {response.status_code}: "
                               f"{response.text[:500]}")
        choice = response.json()["choices"][0]
        ids = choice.get("token_ids")
        if ids is None:
            if self.tokenizer is None:
                raise RuntimeError(f"{self.endpoint.base_url} returns no token ids; give a tokenizer to re-tokenize")
            self.returns_token_ids = False
            ids = self.tokenizer.encode(choice.get("text", ""), add_special_tokens=False)
        lps = (choice.get("logprobs") or {}).get("token_logprobs")
        if lps is None or len(lps) != len(ids):
            self.returns_logprobs = False
            lps = [0.0] * len(ids)
        versions = choice.get("versions") or [-1] * len(ids)
        return GenerationResult(list(ids), [float(x) for x in lps], list(versions),
                                choice.get("finish_reason") or "stop")

    async def aclose(self) -> None:
        client = self._clients.pop(id(asyncio.get_running_loop()), None)
        if client is not None:
            await client.aclose()

"""The inference interface agents and agent loops generate through.

Token in, token out: a prompt is token ids; the result carries every sampled token with
its logprob and the policy version that produced it (`GenerationResult`). Agent loops
depend on this, not on `EngineActor`. Implementations:
  - `StickyEngineClient` (asyncrl/rollout/router.py): one EngineActor over its request channel
    (asyncrl/inference/channel.py), in training;
  - `OpenAIInference` (asyncrl/agents/openai_inference.py): any OpenAI-compatible completions
    endpoint over HTTP (`vllm serve`, or a rollout worker's inference gateway).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass

from asyncrl.types import GenerationResult, SamplingSpec


@dataclass
class Endpoint:
    """Where an OpenAI-compatible completions server is and how to call it; plain data
    (a remote agent sends it to the env server)."""

    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str = ""
    api_key: str = ""


class InferenceInterface(ABC):
    # Capabilities: whether results carry the engine's own token ids and per-token logprobs
    # (training needs both; evaluation needs neither).
    returns_token_ids: bool = True
    returns_logprobs: bool = True

    @abstractmethod
    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                        request_id: str) -> GenerationResult:
        """Generate a continuation of `prompt_token_ids`."""

    def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        """`agenerate` for synchronous callers (not from inside a running event loop)."""
        return asyncio.run(self.agenerate(prompt_token_ids, sampling, request_id))

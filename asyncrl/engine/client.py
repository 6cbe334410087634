"""The engine-client protocol agent loops generate through.

Agent loops depend on this, not on `EngineActor`: in training it is a Ray handle
bound to one engine by the rollout worker's router; in tests it can be anything that
generates tokens.
"""

from __future__ import annotations

from typing import Protocol

from asyncrl.types import GenerationResult, SamplingSpec


class EngineClient(Protocol):
    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                       request_id: str) -> GenerationResult: ...

"""Routing generation requests from one rollout worker to the engines.

A new trajectory goes to the engine with the fewest requests outstanding from this
worker (ties: the one used least so far); a live trajectory then sticks to its engine,
whose prefix cache holds its prompt and response so far. A resumed snapshot is routed
afresh: snapshots are engine-independent.
"""

from __future__ import annotations

from typing import Any

from asyncrl.inference.channel import EngineChannel
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.types import GenerationResult, SamplingSpec


class EngineRouter:
    def __init__(self, engines: list[Any]):
        """`engines`: Ray actor handles of EngineActors."""
        if not engines:
            raise ValueError("a rollout worker needs at least one engine")
        self.engines = engines
        # Generation goes over each engine's request channel, not a Ray call a request.
        self.channels = [EngineChannel(lambda e=engine: e.open_channel.remote(), f"engine-{i}")
                         for i, engine in enumerate(engines)]
        self.outstanding = [0] * len(engines)
        self.assigned = [0] * len(engines)

    def pick(self) -> int:
        i = min(range(len(self.engines)), key=lambda k: (self.outstanding[k], self.assigned[k]))
        self.assigned[i] += 1
        return i

    def client(self) -> StickyEngineClient:
        """An engine client bound to one engine for the life of one trajectory."""
        return StickyEngineClient(self, self.pick())


class StickyEngineClient(InferenceInterface):
    """The inference interface over one engine's request channel, counting outstanding requests."""

    def __init__(self, router: EngineRouter, index: int):
        self.router = router
        self.index = index

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        self.router.outstanding[self.index] += 1
        try:
            return await self.router.channels[self.index].generate(prompt_token_ids, sampling, request_id)
        finally:
            self.router.outstanding[self.index] -= 1

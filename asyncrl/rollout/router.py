"""Routing generation requests from one rollout worker to the engines.

A new trajectory goes to the live engine with the fewest requests outstanding from this
worker (ties: the one used least so far); a live trajectory then sticks to its engine,
whose prefix cache holds its prompt and response so far. A resumed snapshot is routed
afresh: snapshots are engine-independent.

An engine that cannot answer (its channel broke or cannot be opened: the actor or its vLLM
processes died) is marked failed: its requests in flight end as aborted with no tokens, so
their loops leave snapshots holding everything generated before, and nothing more is routed
to it until the driver hands the worker a replacement (`replace`). With every engine failed,
requests wait for one. An engine removed from the run (`retire`) is routed around the same way;
an added one gets a new slot (`replace` at the end).
"""

from __future__ import annotations

import asyncio
import logging

from asyncrl.inference.channel import EngineChannel, EngineUnavailable
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.interfaces import EngineHandle
from asyncrl.types import GenerationResult, SamplingSpec

logger = logging.getLogger(__name__)


class EngineRouter:
    def __init__(self, engines: list[EngineHandle | None]):
        """`engines`: None in a slot whose engine was removed (its channel fails to open: routed around)."""
        if not engines:
            raise ValueError("a rollout worker needs at least one engine")
        self.engines = list(engines)
        # Generation goes over each engine's request channel, not a Ray call a request.
        self.channels = [self._channel(i, engine) for i, engine in enumerate(engines)]
        self.outstanding = [0] * len(engines)
        self.assigned = [0] * len(engines)
        self.failed: dict[int, str] = {}  # engine index -> why it was marked failed
        self.failovers = 0  # requests that ended because their engine failed
        self.newest_version = -1  # the newest policy version any engine's answer carried
        self._any_live = asyncio.Event()
        self._any_live.set()

    @staticmethod
    def _channel(i: int, engine: EngineHandle | None) -> EngineChannel:
        return EngineChannel(lambda e=engine: e.open_channel.remote(), f"engine-{i}")

    def pick(self) -> int:
        live = [k for k in range(len(self.engines)) if k not in self.failed] or range(len(self.engines))
        i = min(live, key=lambda k: (self.outstanding[k], self.assigned[k]))
        self.assigned[i] += 1
        return i

    def client(self) -> StickyEngineClient:
        """An engine client bound to one engine for the life of one trajectory."""
        return StickyEngineClient(self, self.pick())

    def mark_failed(self, index: int, reason: str) -> None:
        if index not in self.failed:
            logger.warning("engine-%d failed: %s; routing around it", index, reason)
            self.failed[index] = reason
        if len(self.failed) == len(self.engines):
            self._any_live.clear()

    def replace(self, index: int, engine: EngineHandle) -> None:
        """Route to `engine` in slot `index`: a replacement for a failed or removed engine, or a
        new slot at the end (an engine added to the run)."""
        if index == len(self.engines):
            self.engines.append(engine)
            self.channels.append(self._channel(index, engine))
            self.outstanding.append(0)
            self.assigned.append(0)
        else:
            self.channels[index].close()
            self.engines[index] = engine
            self.channels[index] = self._channel(index, engine)
        self.failed.pop(index, None)
        self._any_live.set()

    def retire(self, index: int) -> None:
        """Route nothing more to slot `index`: its engine is being removed (the driver aborts its
        requests next; their loops go on from their snapshots on the other engines)."""
        self.failed[index] = "removed from the run"
        if len(self.failed) == len(self.engines):
            self._any_live.clear()

    async def live_engine(self) -> int:
        """A live engine's index, once there is one."""
        await self._any_live.wait()
        return self.pick()


class StickyEngineClient(InferenceInterface):
    """The inference interface over one engine's request channel, counting outstanding requests.
    A request whose engine fails returns as aborted (no tokens): the loop snapshots and moves on."""

    def __init__(self, router: EngineRouter, index: int):
        self.router = router
        self.index = index

    async def agenerate(self, prompt_token_ids: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        router = self.router
        if self.index in router.failed:  # its engine failed since: a live one takes the rest
            self.index = await router.live_engine()
        index, channel = self.index, router.channels[self.index]
        router.outstanding[index] += 1
        try:
            result = await channel.generate(prompt_token_ids, sampling, request_id)
        except EngineUnavailable as e:
            if router.channels[index] is channel:  # not a replaced engine's old channel
                router.mark_failed(index, str(e))
            router.failovers += 1
            return GenerationResult([], [], [], "abort")
        finally:
            router.outstanding[index] -= 1
        if result.versions:  # a request's versions never decrease: its last is its newest
            router.newest_version = max(router.newest_version, result.versions[-1])
        return result

"""The request channel (asyncrl/inference/channel.py) and a worker's engine router over real
loopback TCP. The engine's side answers with a small generate function here;
tests/test_agents_vllm.py, test_engine_vllm.py and
the training runs send every agent loop's requests through it to real vLLM engines."""

import asyncio
from types import SimpleNamespace

import pytest

from asyncrl.inference.channel import ChannelAddress, ChannelServer, EngineChannel
from asyncrl.rollout.router import EngineRouter
from asyncrl.types import GenerationResult, SamplingSpec

SAMPLING = SamplingSpec(max_new_tokens=4, temperature=0.5, top_p=0.9, stop=["\n"], ignore_eos=True)


class Engine:
    """Answers a prompt with its tokens + 1 after `prompt[0]` milliseconds (so replies come
    back out of order); fails a prompt starting with -1; records what it was sent."""

    def __init__(self):
        self.received: list[tuple[list[int], SamplingSpec, str]] = []
        self.cancelled: list[str] = []
        self.release = asyncio.Event()

    async def generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        self.received.append((prompt, sampling, request_id))
        if prompt[0] == -1:
            raise ValueError(f"bad prompt in {request_id}")
        try:
            if prompt[0] == -2:  # waits until released
                await self.release.wait()
            await asyncio.sleep(prompt[0] / 1000)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        return GenerationResult([t + 1 for t in prompt], [-0.5] * len(prompt), [7] * len(prompt), "length")


async def _serve(engine: Engine) -> tuple[ChannelServer, ChannelAddress]:
    server = ChannelServer(engine.generate, "engine-0")
    return server, await server.start("127.0.0.1")


def test_concurrent_requests_each_get_their_own_result():
    async def main():
        engine = Engine()
        server, address = await _serve(engine)
        opened = []

        async def open_channel():
            opened.append(1)
            return address

        channel = EngineChannel(open_channel, "engine-0")
        prompts = [[delay, i] for i, delay in enumerate([30, 1, 20, 5, 10] * 8)]
        results = await asyncio.gather(*[channel.generate(p, SAMPLING, f"r{i}") for i, p in enumerate(prompts)])
        assert [r.token_ids for r in results] == [[a + 1, b + 1] for a, b in prompts]
        assert all(r.logprobs == [-0.5, -0.5] and r.versions == [7, 7] and r.finish_reason == "length"
                   for r in results)
        assert engine.received[0][1] == SAMPLING  # the sampling settings arrive whole
        assert len(opened) == 1  # one connection for all of them
        channel.close()
        server.close()

    asyncio.run(main())


def test_a_failing_request_raises_at_its_caller_only():
    async def main():
        engine = Engine()
        server, address = await _serve(engine)
        channel = EngineChannel(lambda: asyncio.sleep(0, address), "engine-0")
        ok, bad = await asyncio.gather(channel.generate([3, 1], SAMPLING, "ok"),
                                       channel.generate([-1, 1], SAMPLING, "bad"), return_exceptions=True)
        assert ok.token_ids == [4, 2]
        assert isinstance(bad, RuntimeError) and str(bad) == "engine-0: ValueError: bad prompt in bad"
        assert (await channel.generate([1], SAMPLING, "after")).token_ids == [2]  # still open
        with pytest.raises(ValueError, match="already in flight"):
            await asyncio.gather(channel.generate([5], SAMPLING, "same"), channel.generate([5], SAMPLING, "same"))
        channel.close()
        server.close()

    asyncio.run(main())


def test_a_wrong_token_is_refused():
    async def main():
        engine = Engine()
        server, address = await _serve(engine)
        forged = ChannelAddress(address.host, address.port, "0" * len(address.token))
        channel = EngineChannel(lambda: asyncio.sleep(0, forged), "engine-0")
        with pytest.raises(ConnectionError, match="engine-0's request channel broke"):
            await asyncio.wait_for(channel.generate([1], SAMPLING, "r"), 5)
        assert engine.received == []
        server.close()

    asyncio.run(main())


def test_an_engine_that_goes_away_fails_requests_in_flight_and_a_new_one_is_reached():
    async def main():
        first, second = Engine(), Engine()
        server, address = await _serve(first)
        addresses = [address]
        channel = EngineChannel(lambda: asyncio.sleep(0, addresses[-1]), "engine-0")
        waiting = asyncio.create_task(channel.generate([-2], SAMPLING, "stuck"))
        while not first.received:
            await asyncio.sleep(0.01)
        server.close()
        with pytest.raises(ConnectionError, match="with this request in flight"):
            await asyncio.wait_for(waiting, 5)
        server2, address2 = await _serve(second)  # e.g. the engine restarted elsewhere
        addresses.append(address2)
        assert (await channel.generate([1], SAMPLING, "again")).token_ids == [2]
        assert [r[2] for r in second.received] == ["again"]
        channel.close()
        server2.close()

    asyncio.run(main())


def test_a_worker_that_goes_away_cancels_its_requests_in_the_engine():
    async def main():
        engine = Engine()
        server, address = await _serve(engine)
        channel = EngineChannel(lambda: asyncio.sleep(0, address), "engine-0")
        waiting = asyncio.create_task(channel.generate([-2], SAMPLING, "orphan"))
        while not engine.received:
            await asyncio.sleep(0.01)
        channel.close()
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 5)
        for _ in range(100):
            if engine.cancelled:
                break
            await asyncio.sleep(0.01)
        assert engine.cancelled == ["orphan"]  # the engine does not generate for nobody
        server.close()

    asyncio.run(main())


def test_one_channel_serves_one_event_loop_after_another():
    """A script may call asyncio.run more than once with the same client (as the tests do)."""
    import threading

    ready = threading.Event()
    engine: dict = {}

    def engine_thread():  # the engine's loop outlives each of the client's loops
        async def main():
            engine["loop"], engine["stop"] = asyncio.get_running_loop(), asyncio.Event()
            server, engine["address"] = await _serve(Engine())
            ready.set()
            await engine["stop"].wait()
            server.close()

        asyncio.run(main())

    thread = threading.Thread(target=engine_thread)
    thread.start()
    assert ready.wait(10)
    channel = EngineChannel(lambda: asyncio.sleep(0, engine["address"]), "engine-0")
    for i in range(2):
        assert asyncio.run(channel.generate([1, i], SAMPLING, f"run{i}")).token_ids == [2, i + 1]
    engine["loop"].call_soon_threadsafe(engine["stop"].set)
    thread.join(10)


class Handle:
    """Stands in for an EngineActor's Ray handle: `open_channel.remote()` gives the address."""

    def __init__(self, address: ChannelAddress):
        self.open_channel = SimpleNamespace(remote=lambda: asyncio.sleep(0, address))


def test_the_router_moves_requests_off_an_engine_that_fails_and_takes_its_replacement():
    """A request in flight on an engine that goes away returns as aborted with no tokens (its
    loop snapshots and continues); nothing more is routed there; with every engine failed a
    request waits for the driver's replacement."""
    async def main():
        engines = [Engine(), Engine()]
        served = [await _serve(e) for e in engines]
        router = EngineRouter([Handle(address) for _, address in served])
        stuck = router.client()
        assert stuck.index == 0
        waiting = asyncio.create_task(stuck.agenerate([-2], SAMPLING, "stuck"))
        while not engines[0].received:
            await asyncio.sleep(0.01)
        served[0][0].close()  # engine-0 dies with the request in flight
        result = await asyncio.wait_for(waiting, 5)
        assert (result.token_ids, result.finish_reason) == ([], "abort") and result.interrupted
        assert list(router.failed) == [0] and router.failovers == 1
        assert [router.client().index for _ in range(3)] == [1, 1, 1]  # routed around it
        assert (await stuck.agenerate([1], SAMPLING, "moved")).token_ids == [2]  # its client moves too
        assert stuck.index == 1 and engines[1].received[-1][2] == "moved"

        served[1][0].close()  # now every engine is gone: requests wait for a replacement
        assert (await router.client().agenerate([1], SAMPLING, "lost")).interrupted
        pending = asyncio.create_task(router.client().agenerate([3], SAMPLING, "waits"))
        await asyncio.sleep(0.05)
        assert not pending.done()
        replacement = Engine()
        server, address = await _serve(replacement)
        router.replace(0, Handle(address))
        assert (await asyncio.wait_for(pending, 5)).token_ids == [4]
        assert [r[2] for r in replacement.received] == ["waits"] and 0 not in router.failed
        for channel in router.channels:
            channel.close()
        server.close()

    asyncio.run(main())

"""CPU cost of sending one generation request from a rollout worker to an engine: a Ray actor
call a request, against the engine's request channel (asyncrl/inference/channel.py).

Two Ray actors stand in for the worker and the engine; the engine answers every request
after 10 ms with a 64-token GenerationResult (no model: what is measured is the transport).
The worker keeps 64 requests in flight, like rollout.max_concurrent_loops. Both transports
alternate for `--rounds` rounds; printed last, one JSON line with the CPU milliseconds per
request in each process (medians over rounds).

    python scripts/request_cost.py --requests 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics

import ray

from asyncrl.inference.channel import ChannelAddress, ChannelServer, EngineChannel
from asyncrl.types import GenerationResult, SamplingSpec


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Engine:
    def __init__(self):
        self._server = ChannelServer(self.generate, "engine-0")

    async def generate(self, prompt: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        await asyncio.sleep(0.01)
        n = sampling.max_new_tokens
        return GenerationResult(list(range(n)), [-0.5] * n, [0] * n, "length")

    async def open_channel(self) -> ChannelAddress:
        return await self._server.start("127.0.0.1")

    def cpu_s(self) -> float:
        return _cpu_s()


class Worker:
    def __init__(self, engine):
        self.engine = engine
        self.channel = EngineChannel(lambda: engine.open_channel.remote(), "engine-0")

    def cpu_s(self) -> float:
        return _cpu_s()

    async def run(self, transport: str, requests: int) -> None:
        slots, sampling = asyncio.Semaphore(64), SamplingSpec(max_new_tokens=64)

        async def one(i: int) -> GenerationResult:
            async with slots:
                prompt = list(range(20))
                if transport == "ray_call":
                    return await self.engine.generate.remote(prompt, sampling, f"r{i}")
                return await self.channel.generate(prompt, sampling, f"r{i}")

        results = await asyncio.gather(*[one(i) for i in range(requests)])
        assert all(len(r.token_ids) == 64 for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = ray.remote(Engine).options(max_concurrency=10_000).remote()
    worker = ray.remote(Worker).options(max_concurrency=1000).remote(engine)
    costs: dict[str, dict[str, list[float]]] = {t: {"engine": [], "worker": []} for t in ("ray_call", "channel")}
    for transport in costs:  # warm-up
        ray.get(worker.run.remote(transport, 256))
    for r in range(args.rounds):
        for transport, cost in costs.items():
            before = ray.get([engine.cpu_s.remote(), worker.cpu_s.remote()])
            ray.get(worker.run.remote(transport, args.requests))
            after = ray.get([engine.cpu_s.remote(), worker.cpu_s.remote()])
            for side, b, a in zip(("engine", "worker"), before, after):
                cost[side].append((a - b) / args.requests * 1000)
            print(f"round {r} {transport}: engine {cost['engine'][-1]:.3f}, worker {cost['worker'][-1]:.3f} "
                  "CPU ms a request", flush=True)
    ray.shutdown()
    summary = {f"{t}_{side}_ms": round(statistics.median(v), 3)
               for t, cost in costs.items() for side, v in cost.items()}
    total = {t: summary[f"{t}_engine_ms"] + summary[f"{t}_worker_ms"] for t in costs}
    print(json.dumps({"bench": "request_cost", **summary, "ray_call_ms": round(total["ray_call"], 3),
                      "channel_ms": round(total["channel"], 3),
                      "ratio": round(total["ray_call"] / total["channel"], 1), "requests": args.requests,
                      "rounds": args.rounds}))


if __name__ == "__main__":
    main()

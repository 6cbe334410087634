"""`asyncrl bench rollout`: what the rollout path costs on top of raw vLLM.

    asyncrl bench rollout recipe=arith                       # 64 prompts x 8 samples x 64 tokens
    asyncrl bench rollout recipe=arith bench.max_new_tokens=16 bench.ignore_eos=false

In one run, on the same engine configuration, the same prompts and sampling go through
  (a) raw vLLM: an `AsyncLLM` in this process, at most `rollout.max_concurrent_loops`
      requests in flight;
  (b) the full path: RolloutWorker (Ray actor) -> partial_single_turn loop ->
      EngineActor (Ray actor), with the same concurrency limit; the worker puts each
      finished group into the real MessageQueue (Ray actor), and the round ends when the
      last group has been taken out of it, as the trainer takes them.
Both engines stay up; `bench.rounds` rounds run (a) and (b) back to back, which one first
alternating from round to round, and the ratio is the median of the per-round ratios, so
machine noise hits both sides of a ratio alike. Each timed run starts `bench.settle_s`
after the previous one, once the idle engine's processes have stopped polling. Then, on
(b)'s engine, `pause` with `bench.pause_requests` requests in flight and `resume` are
timed `bench.rounds` times (the median is reported): in `abort` mode, and in `keep` mode
when `algorithm.pause_mode=keep` (only then does the engine stream per-token versions, and
(a) streams too). Engine start-up and `bench.warmup_rounds` untimed rounds are excluded.
The last line printed is one JSON object:
  {"bench": "rollout", "raw_tok_s", "framework_tok_s", "ratio", "pause_resume_s", ...}
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import ray

from asyncrl import actors
from asyncrl.bench.config import BenchConfig
from asyncrl.bench.in_flight import start_long_requests
from asyncrl.config import Config
from asyncrl.engine.pause import engines_stream
from asyncrl.engine.vllm_env import configure_vllm_env, vllm_engine_kwargs, vllm_sampling_params
from asyncrl.tasks import Problem, TaskSource
from asyncrl.types import SamplingSpec

TAKE_TIMEOUT_S = 600.0  # a round's groups not all in the queue by then: the framework path is stuck


def bench_sampling(cfg: Config, bench: BenchConfig) -> SamplingSpec:
    return SamplingSpec(max_new_tokens=bench.max_new_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, ignore_eos=bench.ignore_eos)


class RawVLLM:
    """(a): a bare AsyncLLM in this process, sent the request the EngineActor sends."""

    def __init__(self, cfg: Config, sampling: SamplingSpec, stream: bool):
        configure_vllm_env(cfg.engine, cfg.cluster.device)
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = vllm_engine_kwargs(cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device)
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs, disable_log_stats=True))
        self.params = vllm_sampling_params(sampling, stream)  # exactly the EngineActor's request
        self.concurrency = cfg.rollout.max_concurrent_loops

    async def run(self, tag: str, prompts: list[list[int]], n: int) -> int:
        """Tokens generated for n samples of each prompt, at most `concurrency` in flight."""
        from vllm.inputs import TokensPrompt

        slots = asyncio.Semaphore(self.concurrency)

        async def one(request_id: str, ids: list[int]) -> int:
            async with slots:
                tokens = 0
                async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids), self.params, request_id):
                    tokens += len(out.outputs[0].token_ids)
                return tokens

        jobs = [one(f"{tag}-{i}-{k}", ids) for i, ids in enumerate(prompts) for k in range(n)]
        return sum(await asyncio.gather(*jobs))

    def shutdown(self) -> None:
        self.llm.shutdown()
        # Drop it now: AsyncLLM.__del__ calls shutdown again, which fails at interpreter exit.
        del self.llm
        gc.collect()


class FrameworkPath:
    """(b): RolloutWorker (Ray actor) -> partial_single_turn -> EngineActor (Ray actor), and
    the finished groups through the MessageQueue (Ray actor)."""

    def __init__(self, cfg: Config, sampling: SamplingSpec, stream: bool, num_prompts: int):
        one = replace(cfg, engine=replace(cfg.engine, num_engines=1), rollout=replace(cfg.rollout, num_workers=1))
        (self.engine,) = actors.create_engines(one, stream=stream)
        self._started = self.engine.start.remote()  # `ready()` waits for it
        self.queue = actors.create_queue(one, capacity=num_prompts)
        (self.worker,) = actors.create_rollout_workers(one, [self.engine], self.queue, sampling=sampling)

    def ready(self) -> None:
        """Returns once its engine has started."""
        ray.get(self._started)

    async def run(self, problems: list[Problem], n: int) -> int:
        await self.worker.submit.remote(problems, n)
        try:
            groups = await self.queue.get.remote(len(problems), 0, TAKE_TIMEOUT_S)
        except Exception as e:
            stats = await self.worker.get_stats.remote()
            raise RuntimeError(f"framework path: {len(problems)} groups not queued ({e!r}); worker: {stats}") from e
        return sum(sum(t.loss_mask) for g in groups for t in g.trajectories)

    async def pause_resume_s(self, cfg: Config, bench: BenchConfig, prompt_ids: list[int],
                             mode: str, round_: int) -> tuple[float, int]:
        """Wall time of pause + resume with `bench.pause_requests` long requests in flight."""
        refs = start_long_requests(self.engine, prompt_ids, bench.pause_requests, cfg.engine.max_model_len,
                                   f"pause-{mode}-{round_}")
        in_flight = await self.engine.num_outstanding.remote()
        t0 = time.monotonic()
        await self.engine.pause.remote(mode)
        await self.engine.resume.remote()
        seconds = time.monotonic() - t0
        await asyncio.gather(*refs)
        return seconds, in_flight


async def _timed(coro) -> tuple[int, float]:
    t0 = time.monotonic()
    tokens = await coro
    return tokens, time.monotonic() - t0


async def _rollout_bench(cfg: Config, bench: BenchConfig, problems: list[Problem],
                         prompt_ids: list[list[int]]) -> dict[str, Any]:
    sampling = bench_sampling(cfg, bench)
    stream = engines_stream(cfg.algorithm.pause_mode)  # as the driver starts its engines
    framework = FrameworkPath(cfg, sampling, stream, len(problems))  # its engine starts while (a)'s does
    raw = RawVLLM(cfg, sampling, stream)
    framework.ready()
    try:
        for w in range(bench.warmup_rounds):  # untimed: both paths reach their steady state
            await raw.run(f"warmup{w}", prompt_ids, bench.n_samples)
            await framework.run(problems, bench.n_samples)
        rates: dict[str, list[float]] = {"raw": [], "framework": []}
        for r in range(bench.rounds):  # back to back, the first side alternating: noise hits both alike
            for side in ("raw", "framework") if r % 2 == 0 else ("framework", "raw"):
                await asyncio.sleep(bench.settle_s)  # the other engine's polling has stopped
                tokens, seconds = await _timed(raw.run(f"raw{r}", prompt_ids, bench.n_samples) if side == "raw"
                                               else framework.run(problems, bench.n_samples))
                rates[side].append(tokens / seconds)
            print(f"round {r}: raw vLLM {rates['raw'][-1]:.0f} tok/s, "
                  f"framework {rates['framework'][-1]:.0f} tok/s", flush=True)
        modes = ("abort", "keep") if stream else ("abort",)
        pauses = {mode: [await framework.pause_resume_s(cfg, bench, prompt_ids[0], mode, r)
                         for r in range(bench.rounds)] for mode in modes}
    finally:
        raw.shutdown()
    raw_rates, fw_rates = rates["raw"], rates["framework"]
    pause_s = {mode: statistics.median(s for s, _ in rounds) for mode, rounds in pauses.items()}
    # Rounds are paired (the two sides back to back): the median of the per-round ratios is
    # less sensitive to the machine's drift than a ratio of medians.
    ratios = [fw / raw for raw, fw in zip(raw_rates, fw_rates)]
    return {
        "bench": "rollout",
        "raw_tok_s": round(statistics.median(raw_rates), 1),
        "framework_tok_s": round(statistics.median(fw_rates), 1),
        "ratio": round(statistics.median(ratios), 3),
        "round_ratios": [round(x, 3) for x in ratios],
        "pause_resume_s": round(pause_s[cfg.algorithm.pause_mode], 4),
        "pause_mode": cfg.algorithm.pause_mode,
        "pause_resume_abort_s": round(pause_s["abort"], 4),
        "pause_resume_keep_s": round(pause_s["keep"], 4) if "keep" in pause_s else None,
        "rounds_pause_resume_s": {mode: [round(s, 4) for s, _ in rounds] for mode, rounds in pauses.items()},
        "engine_streams": stream,
        "in_flight_at_pause": min(n for rounds in pauses.values() for _, n in rounds),
        "rounds_raw_tok_s": [round(x) for x in raw_rates],
        "rounds_framework_tok_s": [round(x) for x in fw_rates],
        "requests_per_round": len(problems) * bench.n_samples,
        "max_new_tokens": bench.max_new_tokens,
        "ignore_eos": bench.ignore_eos,
        "concurrency": cfg.rollout.max_concurrent_loops,
        "warmup_rounds": bench.warmup_rounds,
    }


def run_rollout_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    problems = TaskSource(cfg.data).heldout[: bench.num_prompts]
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    actors.start_local_ray(cfg, dashboard=False, log_to_driver=False)
    try:
        return asyncio.run(_rollout_bench(cfg, bench, problems, [tok.encode(p.prompt) for p in problems]))
    finally:
        ray.shutdown()

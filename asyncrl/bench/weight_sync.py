"""`asyncrl bench weight-sync`: a full weight sync against a raw broadcast of the same bytes.

    asyncrl bench weight-sync recipe=arith
    asyncrl bench weight-sync recipe=arith engine.num_engines=2 trainer.weight_sync_bucket_mb=4

One trainer (its ranks as configured) and `engine.num_engines` engines join one broadcast
group (gloo on CPU, NCCL on GPUs). Then, `bench.rounds` times, alternating:
  (a) sync: (the trainer exports and packs its weights into buckets while the engines
      still run: `stage_s`, reported apart) -> every engine pauses -> broadcast -> each vLLM
      worker receives and loads -> version + 1 -> resume (asyncrl.sync.WeightSync.sync);
      sync_s is that exchange as the driver sees it, from sending the calls to the last
      engine's reply; `paused_s`, inside it, is the time an engine did not generate;
  (b) raw: the same number of bytes broadcast between the same processes in buffers of
      `trainer.weight_sync_bucket_mb`, no model on either side, timed the same way (the
      same calls, from the driver);
  (c) raw, in the sync's own buckets (tensors of `trainer.weight_sync_in_place_mb` and up
      travel alone, in buckets of their own): `raw_plan_broadcast_s`, to show what that
      layout costs the transfer itself.
ratio = median over rounds of raw_s / sync_s (1.0 = the sync costs nothing beyond moving bytes).
Then `bench.rounds` more syncs with `bench.pause_requests` long requests in flight on every
engine, as in a run (`sync_in_flight_s`, `paused_in_flight_s`: `algorithm.pause_mode`
decides whether they end with what they have or wait and go on under the new weights).
Then, where every engine is on trainer rank 0's host (on GPUs: its GPU), the group formed again over the
shared transport (asyncrl/sync/shared_buckets.py: shared memory on CPU, CUDA IPC on GPUs) and the
same syncs, idle and with requests in flight (`shared_*`; `shared_vs_broadcast`: median sync_s
of the broadcast / of the shared transport), so that both are measured in the same run on the
same processes. Whatever `trainer.weight_sync_transport` says, part one broadcasts.
Also: the trainer's tokens/s over `bench.trainer_steps` train steps on groups of the
recipe's prompts with `bench.max_new_tokens` sampled tokens each. Last line: one JSON object.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import ray

from asyncrl import actors
from asyncrl.bench.config import BenchConfig
from asyncrl.bench.in_flight import start_long_requests
from asyncrl.bench.raw_broadcast import RawBroadcast, raw_sizes
from asyncrl.config import Config
from asyncrl.control.weight_sync import WeightSync
from asyncrl.engine.engine_actor import EngineActor
from asyncrl.trainer.trainer_rank import TrainerRank
from asyncrl.types import Segment, Trajectory, TrajectoryGroup


def synthetic_groups(cfg: Config, length: int, prompts: list[list[int]], vocab: int,
                     seed: int) -> list[TrajectoryGroup]:
    """One step's worth of groups: real prompts, uniformly sampled response tokens, alternating rewards."""
    rng = random.Random(seed)
    n = cfg.algorithm.n_samples_per_prompt
    groups = []
    for g in range(cfg.algorithm.prompts_per_step):
        gid = f"bench-{seed}-{g}"
        trajs = [Trajectory(prompt_id=gid, group_id=gid, prompt_token_ids=prompts[g % len(prompts)],
                            segments=[Segment.from_policy([rng.randrange(vocab) for _ in range(length)],
                                                          [-5.0] * length, 0)],
                            reward=float(i % 2)) for i in range(n)]
        groups.append(TrajectoryGroup(gid, gid, trajs))
    return groups


class RawBroadcastRank(TrainerRank):
    """A trainer rank that can also broadcast raw buffers through the weight-sync group (rank 0)."""

    def broadcast_raw(self, sizes: list[int]) -> None:
        if self.rank == 0:
            if not hasattr(self, "_raw"):
                self._raw = RawBroadcast(self.device)
            self._raw.run(self._weight_group, sizes)


class RawReceiveEngine(EngineActor):
    """An engine whose vLLM workers can also receive raw buffers (asyncrl.bench.raw_broadcast)."""

    worker_extension = "asyncrl.bench.raw_broadcast.RawReceiveExtension"

    async def receive_raw(self, sizes: list[int]) -> None:
        await self._llm.collective_rpc("asyncrl_receive_raw", args=(sizes,))


def raw_broadcast_s(sync: WeightSync, sizes: list[int]) -> float:
    """Buffers of these sizes through the sync's group, with no model on either side, timed
    as `WeightSync.sync` is (from the driver's calls to the last reply)."""
    t0 = time.monotonic()
    ray.get([r.broadcast_raw.remote(sizes) for r in sync.trainer.ranks]
            + [e.receive_raw.remote(sizes) for e in sync.engines])
    return time.monotonic() - t0


def syncs_in_flight(sync: WeightSync, engines: list, prompt: list[int], cfg: Config, bench: BenchConfig,
                    version: int, tag: str) -> tuple[int, list]:
    """`bench.rounds` syncs with `bench.pause_requests` long requests in flight on every engine."""
    busy = []
    for r in range(bench.rounds):
        version += 1
        refs = [ref for i, e in enumerate(engines) for ref in start_long_requests(
            e, prompt, bench.pause_requests, cfg.engine.max_model_len, f"{tag}{r}-e{i}")]
        busy.append(sync.sync(version, cfg.algorithm.pause_mode))
        ray.get(refs)
    return version, busy


def shared_results(transport: str, sync_s: list[float], shared: list, busy: list) -> dict[str, Any]:
    """Part two's keys (None where the engines are not all where trainer rank 0 is)."""
    if not shared:
        return {"shared_transport": None}
    med = statistics.median
    shared_s = [t.total_s for t in shared]
    return {
        "shared_transport": transport,
        "shared_sync_s": med(shared_s),
        "shared_vs_broadcast": med(sync_s) / med(shared_s),
        "shared_paused_s": med(t.paused_s for t in shared),
        "shared_stage_s": med(t.stage_s for t in shared),
        "shared_broadcast_load_s": med(t.broadcast_load_s for t in shared),
        "shared_load_s": med(t.load_s for t in shared),
        "shared_sync_in_flight_s": med(t.total_s for t in busy),
        "shared_paused_in_flight_s": med(t.paused_s for t in busy),
        "shared_load_path": ",".join(sorted(set(shared[-1].load_paths))),
        "shared_in_place_bytes": min(shared[-1].in_place_bytes),
        "rounds_shared_sync_s": [round(x, 4) for x in shared_s],
    }


def run_weight_sync_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from transformers import AutoConfig, AutoTokenizer

    from asyncrl.tasks import TaskSource

    actors.start_local_ray(cfg, dashboard=False, log_to_driver=False)
    trainer = None
    try:
        engines = actors.create_engines(cfg, engine_class=RawReceiveEngine)
        started = [e.start.remote() for e in engines]
        trainer = actors.create_trainer(cfg, rank_class=RawBroadcastRank)
        info = trainer.setup()  # while the engines start
        ray.get(started)
        sync = WeightSync.of(cfg, trainer, engines)
        sync.wanted = "broadcast"  # the shared transport is measured after, in part two
        sync.connect()

        sync_s, raw_s, raw_plan_s, phases = [], [], [], []
        chunks = raw_sizes(sync.plan.total_bytes, int(cfg.trainer.weight_sync_bucket_mb * 2**20))
        plan_sizes = [sync.plan.bucket_nbytes(i) for i in range(len(sync.plan.buckets))]
        version = 0
        for r in range(bench.warmup_rounds + bench.rounds):
            version += 1
            timings = sync.sync(version, cfg.algorithm.pause_mode)
            raw = raw_broadcast_s(sync, chunks)
            raw_plan = raw_broadcast_s(sync, plan_sizes)
            if r >= bench.warmup_rounds:
                sync_s.append(timings.total_s)
                raw_s.append(raw)
                raw_plan_s.append(raw_plan)
                phases.append(timings)

        tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size
        prompts = [tok.encode(p.prompt) for p in TaskSource(cfg.data).heldout[: cfg.algorithm.prompts_per_step]]
        version, busy = syncs_in_flight(sync, engines, prompts[0], cfg, bench, version, "bc")
        sync.wanted = "auto"  # part two: shared memory or CUDA IPC where every engine is where rank 0 is
        sync.connect()
        shared, shared_busy = [], []
        if sync.transport != "broadcast":
            for r in range(bench.warmup_rounds + bench.rounds):
                version += 1
                timings = sync.sync(version, cfg.algorithm.pause_mode)
                if r >= bench.warmup_rounds:
                    shared.append(timings)
            version, shared_busy = syncs_in_flight(sync, engines, prompts[0], cfg, bench, version, "sh")
        rates = []
        for step in range(bench.trainer_steps + 1):  # the first step warms up
            groups = synthetic_groups(cfg, bench.max_new_tokens, prompts, vocab, step)
            tokens = sum(len(t.prompt_token_ids) + t.num_response_tokens for g in groups for t in g.trajectories)
            t0 = time.monotonic()
            trainer.train_step(groups, version)
            if step:
                rates.append(tokens / (time.monotonic() - t0))
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    med = statistics.median
    return {
        "bench": "weight_sync",
        "bytes": info.weight_bytes,
        "sync_s": med(sync_s),
        "raw_broadcast_s": med(raw_s),
        "raw_plan_broadcast_s": med(raw_plan_s),
        "ratio": med(r / s for r, s in zip(raw_s, sync_s)),
        "paused_s": med(p.paused_s for p in phases),
        "stage_s": med(p.stage_s for p in phases),
        "pause_s": med(p.pause_s for p in phases),
        "broadcast_load_s": med(p.broadcast_load_s for p in phases),
        "load_s": med(p.load_s for p in phases),
        "resume_s": med(p.resume_s for p in phases),
        "sync_in_flight_s": med(p.total_s for p in busy),
        "paused_in_flight_s": med(p.paused_s for p in busy),
        "in_flight_requests": bench.pause_requests * len(engines),
        "pause_mode": cfg.algorithm.pause_mode,
        "load_path": ",".join(sorted(set(phases[-1].load_paths))),  # see WeightLoaderExtension._asyncrl_direct_load
        "in_place_bytes": min(phases[-1].in_place_bytes),  # received straight into parameters (no copy)
        "buckets": info.weight_buckets,
        "raw_buffers": len(chunks),
        "bucket_mb": cfg.trainer.weight_sync_bucket_mb,
        "engines": cfg.engine.num_engines,
        "trainer_ranks": trainer.world_size,
        "trainer_tokens_s": med(rates),
        "rounds": bench.rounds,
        "rounds_sync_s": [round(x, 4) for x in sync_s],
        "rounds_raw_s": [round(x, 4) for x in raw_s],
        **shared_results(sync.transport, sync_s, shared, shared_busy),
    }

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
Also: the trainer's tokens/s over `bench.trainer_steps` train steps on groups of the
recipe's prompts with `bench.max_new_tokens` sampled tokens each. Last line: one JSON object.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from asyncrl.config import Config
from asyncrl.types import Segment, Trajectory, TrajectoryGroup


def synthetic_groups(cfg: Config, prompts: list[list[int]], vocab: int, seed: int) -> list[TrajectoryGroup]:
    """One step's worth of groups: real prompts, uniformly sampled response tokens, alternating rewards."""
    rng = random.Random(seed)
    n, length = cfg.algorithm.n_samples_per_prompt, cfg.bench.max_new_tokens
    groups = []
    for g in range(cfg.algorithm.prompts_per_step):
        gid = f"bench-{seed}-{g}"
        trajs = [Trajectory(prompt_id=gid, group_id=gid, prompt_token_ids=prompts[g % len(prompts)],
                            segments=[Segment.from_policy([rng.randrange(vocab) for _ in range(length)],
                                                          [-5.0] * length, 0)],
                            reward=float(i % 2)) for i in range(n)]
        groups.append(TrajectoryGroup(gid, gid, trajs))
    return groups


def run_weight_sync_bench(cfg: Config) -> dict[str, Any]:
    import ray
    from transformers import AutoConfig, AutoTokenizer

    from asyncrl.engine.engine_actor import EngineActor, engine_options
    from asyncrl.sync.collective import raw_sizes
    from asyncrl.sync.weight_sync import WeightSync
    from asyncrl.tasks import TaskSource
    from asyncrl.trainer.trainer_group import TrainerGroup

    ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=False)
    trainer = None
    try:
        engines = [ray.remote(EngineActor).options(**engine_options(cfg.engine, i)).remote(
            i, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device)
            for i in range(cfg.engine.num_engines)]
        ray.get([e.start.remote() for e in engines])
        trainer = TrainerGroup(cfg)
        info = trainer.setup()
        sync = WeightSync(trainer, engines, backend="gloo" if cfg.cluster.device == "cpu" else "nccl",
                          timeout_s=cfg.trainer.dist_timeout_s)
        sync.connect()

        sync_s, raw_s, raw_plan_s, phases = [], [], [], []
        chunks = raw_sizes(sync.plan.total_bytes, int(cfg.trainer.weight_sync_bucket_mb * 2**20))
        plan_sizes = [sync.plan.bucket_nbytes(i) for i in range(len(sync.plan.buckets))]
        version = 0
        for r in range(cfg.bench.warmup_rounds + cfg.bench.rounds):
            version += 1
            timings = sync.sync(version, cfg.algorithm.pause_mode)
            raw = sync.raw_broadcast(chunks)
            raw_plan = sync.raw_broadcast(plan_sizes)
            if r >= cfg.bench.warmup_rounds:
                sync_s.append(timings["sync/total_s"])
                raw_s.append(raw)
                raw_plan_s.append(raw_plan)
                phases.append(timings)

        tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
        vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size
        prompts = [tok.encode(p.prompt) for p in TaskSource(cfg.data).heldout[: cfg.algorithm.prompts_per_step]]
        rates = []
        for step in range(cfg.bench.trainer_steps + 1):  # the first step warms up
            groups = synthetic_groups(cfg, prompts, vocab, step)
            tokens = sum(len(t.prompt_token_ids) + t.num_response_tokens for g in groups for t in g.trajectories)
            t0 = time.monotonic()
            trainer.call("train_step", groups, version)
            if step:
                rates.append(tokens / (time.monotonic() - t0))
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    med = statistics.median
    return {
        "bench": "weight_sync",
        "bytes": info["weight_bytes"],
        "sync_s": med(sync_s),
        "raw_broadcast_s": med(raw_s),
        "raw_plan_broadcast_s": med(raw_plan_s),
        "ratio": med(r / s for r, s in zip(raw_s, sync_s)),
        "paused_s": med(p["sync/paused_s"] for p in phases),
        "stage_s": med(p["sync/stage_s"] for p in phases),
        "pause_s": med(p["sync/pause_s"] for p in phases),
        "broadcast_load_s": med(p["sync/broadcast_load_s"] for p in phases),
        "load_s": med(p["sync/load_s"] for p in phases),
        "resume_s": med(p["sync/resume_s"] for p in phases),
        "load_path": ",".join(sorted(set(sync.last_load_paths))),  # see WeightLoaderExtension._asyncrl_direct_load
        "in_place_bytes": min(sync.last_in_place_bytes),  # received straight into parameters (no copy)
        "buckets": info["weight_buckets"],
        "raw_buffers": len(chunks),
        "bucket_mb": cfg.trainer.weight_sync_bucket_mb,
        "engines": cfg.engine.num_engines,
        "trainer_ranks": trainer.world_size,
        "trainer_tokens_s": med(rates),
        "rounds": cfg.bench.rounds,
        "rounds_sync_s": [round(x, 4) for x in sync_s],
        "rounds_raw_s": [round(x, 4) for x in raw_s],
    }

"""Parameter sync: (stage) -> pause the engines -> broadcast the trainer's weights -> load -> resume.

`WeightSync.connect()` forms the broadcast group once (trainer rank 0 + every vLLM
worker of every engine; see collective.py) after each engine has checked the
trainer's bucket plan against its model. `WeightSync.sync(version)` then has the trainer
export and pack its weights while the engines still generate, has every engine pause,
receive the broadcast, load it and resume (one call each), times each phase, and checks
that every engine received exactly the bytes the trainer sent (per-tensor checksums).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from asyncrl.sync.collective import BucketPlan

logger = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, trainer, engines: list, backend: str, timeout_s: float = 600.0):
        self.trainer = trainer  # a TrainerGroup
        self.engines = engines  # EngineActor handles
        self.backend = backend  # "gloo" on CPU, "nccl" on GPUs
        self.timeout_s = timeout_s
        self.connected = False
        self.plan: BucketPlan | None = None  # the trainer's, once connected
        self.last_load_paths: list[str] = []
        self.last_in_place_bytes: list[int] = []  # per engine: received straight into parameters

    def connect(self) -> dict[str, Any]:
        t0 = time.monotonic()
        host, port = ray.get(self.trainer.ranks[0].address.remote())
        workers = ray.get([e.num_workers.remote() for e in self.engines])
        world = 1 + sum(workers)
        plan = self.trainer.call("weight_plan")
        self.plan = BucketPlan.from_wire(plan)
        # Every member must be joining at once: the trainer's store waits for all of them.
        refs = self.trainer.submit("init_weight_group", host, port, world)
        offset = 1
        for engine, n in zip(self.engines, workers):
            refs.append(engine.init_weight_group.remote(host, port, offset, world, self.backend, plan,
                                                        self.timeout_s))
            offset += n
        ray.get(refs)
        self.connected = True
        info = {"world_size": world, "connect_s": time.monotonic() - t0}
        logger.info("weight-sync group ready: %s", info)
        return info

    def sync(self, version: int, pause_mode: str = "abort") -> dict[str, float]:
        """Stage, then on every engine at once: pause, broadcast, load, stamp `version`, resume.
        Returns each phase's seconds: engine-side phases are the slowest engine's;
        `sync/paused_s` is the longest time an engine did not generate, `sync/total_s` the
        whole exchange as the caller sees it (Ray calls included)."""
        if not self.connected:
            self.connect()
        ts = time.monotonic()
        sent = self.trainer.call("stage_weights")  # export + pack while the engines still generate
        t0 = time.monotonic()
        # One call per engine: it pauses itself, receives while the trainer sends, and resumes.
        sent_refs = self.trainer.submit("broadcast_weights")
        received = ray.get([e.update_weights.remote(version, pause_mode) for e in self.engines])
        ray.get(sent_refs)
        t1 = time.monotonic()
        for i, r in enumerate(received):
            if r["checksums"] != sent["checksums"]:
                bad = [n for n in sent["checksums"] if r["checksums"].get(n) != sent["checksums"][n]]
                raise RuntimeError(f"weight sync to version {version}: engine-{i} received different bytes "
                                   f"for {bad[:5]}")
        self.last_load_paths = [r["load_path"] for r in received]  # replay, copy, reload, +repack (worker_extension)
        self.last_in_place_bytes = [r["in_place_bytes"] for r in received]
        timings = {"sync/stage_s": t0 - ts, "sync/total_s": t1 - t0, "sync/version": version}
        for phase in ("pause_s", "broadcast_load_s", "load_s", "resume_s", "paused_s"):
            timings[f"sync/{phase}"] = max(r[phase] for r in received)
        logger.debug("weight sync -> version %d: stage %.3fs | pause %.3fs, broadcast+load %.3fs (load %.3fs, %s), "
                     "resume %.3fs | total %.3fs", version, timings["sync/stage_s"], timings["sync/pause_s"],
                     timings["sync/broadcast_load_s"], timings["sync/load_s"], received[0]["load_path"],
                     timings["sync/resume_s"], timings["sync/total_s"])
        return timings

    def raw_broadcast(self, sizes: list[int]) -> float:
        """Buffers of these sizes through the same group, with no model on either side
        (benchmark baseline), timed as `sync` is."""
        if not self.connected:
            self.connect()
        t0 = time.monotonic()
        refs = self.trainer.submit("broadcast_raw", sizes) + [e.receive_raw.remote(sizes) for e in self.engines]
        ray.get(refs)
        return time.monotonic() - t0

"""Parameter sync: (stage) -> pause the engines -> broadcast the trainer's weights -> load -> resume.

It coordinates two kinds of actor (the trainer's ranks and the engines), so it lives in the
control layer; the transports it drives are below, in asyncrl/sync/.

`WeightSync.connect()` forms the broadcast group once (trainer rank 0 + every vLLM
worker of every engine; see asyncrl/sync/collective.py) after each engine has checked the
trainer's bucket plan against its model; each formation gets a fresh secret, handed to
every member through Ray, which the group's store seals its keys with (sync/group_store.py).
Where every engine worker shares trainer rank 0's host (CPU) or GPU, the formation may use a
shared region instead of the collective (`transport`; sync/shared_buckets.py): rank 0 creates it,
named after the secret, every worker maps it, then its name is removed.
`WeightSync.sync(version)` then has the trainer export and pack its weights while the
engines still generate, has every engine pause, receive the broadcast, load it and resume
(one call each), times each phase, and checks that every engine received exactly the bytes
the trainer sent (per-tensor checksums).

An engine that fails during the exchange fails the sync with `EnginesFailed`, which names it
and the engines still waiting for bytes after SYNC_FAILURE_GRACE_S: a collective whose member
died does not complete (gloo's root stops sending at the dead member; the others wait until the
group's timeout), so the caller replaces those too and syncs again without them.
"""

from __future__ import annotations

import logging
import time

import ray

from asyncrl.clock import Clock
from asyncrl.config.schema import Config
from asyncrl.interfaces import EngineHandle
from asyncrl.messages import SyncTimings, WeightUpdateReport, error_line
from asyncrl.sync.collective import BucketPlan, broadcast_backend
from asyncrl.sync.group_store import new_group_secret
from asyncrl.sync.shared_buckets import choose_transport
from asyncrl.trainer.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)

# After an engine failed mid-sync, how long the others get to finish before they count as stuck.
SYNC_FAILURE_GRACE_S = 10.0


class EnginesFailed(RuntimeError):
    """Engines (indices into `WeightSync.engines`) that failed during a sync, and those left
    waiting for a broadcast that will not complete."""

    def __init__(self, version: int, failed: dict[int, str], stuck: list[int]):
        self.failed, self.stuck = failed, stuck
        super().__init__(f"weight sync to version {version}: engine(s) failed {failed}, left waiting {stuck}")


class WeightSync:
    """Driver-side coordination of the weight broadcast between one TrainerGroup and the engines."""

    def __init__(self, trainer: TrainerGroup, engines: list[EngineHandle], backend: str, timeout_s: float = 600.0,
                 clock: Clock | None = None, transport: str = "broadcast"):
        self.trainer = trainer
        self.engines = engines  # a shared `transport` calls SharedWeightsEngine's methods: real engines only
        self.backend = backend  # "gloo" on CPU, "cupy" on GPUs (asyncrl.sync.collective.broadcast_backend)
        self.wanted = transport  # trainer.weight_sync_transport (shared_buckets.TRANSPORTS)
        self.transport = "broadcast"  # what the last formation resolved it to (choose_transport)
        self.timeout_s = timeout_s
        self.connected = False
        self.plan: BucketPlan | None = None  # the trainer's, once connected
        self.world_size = 0
        self.store_address: tuple[str, int] | None = None  # (host, port) of the group's store, once connected
        self.clock = clock or Clock()  # the timings' (simulated seconds with simulated backends)

    @classmethod
    def of(cls, cfg: Config, trainer: TrainerGroup, engines: list[EngineHandle]) -> WeightSync:
        """The weight-broadcast group between trainer rank 0 and every engine's vLLM workers, or the
        shared region where they share its host or GPU (not connected yet: `connect()`). Simulated
        backends broadcast (their broadcast is a wait of its simulated time)."""
        sim = cfg.trainer.backend == "sim" or cfg.engine.backend == "sim"
        return cls(trainer, engines, broadcast_backend(cfg.cluster.device), cfg.trainer.dist_timeout_s,
                   Clock(cfg.cluster.time_scale), "broadcast" if sim else cfg.trainer.weight_sync_transport)

    def connect(self) -> float:
        """Form the broadcast group (trainer rank 0 + every vLLM worker), or the shared region
        where every worker is where rank 0 is; returns seconds taken."""
        t0 = time.monotonic()
        workers = ray.get([e.num_workers.remote() for e in self.engines])
        secret = new_group_secret()  # this formation's: a member of an earlier one cannot join or read it
        self.world_size = 1 + sum(workers)
        plan = self.trainer.weight_plan()
        self.plan = BucketPlan.from_wire(plan)
        adapter = self.trainer.adapter_config()  # trainer.lora: the syncs carry an adapter
        self.transport = self._choose_transport()
        if self.transport != "broadcast":
            self._share(workers, secret, plan, adapter)
            self.connected, self.store_address = True, None
            seconds = time.monotonic() - t0
            logger.info("weight sync over %s ready: %d members, %.1fs", self.transport, self.world_size, seconds)
            return seconds
        nodes = ray.get([e.node_id.remote() for e in self.engines])
        # Trainer rank 0 binds the store now (loopback if every engine is on its node) and holds it.
        host, port = self.trainer.weight_group_address(nodes)
        # Every member must be joining at once: the trainer's store waits for all of them.
        refs = self.trainer.init_weight_group_async(host, port, self.world_size, self.backend, secret)
        offset = 1
        for engine, n in zip(self.engines, workers):
            refs.append(engine.init_weight_group.remote(host, port, offset, self.world_size, self.backend, secret,
                                                        plan, self.timeout_s, adapter))
            offset += n
        self.trainer.get(refs[:len(self.trainer.ranks)])
        ray.get(refs[len(self.trainer.ranks):])
        self.connected, self.store_address = True, (host, port)
        seconds = time.monotonic() - t0
        logger.info("weight-sync group ready: %d members, %.1fs", self.world_size, seconds)
        return seconds

    def _choose_transport(self) -> str:
        if self.wanted == "broadcast":
            return "broadcast"
        device = "cpu" if self.backend == "gloo" else "cuda"
        places = ray.get([e.weight_sync_places.remote() for e in self.engines])
        return choose_transport(self.wanted, device, self.trainer.weight_sync_place(), places, self.plan.total_bytes)

    def _share(self, workers: list[int], secret: str, plan: list, adapter: dict | None) -> None:
        """Rank 0 creates the shared region, every engine's workers open it, then its name goes."""
        share = self.trainer.init_shared_weights(self.transport, secret)
        try:
            refs, offset = [], 1
            for engine, n in zip(self.engines, workers):
                refs.append(engine.init_weight_group.remote("", 0, offset, self.world_size, self.backend, secret,
                                                            plan, self.timeout_s, adapter, self.transport, share))
                offset += n
            ray.get(refs)
        finally:
            self.trainer.shared_weights_joined()

    def sync(self, version: int, pause_mode: str = "abort", newest: bool = False) -> SyncTimings:
        """Stage, then on every engine at once: pause, broadcast, load, stamp `version`, resume.
        Engine-side phases are the slowest engine's; `paused_s` is the longest time an engine
        did not generate, `total_s` the whole exchange as the caller sees it (Ray calls included).
        `newest`: the trainer's current weights even with algorithm.policy_lag."""
        if not self.connected:
            self.connect()
        ts = self.clock.now()
        sent = self.trainer.stage_weights(version, newest)  # export + pack while the engines still generate
        t0 = self.clock.now()
        # One call per engine: it pauses itself, receives while the trainer sends, and resumes.
        sent_refs = self.trainer.broadcast_weights_async()
        # With algorithm.policy_lag the trainer sends an older version; the engines stamp that one.
        received = self._updates([e.update_weights.remote(sent.version, pause_mode) for e in self.engines], version,
                                 sent_refs)
        self.trainer.get(sent_refs)
        t1 = self.clock.now()
        for i, r in enumerate(received):
            if r.checksums != sent.checksums:
                bad = [n for n in sent.checksums if r.checksums.get(n) != sent.checksums[n]]
                raise RuntimeError(f"weight sync to version {version}: engine-{i} received different bytes "
                                   f"for {bad[:5]}")
        timings = SyncTimings(
            version=version, engine_version=sent.version, stage_s=t0 - ts, total_s=t1 - t0,
            pause_s=max(r.pause_s for r in received),
            broadcast_load_s=max(r.broadcast_load_s for r in received), load_s=max(r.load_s for r in received),
            resume_s=max(r.resume_s for r in received), paused_s=max(r.paused_s for r in received),
            load_paths=[r.load_path for r in received], in_place_bytes=[r.in_place_bytes for r in received],
            aborted=sum(r.aborted for r in received))
        logger.debug("weight sync -> version %d: %s", version, timings)
        return timings

    def _updates(self, refs: list[ray.ObjectRef], version: int,
                 sent_refs: list[ray.ObjectRef]) -> list[WeightUpdateReport]:
        """Every engine's report; `EnginesFailed` if one failed (and which ones are left waiting).
        The trainer's sends (`sent_refs`) are watched meanwhile: a rank whose process died raises
        `TrainerRankDied` at once, where engines not yet in their receive would wait for it."""
        index = {ref: i for i, ref in enumerate(refs)}
        pending, sending, failed = list(refs), list(sent_refs), {}
        while pending:
            ready, _ = ray.wait(pending + sending, num_returns=1, timeout=SYNC_FAILURE_GRACE_S if failed else None)
            if not ready:
                break
            ref = ready[0]
            (pending if ref in index else sending).remove(ref)
            try:
                ray.get(ref)
            except Exception as e:
                if ref in index:
                    failed[index[ref]] = error_line(e)
                else:  # a dead rank: TrainerRankDied; otherwise the engines' side says what broke
                    self.trainer.check_alive()
        if failed:
            raise EnginesFailed(version, failed, sorted(index[r] for r in pending))
        return ray.get(refs)

"""The engines of a run: one per slot (a placement-group bundle), the workers' routing, and the
weight-broadcast group over the live ones.

A slot holds its live engine, or its replacement while that starts (`starting`), or nothing
(an engine removed from the run). A new engine, a replacement or an added one (`grow`),
joins a new broadcast group once started (`poll_starting`) and the workers' routing once a
sync gave it the policy (`route_joined`): until then `routed` keeps the handle the workers
were given. `shrink` removes engines the way a fault does, but on purpose: the workers stop
routing to them, their requests are aborted (the loops continue from their snapshots on the
other engines, nothing restarts from the prompt), then they stop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl import actors
from asyncrl.config.schema import Config
from asyncrl.control import TrainingError, kill
from asyncrl.control.weight_sync import WeightSync
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.interfaces import EngineHandle
from asyncrl.messages import EngineActivity, FaultEvent, ScaleEvent, error_line
from asyncrl.trainer.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, cfg: Config, slots: list | None):
        """`engine.num_engines` engines in `slots`, not started yet (`start`)."""
        self.cfg, self.slots = cfg, list(slots or [])
        # None: a slot whose engine was removed
        self.engines: list[EngineHandle | None] = actors.create_engines(cfg, slots)
        self.routed: list[EngineHandle | None] = list(self.engines)  # the handles the workers route to
        self.starting: dict[int, tuple[ray.ObjectRef, FaultEvent | ScaleEvent, float]] = {}  # slot -> its start
        self.created = [1] * len(self.engines)  # engines started in each slot so far (their names' suffix)
        self.own_groups: dict[int, tuple[dict, Any]] = {}  # added slot -> its actor options, placement group
        self.sync: WeightSync | None = None
        self.on_dead: Callable[[], object] = lambda: None

    def start(self) -> list[ray.ObjectRef]:
        """Start vLLM in every engine; the refs of their `EngineStartInfo`."""
        return [e.start.remote() for e in self.engines]

    def connect(self, trainer: TrainerGroup) -> None:
        """A weight-broadcast group of `trainer` and the live engines."""
        self.sync = WeightSync.of(self.cfg, trainer, self.live())
        self.sync.connect()

    def reform_group(self) -> None:
        """A new broadcast group of the trainer and the live engines (the old one counts the dead
        engines' workers: a broadcast would hang)."""
        self.sync.engines = self.live()
        self.sync.connect()

    def live(self) -> list[EngineHandle]:
        """The engines serving now (those still starting left out)."""
        return [e for i, e in enumerate(self.engines) if e is not None and i not in self.starting]

    def count(self) -> int:
        """The run's engines, those starting included."""
        return sum(e is not None for e in self.engines)

    def slot_of(self, engine: EngineHandle) -> int:
        return next(i for i, e in enumerate(self.engines) if e is engine)

    def health_probes(self) -> list[tuple[int, ray.ObjectRef]]:
        return [(i, e.health.remote()) for i, e in enumerate(self.engines) if e is not None and i not in self.starting]

    def activity(self) -> dict[EngineHandle, EngineActivity]:
        """Each live engine's activity totals, by its handle."""
        try:
            engines = self.live()
            each = ray.get([e.activity.remote() for e in engines])
        except ray.exceptions.RayActorError:
            self.on_dead()
            engines = self.live()
            each = ray.get([e.activity.remote() for e in engines])
        return dict(zip(engines, each))

    def replace(self, i: int, event: FaultEvent) -> None:
        """Start a new engine in slot `i`'s bundle; the run goes on meanwhile (the dead one's loops
        already moved to the live engines). `poll_starting` takes it in, with `event`."""
        t0 = time.monotonic()
        self._stop([i], timeout_s=10)
        self._start(i, event, t0)

    def _start(self, i: int, event: FaultEvent | ScaleEvent, t0: float) -> None:
        if not self.slots or i < len(self.slots):
            options = actors.slot(self.slots, i)
        else:  # an added slot: a placement group of its own
            if i not in self.own_groups:
                self.own_groups[i] = actors.engine_bundle(self.cfg)
            options = self.own_groups[i][0]
        self.engines[i] = actors.create_engine(self.cfg, i, options, restart=self.created[i])
        self.created[i] += 1
        self.starting[i] = (self.engines[i].start.remote(), event, t0)

    def _stop(self, slots: list[int], timeout_s: float) -> None:
        """Stop these slots' engines' vLLM processes, all at once under one deadline, then the
        actors (a dead or hung engine is killed all the same)."""
        refs = {self.engines[i].shutdown.remote(): i for i in slots}
        ready, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as e:  # dead: killed below
                logger.warning("engine-%d's shutdown: %s", refs[ref], error_line(e))
        if late:
            logger.warning("engine(s) %s did not shut down within %gs: killed",
                           ", ".join(f"engine-{refs[r]}" for r in late), timeout_s)
        for i in slots:
            kill(self.engines[i])

    def _placed(self, i: int) -> bool:
        """Whether slot `i`'s bundle is reserved. The run's placement group was placed at the start;
        an added slot's own group waits until the cluster has room, which may never come."""
        if i not in self.own_groups:
            return True
        return ray.util.placement_group_table(self.own_groups[i][1]).get("state") == "CREATED"

    def cancel_unplaced(self) -> list[ScaleEvent]:
        """The run ends: stop waiting for the engines whose bundle the cluster has no room for.
        Each is killed and its placement group removed; a scale-up with no engine left starting
        is over (returned, its cancelled slots listed). Those placed go on starting."""
        over: list[ScaleEvent] = []
        for i in [i for i in self.starting if not self._placed(i)]:
            _, event, _ = self.starting.pop(i)
            kill(self.engines[i])
            self.engines[i] = self.routed[i] = None
            actors.remove_bundle(self.own_groups.pop(i)[1])
            logger.warning("engine-%d never got a place in the cluster: cancelled, as the run ends", i)
            if isinstance(event, ScaleEvent):
                event.cancelled.append(i)
                event.engines_after -= 1
                if not any(e is event for _, e, _ in self.starting.values()) and all(x is not event for x in over):
                    over.append(event)
        return over

    # -- elastic ---------------------------------------------------------------------

    def grow(self, n: int, event: ScaleEvent) -> None:
        """Start `n` more engines (in removed slots first, then new ones, each new one in a
        placement group of its own); `poll_starting` takes them in and returns `event` once the
        last has started."""
        t0 = time.monotonic()
        for _ in range(n):
            i = next((k for k, e in enumerate(self.engines) if e is None), len(self.engines))
            if i == len(self.engines):
                self.engines.append(None)
                self.routed.append(None)
                self.created.append(0)
            event.slots.append(i)
            self._start(i, event, t0)

    def shrink(self, n: int, workers: WorkerPool, event: ScaleEvent) -> None:
        """Remove the `n` live engines of the highest slots: the workers stop routing to them,
        their requests are aborted (each loop goes on from its snapshot on another engine), they
        stop, and a broadcast group forms without them."""
        slots = [i for i, e in enumerate(self.engines) if e is not None and i not in self.starting][-n:]
        event.slots += slots
        t0 = time.monotonic()
        for i in slots:
            workers.retire(i)
        t1 = time.monotonic()
        for i, ref in [(i, self.engines[i].pause.remote("abort")) for i in slots]:
            try:
                ray.get(ref)
            except Exception as e:  # dead meanwhile: removed all the same
                logger.warning("engine-%d failed while being removed: %s", i, error_line(e))
        t2 = time.monotonic()
        self._stop(slots, timeout_s=60)
        for i in slots:
            self.engines[i] = self.routed[i] = None
            if i in self.own_groups:
                actors.remove_bundle(self.own_groups.pop(i)[1])
        t3 = time.monotonic()
        self.reform_group()
        event.phases_s = {"stop_routing_s": t1 - t0, "abort_requests_s": t2 - t1, "stop_engines_s": t3 - t2,
                          "weight_group_s": time.monotonic() - t3}

    def poll_starting(self, block: bool = False) -> list[FaultEvent | ScaleEvent]:
        """Take in the engines that have started (with `block`, wait for one): a new broadcast
        group with them. Returns the events completed: a replacement's, or a scale-up's once
        its last engine started."""
        if not self.starting:
            return []
        refs = {ref: i for i, (ref, _, _) in self.starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=1 if block else len(refs), timeout=None if block else 0)
        if not ready:
            return []
        started = []
        for ref in ready:
            i = refs[ref]
            _, event, t0 = self.starting.pop(i)
            try:
                ray.get(ref)
            except Exception as e:
                raise TrainingError(f"engine-{i} failed to start: {error_line(e)}") from None
            # a scale-up's engines share one start time: the phase lasts until its last one started
            event.phases_s["start_engine_s"] = max(event.phases_s.get("start_engine_s", 0.0), time.monotonic() - t0)
            started.append(event)
        t1 = time.monotonic()
        self.reform_group()
        done: list[FaultEvent | ScaleEvent] = []
        for event in started:
            if any(d is event for d in done) or any(e is event for _, e, _ in self.starting.values()):
                continue  # a scale-up with engines still starting
            event.phases_s["weight_group_s"] = time.monotonic() - t1
            done.append(event)
        return done

    def only_unrouted(self) -> bool:
        """Every live engine is a replacement no worker routes to yet (the engines the workers know
        all died): nothing generates until a sync gives the replacements the policy."""
        live = [i for i, e in enumerate(self.engines) if e is not None and i not in self.starting]
        return bool(live) and all(self.routed[i] is not self.engines[i] for i in live)

    def route_joined(self, workers: WorkerPool, version: int) -> None:
        """After a sync every engine holds the policy: replacements join the workers' routing."""
        for i, engine in enumerate(self.engines):
            if engine is not None and self.routed[i] is not engine and i not in self.starting:
                self.routed[i] = engine
                workers.route(i, engine)
                logger.info("engine-%d's replacement holds version %d: routed to", i, version)

    def pause(self) -> list[EngineHandle]:
        """Pause every live engine (abort: requests return what they generated); returns those
        paused (one that died since the last health check is left out, and logged)."""
        paused = []
        for engine, ref in [(e, e.pause.remote("abort")) for e in self.live()]:
            try:
                ray.get(ref)
                paused.append(engine)
            except Exception as e:  # its loops went on elsewhere; the caller's health check replaces it
                logger.warning("an engine failed while pausing: %s", error_line(e))
        return paused

    def resume(self, paused: list[EngineHandle]) -> int:
        """Resume the engines `pause` paused; returns how many did (one that died meanwhile is left
        out, and logged: the caller's health check replaces it)."""
        resumed = 0
        for ref in [e.resume.remote() for e in paused]:
            try:
                ray.get(ref)
                resumed += 1
            except Exception as e:
                logger.warning("an engine failed while resuming: %s", error_line(e))
        return resumed

    def shutdown(self, timeout_s: float = 60) -> None:
        """Stop every engine's vLLM processes (all at once, within `timeout_s`), then the actors;
        engines still waiting for a place are cancelled first (they would never answer)."""
        try:
            self.cancel_unplaced()
        except Exception as e:  # the cluster itself failing: every engine is stopped below all the same
            logger.warning("engines waiting for a place not cancelled: %s", error_line(e))
        self._stop([i for i, e in enumerate(self.engines) if e is not None], timeout_s)
        for _, group in self.own_groups.values():
            actors.remove_bundle(group)

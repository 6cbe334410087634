"""The engines of a run: one per slot (a placement-group bundle), the workers' routing, and the
weight-broadcast group over the live ones.

A slot holds its live engine, or its replacement while that starts (`starting`). A
replacement joins a new broadcast group once started (`poll_starting`) and the workers'
routing once a sync gave it the policy (`route_joined`): until then `routed` keeps the handle
the workers were given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl import actors
from asyncrl.config.schema import Config
from asyncrl.control import TrainingError
from asyncrl.control.worker_pool import WorkerPool, kill
from asyncrl.messages import EngineActivity, FaultEvent, error_line
from asyncrl.sync.weight_sync import WeightSync
from asyncrl.trainer.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class EnginePool:
    def __init__(self, cfg: Config, slots: list | None):
        """`engine.num_engines` engines in `slots`, not started yet (`start`)."""
        self.cfg, self.slots = cfg, slots
        self.engines = actors.create_engines(cfg, slots)
        self.routed = list(self.engines)  # the handles the workers route to
        self.starting: dict[int, tuple[ray.ObjectRef, FaultEvent, float]] = {}  # slot -> replacement's start
        self.sync: WeightSync | None = None
        self.on_dead: Callable[[], object] = lambda: None

    def start(self) -> list[ray.ObjectRef]:
        """Start vLLM in every engine; the refs of their `EngineStartInfo`."""
        return [e.start.remote() for e in self.engines]

    def connect(self, trainer: TrainerGroup) -> None:
        """A weight-broadcast group of `trainer` and the live engines."""
        self.sync = actors.create_weight_sync(self.cfg, trainer, self.live())
        self.sync.connect()

    def reform_group(self) -> None:
        """A new broadcast group of the trainer and the live engines (the old one counts the dead
        engines' workers: a broadcast would hang)."""
        self.sync.engines = self.live()
        self.sync.connect()

    def live(self) -> list:
        """The engines serving now (replacements still starting left out)."""
        return [e for i, e in enumerate(self.engines) if i not in self.starting]

    def slot_of(self, engine: Any) -> int:
        return next(i for i, e in enumerate(self.engines) if e is engine)

    def health_probes(self) -> list[tuple[int, ray.ObjectRef]]:
        return [(i, e.health.remote()) for i, e in enumerate(self.engines) if i not in self.starting]

    def activity(self) -> dict[Any, EngineActivity]:
        """Each live engine's activity totals, by its handle."""
        try:
            engines = self.live()
            each = ray.get([e.activity.remote() for e in engines])
        except ray.exceptions.RayActorError:
            self.on_dead()
            engines = self.live()
            each = ray.get([e.activity.remote() for e in engines])
        return dict(zip(engines, each))

    def replace(self, i: int, event: FaultEvent, restart: int) -> None:
        """Start a new engine in slot `i`'s bundle; the run goes on meanwhile (the dead one's loops
        already moved to the live engines). `poll_starting` takes it in, with `event`."""
        t0 = time.monotonic()
        try:  # what is left of its vLLM processes stops with it
            ray.get(self.engines[i].shutdown.remote(), timeout=10)
        except Exception:  # dead, or hung
            pass
        kill(self.engines[i])
        self.engines[i] = actors.create_engine(self.cfg, i, actors.slot(self.slots, i), restart=restart)
        self.starting[i] = (self.engines[i].start.remote(), event, t0)

    def poll_starting(self, block: bool = False) -> list[FaultEvent]:
        """Take in the replacements that have started (with `block`, wait for one): a new
        broadcast group with them. Returns their completed fault events."""
        if not self.starting:
            return []
        refs = {ref: i for i, (ref, _, _) in self.starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=1 if block else len(refs), timeout=None if block else 0)
        events = []
        for ref in ready:
            i = refs[ref]
            _, event, t0 = self.starting.pop(i)
            try:
                ray.get(ref)
            except Exception as e:
                raise TrainingError(f"engine-{i}'s replacement failed to start: {error_line(e)}") from None
            event.phases_s["start_engine_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            self.reform_group()
            event.phases_s["weight_group_s"] = time.monotonic() - t1
            events.append(event)
        return events

    def route_joined(self, workers: WorkerPool, version: int) -> None:
        """After a sync every engine holds the policy: replacements join the workers' routing."""
        for i, engine in enumerate(self.engines):
            if self.routed[i] is not engine and i not in self.starting:
                self.routed[i] = engine
                workers.route(i, engine)
                logger.info("engine-%d's replacement holds version %d: routed to", i, version)

    def pause(self) -> list:
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

    def shutdown(self) -> None:
        """Stop every engine's vLLM processes, then the actors."""
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception as err:  # a dead engine cannot shut down; it is killed below
                logger.warning("engine shutdown: %s", error_line(err))
        for e in self.engines:
            kill(e)

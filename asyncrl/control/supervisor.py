"""The supervisor: health checks of the engines and rollout workers, their replacement within the
run's restart limits, and the record of every fault (invariant 6).

A dead engine is replaced in its bundle while the run goes on (its loops already moved to the
live engines); it joins a new broadcast group once started and the workers' routing once a
sync gave it the policy. A dead rollout worker is replaced and every prompt it held continues
from its group in the worker's last mirror (taken at every sync), or from its prompt
(`Prompts.restart_lost`, given by the driver: it keeps the ledger). A dead
trainer rank is the driver's to handle (the whole run goes back to a checkpoint); it counts
and records that fault here too. Each fault is a `FaultEvent`: logged, counted in the
metrics, appended to RUN_DIR/faults.jsonl and listed in summary.json; past
`run.max_*_restarts` the run stops with one line saying why.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import ray

from asyncrl.config.schema import RunConfig
from asyncrl.control import TrainingError
from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.service_pool import ServicePool
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.messages import FaultEvent, PendingGroupState, ScaleEvent, error_line
from asyncrl.reward.services import SPECS, restart_setting

logger = logging.getLogger(__name__)



class Supervisor:
    def __init__(self, run: RunConfig, run_dir: Path, engines: EnginePool, workers: WorkerPool,
                 services: ServicePool, step: Callable[[], int],
                 restart_lost_prompts: Callable[[list[PendingGroupState]], tuple[int, int, int]]):
        self.run, self.run_dir, self.engines, self.workers = run, Path(run_dir), engines, workers
        self.services = services
        self.step = step  # the run's current step, for the events
        self.restart_lost_prompts = restart_lost_prompts  # (a dead worker's mirror) -> restarted, resumed, kept
        self.restarts: collections.Counter[str] = collections.Counter()  # kind -> replacements so far
        self.faults: list[FaultEvent] = []
        self.scale_events: list[ScaleEvent] = []
        engines.on_dead = workers.on_dead = self.check_health

    def check_health(self) -> bool:
        """Ask every engine, rollout worker and served model's replica whether it is alive (a hung
        one does not answer within run.health_timeout_s); replace the dead. Returns whether any
        was replaced."""
        timeout = self.run.health_timeout_s
        self.poll_starting()
        probes = [("engine", i, ref) for i, ref in self.engines.health_probes()]
        probes += [("rollout_worker", i, ref) for i, ref in enumerate(self.workers.health_probes())]
        probes += self.services.health_probes()
        ready, _ = ray.wait([ref for *_, ref in probes], num_returns=len(probes), timeout=timeout)
        dead: dict[str, dict[int, str]] = {"engine": {}, "rollout_worker": {}, **{n: {} for n in self.services.served}}
        for kind, i, ref in probes:
            if ref not in ready:
                dead[kind][i] = f"no answer to a health check within {timeout:g}s (run.health_timeout_s)"
                continue
            try:
                ray.get(ref)
            except Exception as e:
                dead[kind][i] = error_line(e)
        if dead["engine"]:
            self.replace_engines(dead["engine"])
        for name in self.services.served:  # before the workers: a new worker gets the new replica
            for i, why in dead[name].items():
                self._replace_service(name, i, why)
        for i, why in dead["rollout_worker"].items():
            self._replace_worker(i, why)
        return any(dead.values())

    def replace_engines(self, why: dict[int, str]) -> None:
        """Replace the engines of these slots and form a new broadcast group without them; with no
        live engine left, wait for a replacement (nothing can generate)."""
        for i, reason in why.items():
            self.count_restart("engine", "max_engine_restarts", reason)
            logger.warning("engine-%d failed: %s; starting a replacement", i, reason)
            self.engines.replace(i, FaultEvent("engine", f"engine-{i}", self.step(), reason))
        self.engines.reform_group()
        if not self.engines.live():
            self.poll_starting(block=True)

    def poll_starting(self, block: bool = False) -> None:
        """Take in the replacement engines that have started (with `block`, wait for one)."""
        for event in self.engines.poll_starting(block):
            self.record(event)

    def end_starting(self) -> None:
        """The run ends: engines the cluster has no room for are cancelled (a scale-up that had
        only those left is recorded with them as cancelled), those placed are waited for."""
        for event in self.engines.cancel_unplaced():
            self.record(event)
        while self.engines.starting:
            self.poll_starting(block=True)

    def _replace_worker(self, i: int, why: str) -> None:
        """A new worker in the dead one's bundle; every prompt the dead one held starts again."""
        self.count_restart("rollout_worker", "max_worker_restarts", why)
        event = FaultEvent("rollout_worker", f"rollout-worker-{i}", self.step(), why)
        logger.warning("rollout-worker-%d failed: %s; starting a replacement", i, why)
        t0 = time.monotonic()
        mirrored = self.workers.mirrored(i)
        last = self.workers.replace(i, self.engines.routed, restart=self.restarts["rollout_worker"])
        t1 = time.monotonic()
        event.prompts_restarted, event.loops_resumed, event.tokens_kept = self.restart_lost_prompts(mirrored)
        if last is not None:
            event.tokens_lost = max(0, last.pending_tokens - event.tokens_kept)
        event.phases_s = {"start_worker_s": t1 - t0, "restart_prompts_s": time.monotonic() - t1}
        self.record(event)

    def _replace_service(self, name: str, i: int, why: str) -> None:
        """A new replica of a served model; the samples the dead one was scoring got reward 0
        (counted as <name>_error), their prompts go on."""
        self.count_restart(name, restart_setting(name), why)
        actor = f"{SPECS[name].actor}-{i}"
        event = FaultEvent(name, actor, self.step(), why)
        logger.warning("%s failed: %s; starting a replacement", actor, why)
        t0 = time.monotonic()
        new = self.services.replace(name, i, restart=self.restarts[name])
        self.workers.use_service(name, i, new)
        event.phases_s = {f"start_{name}_s": time.monotonic() - t0}
        self.record(event)

    def count_restart(self, kind: str, setting: str, why: str) -> None:
        """Count one more replacement of `kind`, or stop the run past its limit (run.<setting>)."""
        limit = getattr(self.run, setting)
        if self.restarts[kind] >= limit:
            raise TrainingError(f"{kind.replace('_', ' ')} failed ({why}) after {self.restarts[kind]} "
                                f"replacement(s): run.{setting}={limit} reached")
        self.restarts[kind] += 1

    def record(self, event: FaultEvent | ScaleEvent) -> None:
        """Log the event, count it, and append it to RUN_DIR/faults.jsonl or scale.jsonl (kept across resumes)."""
        phases = {k: round(v, 2) for k, v in event.phases_s.items()}
        if isinstance(event, ScaleEvent):
            self.scale_events.append(event)
            logger.warning("engines %d -> %d (%s) in %.1fs: %s%s", event.engines_before, event.engines_after,
                           event.reason, event.scale_s, phases,
                           f"; {len(event.cancelled)} never placed, cancelled" if event.cancelled else "")
        else:
            self.faults.append(event)
            logger.warning("recovered from a %s fault (%s) in %.1fs: %s", event.kind, event.actor, event.recovery_s,
                           phases)
        with open(self.run_dir / ("scale.jsonl" if isinstance(event, ScaleEvent) else "faults.jsonl"), "a") as f:
            f.write(json.dumps(event.to_dict()) + "\n")

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"faults/{kind}": n for kind, n in self.restarts.items()}
        if self.faults:
            out["faults/last_recovery_s"] = self.faults[-1].recovery_s
        out["engines/count"] = self.engines.count()
        out["engines/live"] = len(self.engines.live())
        if self.scale_events:
            out["engines/scale_events"] = len(self.scale_events)
            out["engines/last_scale_s"] = self.scale_events[-1].scale_s
        return out

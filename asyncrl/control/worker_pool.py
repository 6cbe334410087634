"""The rollout workers of a run, called as one by typed methods.

Every call goes to all workers (`submit` and `restore` deal their rows out round-robin). A
worker found dead during a call is handed to `on_dead` (the supervisor's health check, which
replaces it) and the call is made again on its replacement. Stats are fetched once a step
(`stats`); the last report of a replaced worker is kept, so the run's totals go on.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from asyncrl import actors
from asyncrl.config.schema import Config
from asyncrl.control import kill
from asyncrl.control.service_pool import ServicePool
from asyncrl.interfaces import EngineHandle, QueueHandle, ServiceHandle
from asyncrl.messages import Admitted, PendingGroupState, WorkerStats
from asyncrl.tasks import Problem


class WorkerPool:
    def __init__(self, cfg: Config, queue: QueueHandle, engines: list[EngineHandle | None], slots: list | None,
                 services: ServicePool | None = None, restart: int = 0):
        """`rollout.num_workers` workers routing to `engines` (None: a slot whose engine was
        removed), emitting to `queue`, in `slots` (their placement-group bundles), scoring with the
        run's served models too (`services`)."""
        self.cfg, self.queue, self.slots, self.services = cfg, queue, slots, services
        self.handles = actors.create_rollout_workers(cfg, engines, queue, slots, restart=restart,
                                                     services=self._services())
        self.last_stats: dict[int, WorkerStats] = {}  # each live worker's latest report
        self.retired_stats: list[WorkerStats] = []  # the last reports of replaced workers
        self.mirrors: list[ray.ObjectRef | None] = [None] * len(self.handles)  # each worker's unfinished groups
        self.on_dead: Callable[[], object] = lambda: None

    def _each(self, call: Callable[..., ray.ObjectRef], per_worker: list[tuple] | None = None) -> list:
        """`call(worker, *per_worker[i])` on every worker, their answers in order."""
        args = per_worker or [()] * len(self.handles)
        refs = [call(w, *a) for w, a in zip(self.handles, args)]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                self.on_dead()
                out.append(ray.get(call(self.handles[i], *args[i])))
        return out

    def _deal(self, items: list, *also: list) -> list[tuple]:
        """Each worker's share of `items` (and the same share of each list in `also`), round-robin."""
        n = len(self.handles)
        return [(items[k::n], *(x[k::n] for x in also)) for k in range(n)]

    # -- the rollout workers' API, on all of them --------------------------------------

    def submit(self, problems: list[Problem]) -> Admitted:
        return Admitted.merge(self._each(lambda w, ps: w.submit.remote(ps), self._deal(problems)))

    def restore(self, pending: list[PendingGroupState], problems: list[Problem]) -> Admitted:
        """Continue checkpointed groups (`problems[i]` is `pending[i]`'s)."""
        return Admitted.merge(self._each(lambda w, gs, ps: w.restore.remote(gs, ps), self._deal(pending, problems)))

    def interrupt(self) -> None:
        self._each(lambda w: w.interrupt.remote())

    def drain(self) -> None:
        self._each(lambda w: w.drain.remote())

    def resume_interrupted(self) -> int:
        """Loops resumed."""
        return sum(self._each(lambda w: w.resume_interrupted.remote()))

    def checkpoint(self) -> list[PendingGroupState]:
        return [g for groups in self._each(lambda w: w.checkpoint.remote()) for g in groups]

    def pending_prompts(self) -> set[str]:
        return {p for ps in self._each(lambda w: w.pending_prompts.remote()) for p in ps}

    def route(self, index: int, engine: EngineHandle) -> None:
        """Every worker routes to `engine` in engine slot `index`."""
        self._each(lambda w: w.replace_engine.remote(index, engine))

    def retire(self, index: int) -> None:
        """No worker routes anything more to engine slot `index`."""
        self._each(lambda w: w.retire_engine.remote(index))

    def stats(self) -> list[WorkerStats]:
        """Every live worker's report, then the last reports of the workers they replaced."""
        stats = self._each(lambda w: w.get_stats.remote())
        self.last_stats = dict(enumerate(stats))
        return stats + self.retired_stats

    def mirror(self) -> None:
        """Each worker's unfinished groups as they stand (`RolloutWorker.mirror`), kept for a
        replacement: in the object store, owned by the driver, not fetched unless a worker dies."""
        refs = [w.mirror.remote() for w in self.handles]
        ray.wait(refs, num_returns=len(refs), fetch_local=False)
        self.mirrors = refs

    def mirrored(self, i: int) -> list[PendingGroupState]:
        """Worker i's groups as of the last `mirror` (none if it has not been mirrored)."""
        ref = self.mirrors[i]
        try:
            return ray.get(ref) if ref is not None else []
        except Exception:  # it died during the mirror
            return []

    def _services(self) -> dict[str, list[ServiceHandle]]:
        return self.services.handles() if self.services is not None else {}

    def use_service(self, name: str, index: int, actor: ServiceHandle) -> None:
        """Every worker scores with `actor` as replica `index` of served model `name` from now on."""
        self._each(lambda w: w.replace_service.remote(name, index, actor))

    def health_probes(self) -> list[ray.ObjectRef]:
        return [w.health.remote() for w in self.handles]

    # -- replacing ---------------------------------------------------------------------

    def replace(self, i: int, engines: list[EngineHandle | None], restart: int) -> WorkerStats | None:
        """A new worker in worker `i`'s bundle (the old one killed); returns the old one's last report."""
        kill(self.handles[i])
        last = self.last_stats.pop(i, None)
        if last is not None:
            self.retired_stats.append(last)
        self.handles[i] = actors.create_rollout_worker(self.cfg, i, engines, self.queue, actors.slot(self.slots, i),
                                                       restart=restart, services=self._services())
        self.mirrors[i] = None
        ray.get(self.handles[i].health.remote())  # constructed
        return last

    def restart_all(self, queue: QueueHandle, engines: list[EngineHandle | None], restart: int) -> None:
        """New workers for all (the old ones killed), emitting to a new `queue`."""
        for w in self.handles:
            kill(w)
        self.retired_stats += list(self.last_stats.values())
        self.last_stats.clear()
        self.queue = queue
        self.handles = actors.create_rollout_workers(self.cfg, engines, queue, self.slots, restart=restart,
                                                     services=self._services())
        self.mirrors = [None] * len(self.handles)

    def kill(self) -> None:
        for w in self.handles:
            kill(w)

    def shutdown(self) -> None:
        """The run is over."""
        for actor in self.handles:
            kill(actor)

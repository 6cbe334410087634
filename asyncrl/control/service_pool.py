"""The run's served models (asyncrl/reward/services.py: reward models, judges, a distillation
teacher): started at setup, probed and replaced for the supervisor as the engines are
(EnginePool), shut down at the end. The rollout workers get their actors by name (`handles`)
and each replacement (WorkerPool.use_service)."""

from __future__ import annotations

import ray

from asyncrl import actors
from asyncrl.config.schema import Config
from asyncrl.control import kill
from asyncrl.interfaces import ServiceHandle
from asyncrl.reward.services import Served, served


class ServicePool:
    def __init__(self, cfg: Config, slots: dict[str, list[actors.Options]] | None = None):
        """Start every served model of `cfg`, each replica in its bundle (`slots`, by name: the
        run's placement), one service after another (a service's replicas at once), and wait until
        all serve."""
        self.cfg, self.slots = cfg, slots or {}
        self.served: dict[str, Served] = {s.name: s for s in served(cfg)}
        self.actors: dict[str, list[ServiceHandle]] = {
            name: [actors.create_service(cfg, s, i, actors.slot(self.slots.get(name), i)) for i in range(s.replicas)]
            for name, s in self.served.items()}
        for name, replicas in self.actors.items():
            actors.start_services(self.served[name], replicas)

    def handles(self) -> dict[str, list[ServiceHandle]]:
        """Each service's live actors, by name: what a rollout worker scores with."""
        return {name: list(replicas) for name, replicas in self.actors.items()}

    def health_probes(self) -> list[tuple[str, int, ray.ObjectRef]]:
        """(service, replica, its health call) of every replica."""
        return [(name, i, a.health.remote()) for name, replicas in self.actors.items() for i, a in enumerate(replicas)]

    def replace(self, name: str, index: int, restart: int) -> ServiceHandle:
        """A new replica `index` of service `name` in the dead one's bundle (the old one killed), serving."""
        kill(self.actors[name][index])
        service = self.served[name]
        new = actors.create_service(self.cfg, service, index, actors.slot(self.slots.get(name), index), restart)
        actors.start_services(service, [new], first=index)
        self.actors[name][index] = new
        return new

    def shutdown(self) -> None:
        for replicas in self.actors.values():
            for actor in replicas:
                kill(actor)

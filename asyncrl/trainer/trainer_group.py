"""TrainerGroup: the trainer's ranks as Ray actors, called as one.

Every rank gets every call with the same arguments (megatron ranks must act in step);
`call` returns rank 0's answer. Ranks are named `trainer-rank-<i>` for the dashboard.
"""

from __future__ import annotations

from typing import Any

import ray

from asyncrl.config.schema import Config
from asyncrl.trainer.trainer_rank import TrainerRank, trainer_rank_options


class TrainerGroup:
    def __init__(self, cfg: Config, scheduling: list[dict[str, Any]] | None = None):
        t = cfg.trainer
        self.world_size = t.tensor_parallel_size * t.pipeline_parallel_size * t.data_parallel_size
        actor = ray.remote(TrainerRank)
        self.ranks = [
            actor.options(**trainer_rank_options(cfg, rank), **(scheduling[rank] if scheduling else {}))
            .remote(cfg, rank, self.world_size)
            for rank in range(self.world_size)
        ]

    def setup(self) -> dict[str, Any]:
        """Form the trainer's process group (rank 0 hosts it) and load the model on every rank."""
        host, port = ray.get(self.ranks[0].address.remote())
        return ray.get([r.setup.remote(host, port) for r in self.ranks])[0]

    def submit(self, method: str, *args: Any) -> list[ray.ObjectRef]:
        """Start `method` on every rank; returns the refs (rank 0 first)."""
        return [getattr(r, method).remote(*args) for r in self.ranks]

    def call(self, method: str, *args: Any) -> Any:
        """Run `method` on every rank and return rank 0's result."""
        return ray.get(self.submit(method, *args))[0]

    def shutdown(self) -> None:
        try:
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=30)
        except Exception:  # a dead rank cannot shut down cleanly; it is killed below either way
            pass
        for r in self.ranks:
            ray.kill(r)

"""The control plane the driver runs on: the engine pool, the worker pool, the supervisor that
keeps them alive, the weight sync between the trainer and the engines, the run's checkpoints and
its step metrics."""

from typing import Any

import ray


class TrainingError(RuntimeError):
    """A run that cannot go on (an actor died past its restart limit, an invariant broke); the
    message says why."""


def kill(actor: Any) -> None:
    """Kill a Ray actor; one already gone is no error."""
    try:
        ray.kill(actor)
    except Exception:  # already gone
        pass

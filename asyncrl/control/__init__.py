"""The control plane the driver runs on: the engine pool, the worker pool, the supervisor that
keeps them alive, the weight sync between the trainer and the engines, the run's checkpoints and
its step metrics."""


class TrainingError(RuntimeError):
    """A run that cannot go on (an actor died past its restart limit, an invariant broke); the
    message says why."""

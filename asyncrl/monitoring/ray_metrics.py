"""Ray metrics (`ray.util.metrics`) for the dashboard and Prometheus: set in the
message-queue actor (the queue's own gauges) and pushed there by the driver (the rest),
readable from the node's metrics endpoint as `ray_asyncrl_*`."""

from __future__ import annotations

GAUGES = {
    "asyncrl_queue_size": "trajectory groups waiting in the message queue",
    "asyncrl_policy_version": "current policy version (weight syncs so far)",
    "asyncrl_staleness_max": "largest staleness (versions) of a token in the last train step",
    "asyncrl_samples_per_s": "trained samples per second over the last step",
    "asyncrl_trainer_idle_ratio": "fraction of the last step the trainer waited for data",
    "asyncrl_engine_idle_ratio": "fraction of the last step the engines had no request",
    "asyncrl_engine_utilization": "mean requests running on an engine over its concurrency, last step",
    "asyncrl_reward_mean": "mean reward of the last step's trajectories",
}


class RayGauges:
    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        self._gauges = {name: Gauge(name, description=desc) for name, desc in GAUGES.items()}

    def set(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if name in self._gauges and value is not None:
                self._gauges[name].set(float(value))

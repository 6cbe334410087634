"""Elastic engines: a running job grows and shrinks its engines, on request or by rule.

    asyncrl scale RUN_DIR --engines N      # ask the run in RUN_DIR for N engines
    engine.autoscale.enabled=true          # grow while the trainer waits for data, shrink while engines idle

`asyncrl scale` reaches the driver through the run's `RunControl` actor
(asyncrl/run_control.py, which also carries `asyncrl stop`); the driver reads the
requests once a step, after the step's metrics, and hands an engine count here (`after_step`).

Growing starts new engines while the run goes on, each in a placement group of its own (on a
cluster with Ray's autoscaler, possibly a new node); they join the weight-broadcast group once
started and the workers' routing after the next sync gave them the policy. Shrinking removes
the engines of the highest slots the way a fault does, on purpose: the workers stop routing
to them, their requests are aborted and each loop continues from its snapshot on another
engine (nothing restarts from its prompt). A request made while engines start waits until
they have started. Each change is a `ScaleEvent` with its phase times in RUN_DIR/scale.jsonl,
counted in the metrics (`engines/...`).
"""

from __future__ import annotations

import collections
import logging
from typing import Any

from asyncrl.config.schema import AutoscaleConfig
from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.supervisor import Supervisor
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.messages import ScaleEvent

logger = logging.getLogger(__name__)


def autoscale_target(idle: list[tuple[float, float]], engines: int, rule: AutoscaleConfig) -> int:
    """The engine count the rule asks for, from the last steps' (trainer idle, engines idle)
    shares: one more while the trainer waited at least `grow_when_trainer_idle` of its time on
    average, one fewer while the engines idled at least `shrink_when_engines_idle` and the
    trainer did not wait; within [min_engines, max_engines]. Needs a full window."""
    if len(idle) < rule.window_steps:
        return engines
    window = idle[-rule.window_steps:]
    trainer = sum(t for t, _ in window) / len(window)
    engine = sum(e for _, e in window) / len(window)
    if trainer >= rule.grow_when_trainer_idle:
        return min(rule.max_engines, engines + 1)
    if engine >= rule.shrink_when_engines_idle:
        return max(rule.min_engines, engines - 1)
    return engines


class Elastic:
    def __init__(self, rule: AutoscaleConfig, engines: EnginePool, workers: WorkerPool, supervisor: Supervisor):
        self.engines, self.workers, self.supervisor = engines, workers, supervisor
        self.rule = rule  # engine.autoscale
        self.idle: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.rule.window_steps)
        self.cooldown = 0  # steps before the rule may fire again
        self.wanted: tuple[int, str] | None = None  # a request not applied yet, and its reason

    def after_step(self, step: int, metrics: dict[str, Any], asked: int | None = None) -> None:
        """Apply `asked` engines (`asyncrl scale`), else the autoscale rule's count, unless engines
        are still starting (then it waits)."""
        if asked is not None:
            self.wanted = (asked, "asyncrl scale")
        if self.rule.enabled:
            self.idle.append((metrics.get("idle/trainer", 0.0), metrics.get("idle/engines", 0.0)))
            self.cooldown = max(0, self.cooldown - 1)
            target = autoscale_target(list(self.idle), self.engines.count(), self.rule)
            if self.wanted is None and self.cooldown == 0 and target != self.engines.count():
                trainer, engines = (sum(x) / len(self.idle) for x in zip(*self.idle))
                self.wanted = (target, f"autoscale: idle trainer {trainer:.2f}, engines {engines:.2f} "
                                       f"over {len(self.idle)} steps")
        if self.wanted is None or self.engines.starting:
            return
        (n, reason), self.wanted = self.wanted, None
        self.scale(n, reason, step)

    def scale(self, n: int, reason: str, step: int) -> None:
        before = self.engines.count()
        if n == before:
            return
        event = ScaleEvent("up" if n > before else "down", before, n, step, reason)
        logger.info("engines %d -> %d (%s)", before, n, reason)
        if n > before:  # recorded once the last one started (Supervisor.poll_starting)
            self.engines.grow(n - before, event)
        else:
            self.engines.shrink(before - n, self.workers, event)
            self.supervisor.record(event)
        self.idle.clear()
        self.cooldown = self.rule.cooldown_steps

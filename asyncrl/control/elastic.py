"""Elastic engines: a running job grows and shrinks its engines, on request or by rule.

    asyncrl scale RUN_DIR --engines N      # ask the run in RUN_DIR for N engines
    engine.autoscale.enabled=true          # grow while the trainer waits for data, shrink while engines idle

`asyncrl scale` talks to `RunControl`, a named Ray actor the driver starts in a namespace of
the run's own; RUN_DIR/control.json (mode 0600) says where: the Ray cluster's address, the
namespace and the name. Whoever can reach the Ray cluster can scale it, as with `ray job
submit`. The driver reads a request once a step, after the step's metrics (`after_step`).

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

import argparse
import collections
import json
import logging
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from asyncrl.config.schema import AutoscaleConfig, Config
from asyncrl.config.validate import MAX_WORKERS
from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.supervisor import Supervisor
from asyncrl.control.worker_pool import WorkerPool, kill
from asyncrl.messages import ScaleEvent

logger = logging.getLogger(__name__)

CONTROL_FILE = "control.json"


class RunControl:
    """The run's mailbox for `asyncrl scale` (a named Ray actor): the newest request wins."""

    def __init__(self) -> None:
        self.engines: int | None = None

    def request_engines(self, n: int) -> None:
        if not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"--engines {n}: must be in [1, {MAX_WORKERS}]")
        self.engines = n

    def take_request(self) -> int | None:
        n, self.engines = self.engines, None
        return n


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
    def __init__(self, cfg: Config, run_dir: Path, engines: EnginePool, workers: WorkerPool, supervisor: Supervisor,
                 take_request: Callable[[], int | None] | None = None):
        """`take_request`: where requests come from (default: a RunControl actor of the run's own,
        announced in RUN_DIR/control.json)."""
        self.cfg, self.engines, self.workers, self.supervisor = cfg, engines, workers, supervisor
        self.rule = cfg.engine.autoscale
        self.idle: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.rule.window_steps)
        self.cooldown = 0  # steps before the rule may fire again
        self.wanted: tuple[int, str] | None = None  # a request not applied yet, and its reason
        self.control = None
        if take_request is None:
            self.control = start_run_control(Path(run_dir))
            take_request = lambda: ray.get(self.control.take_request.remote())  # noqa: E731
        self.take_request = take_request

    def after_step(self, step: int, metrics: dict[str, Any]) -> None:
        """Take a request (`asyncrl scale`, else the autoscale rule's) and apply it unless
        engines are still starting (then it waits)."""
        asked = self.take_request()
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

    def close(self) -> None:
        if self.control is not None:
            kill(self.control)


def start_run_control(run_dir: Path) -> Any:
    """The run's RunControl actor, in a namespace of its own, announced in RUN_DIR/control.json."""
    where = {"address": ray.get_runtime_context().gcs_address, "namespace": f"asyncrl-{uuid.uuid4().hex[:12]}",
             "name": "asyncrl-control"}
    control = ray.remote(RunControl).options(name=where["name"], namespace=where["namespace"], num_cpus=0).remote()
    path = run_dir / CONTROL_FILE
    path.write_text(json.dumps(where) + "\n")
    path.chmod(0o600)
    return control


def request_engines(run_dir: Path, n: int) -> None:
    """Ask the run in `run_dir` for `n` engines (through its RunControl actor)."""
    path = Path(run_dir) / CONTROL_FILE
    if not path.is_file():
        raise SystemExit(f"asyncrl scale: {path} not found (is a run going on in {run_dir}?)")
    where = json.loads(path.read_text())
    ray.init(address=where["address"], namespace=where["namespace"], logging_level=logging.WARNING,
             log_to_driver=False)
    try:
        control = ray.get_actor(where["name"], namespace=where["namespace"])
    except ValueError:
        raise SystemExit(f"asyncrl scale: the run of {run_dir} is over (no {where['name']} on its cluster)") from None
    ray.get(control.request_engines.remote(n))


def main() -> None:
    parser = argparse.ArgumentParser(prog="asyncrl scale", description="grow or shrink a running job's engines")
    parser.add_argument("run_dir", type=Path, help="the run's output directory (run.output_dir)")
    parser.add_argument("--engines", type=int, required=True, help="how many engines the run should have")
    args = parser.parse_args()
    if not 1 <= args.engines <= MAX_WORKERS:
        parser.error(f"--engines {args.engines}: must be in [1, {MAX_WORKERS}]")
    request_engines(args.run_dir, args.engines)
    print(f"asked the run in {args.run_dir} for {args.engines} engine(s); it applies the request after its "
          f"current step (RUN_DIR/scale.jsonl records it)")

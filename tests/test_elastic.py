"""Elastic engines: the autoscale rule (values by hand), when a request is applied, and the
routing of a worker as engines are added and removed. The real stack grows and shrinks in
tests/test_train_e2e.py's run (through `asyncrl scale`)."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from asyncrl.config.schema import AutoscaleConfig
from asyncrl.control.elastic import Elastic, autoscale_target
from asyncrl.messages import ControlRequest
from asyncrl.rollout.router import EngineRouter
from asyncrl.run_config import load_config
from asyncrl.run_control import RunControl

RULE = AutoscaleConfig(enabled=True, min_engines=1, max_engines=3, grow_when_trainer_idle=0.3,
                       shrink_when_engines_idle=0.5, window_steps=2, cooldown_steps=3)


def test_the_autoscale_rule_grows_on_a_waiting_trainer_and_shrinks_on_idle_engines():
    assert autoscale_target([(0.9, 0.0)], 1, RULE) == 1  # half a window: no decision
    # trainer idle (0.2 + 0.5) / 2 = 0.35 >= 0.3: one more engine
    assert autoscale_target([(0.2, 0.0), (0.5, 0.0)], 1, RULE) == 2
    # the window is the last 2 steps: (0.1 + 0.4) / 2 = 0.25 < 0.3, engines (0.6 + 0.5) / 2 = 0.55 >= 0.5: one fewer
    assert autoscale_target([(0.9, 0.0), (0.1, 0.6), (0.4, 0.5)], 2, RULE) == 1
    # a waiting trainer wins over idle engines; the bounds hold
    assert autoscale_target([(0.3, 0.9), (0.3, 0.9)], 2, RULE) == 3
    assert autoscale_target([(0.3, 0.0), (0.3, 0.0)], 3, RULE) == 3
    assert autoscale_target([(0.0, 0.9), (0.0, 0.9)], 1, RULE) == 1
    assert autoscale_target([(0.1, 0.4), (0.1, 0.4)], 2, RULE) == 2  # neither: stay


class Pool:
    """A scripted engine pool: grow starts engines that `started()` brings in; shrink removes at once."""

    def __init__(self, n: int):
        self.n, self.starting, self.calls = n, {}, []

    def count(self) -> int:
        return self.n

    def grow(self, n, event):
        self.calls.append(("grow", n, event.reason))
        self.n += n
        self.starting = {i: event for i in range(n)}

    def shrink(self, n, workers, event):
        self.calls.append(("shrink", n, event.reason))
        self.n -= n

    def started(self):
        self.starting = {}


def elastic(pool: Pool, rule: AutoscaleConfig):
    recorded = []
    return Elastic(rule, pool, None, SimpleNamespace(record=recorded.append)), recorded


def test_autoscale_waits_a_window_and_a_cooldown_between_changes():
    pool = Pool(1)
    e, recorded = elastic(pool, RULE)
    waiting = {"idle/trainer": 0.8, "idle/engines": 0.0}
    e.after_step(1, waiting)
    assert pool.calls == []  # one step of two
    e.after_step(2, waiting)
    assert pool.calls == [("grow", 1, "autoscale: idle trainer 0.80, engines 0.00 over 2 steps")]
    pool.started()
    for step in (3, 4):  # a full window again, but within the cooldown of 3 steps
        e.after_step(step, waiting)
    assert len(pool.calls) == 1
    e.after_step(5, waiting)
    assert pool.calls[-1][:2] == ("grow", 1) and pool.n == 3
    pool.started()
    idle = {"idle/trainer": 0.0, "idle/engines": 0.9}
    for step in range(6, 9):
        e.after_step(step, idle)
    assert pool.calls[-1][:2] == ("shrink", 1) and pool.n == 2
    assert [ev.direction for ev in recorded] == ["down"]  # a scale-up is recorded when its engines started


def test_a_request_wins_over_the_rule_and_waits_for_engines_still_starting():
    pool = Pool(2)
    e, recorded = elastic(pool, dataclasses.replace(RULE, enabled=False))
    e.after_step(1, {}, asked=4)  # `asyncrl scale --engines 4`, handed over by the driver
    assert pool.calls == [("grow", 2, "asyncrl scale")] and pool.starting
    e.after_step(2, {})
    e.after_step(3, {})
    e.after_step(4, {}, asked=1)  # asks for 1 while two engines still start: it waits
    assert len(pool.calls) == 1 and e.wanted == (1, "asyncrl scale")
    pool.started()
    e.after_step(5, {})
    assert pool.calls[-1] == ("shrink", 3, "asyncrl scale") and pool.n == 1
    assert recorded[-1].engines_before == 4 and recorded[-1].engines_after == 1 and recorded[-1].step == 5


def test_run_control_keeps_the_newest_request_and_refuses_nonsense():
    control = RunControl()
    assert control.take_request() == ControlRequest()
    control.request_engines(3)
    control.request_engines(2)
    control.request_stop()
    assert control.take_request() == ControlRequest(engines=2, stop=True)
    assert control.take_request() == ControlRequest()
    with pytest.raises(ValueError, match="must be in"):
        control.request_engines(0)


def test_autoscale_settings_are_checked():
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="engine.autoscale.max_engines"):
        load_config(["recipe=arith", "engine.autoscale.enabled=true", "engine.autoscale.min_engines=3",
                     "engine.autoscale.max_engines=2"])
    with pytest.raises(ConfigError, match="engine.num_engines"):
        load_config(["recipe=arith", "engine.autoscale.enabled=true", "engine.autoscale.min_engines=2",
                     "engine.autoscale.max_engines=4"])


def test_a_worker_routes_around_a_removed_engine_and_to_an_added_one():
    router = EngineRouter(["e0", "e1"])
    router.retire(1)
    assert {router.pick() for _ in range(4)} == {0}
    router.replace(2, "e2")  # an added engine: a new slot
    assert router.engines == ["e0", "e1", "e2"] and len(router.outstanding) == len(router.assigned) == 3
    assert [router.pick() for _ in range(6)] == [2, 2, 2, 2, 0, 2]  # the least used first; never the removed
    router.retire(0)
    router.retire(2)
    assert not router._any_live.is_set()  # every engine removed: requests wait for one
    router.replace(1, "e1b")  # a removed slot used again
    assert router._any_live.is_set() and asyncio.run(router.live_engine()) == 1


def test_engines_the_cluster_cannot_place_are_cancelled_when_the_run_ends(ray_cluster):
    """A scale-up past the cluster's room (more engines than it has CPUs, or nodes that never
    come) leaves engines waiting for a place. When the run ends they are cancelled, not waited
    for: killed, their placement groups removed, the scale-up recorded with them as cancelled;
    the shutdown after that does not wait on them either."""
    import ray
    from ray.util import placement_group_table

    from asyncrl import actors
    from asyncrl.control.engine_pool import EnginePool
    from asyncrl.messages import ScaleEvent

    # simulated engines of 3 CPUs each: the run's own bundles take 3 + 2 + 1 of the session
    # cluster's 8 CPUs, and no added engine fits in the 2 left
    cfg = load_config(["recipe=arith", "engine=sim", "trainer=sim", "engine.num_engines=1",
                       "engine.num_cpus_per_engine=3", "trainer.num_cpus_per_rank=2", "rollout.num_workers=1",
                       "rollout.num_cpus_per_worker=1"])
    placement = actors.place(cfg)
    try:
        pool = EnginePool(cfg, placement.engine)
        ray.get(pool.start())
        event = ScaleEvent("up", 1, 3, step=4, reason="asyncrl scale")
        pool.grow(2, event)
        groups = [group for _, group in pool.own_groups.values()]
        added = [pool.engines[i] for i in event.slots]
        assert sorted(pool.starting) == event.slots == [1, 2]
        assert pool.cancel_unplaced() == [event]
        assert (event.cancelled, event.engines_after, pool.starting, pool.own_groups) == ([1, 2], 1, {}, {})
        assert pool.engines[1:] == [None, None] and pool.count() == 1
        assert [placement_group_table(g)["state"] for g in groups] == ["REMOVED", "REMOVED"]
        for engine in added:
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(engine.health.remote(), timeout=60)
        # nothing left to cancel; the placed engine goes on (the run waits for engines starting there)
        assert pool.cancel_unplaced() == []
        ray.get(pool.engines[0].health.remote(), timeout=60)

        pool.grow(1, ScaleEvent("up", 1, 2, step=5, reason="asyncrl scale"))  # Ctrl-C now: the shutdown
        (group,) = [group for _, group in pool.own_groups.values()]
        pool.shutdown(timeout_s=60)
        assert placement_group_table(group)["state"] == "REMOVED" and pool.starting == {}
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pool.engines[0].health.remote(), timeout=60)
    finally:
        actors.remove_placement(placement)

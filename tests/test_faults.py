"""How the driver tells a fault from a bug: a trainer rank whose process died, as TrainerGroup
and WeightSync see it (real Ray actors standing in for the ranks and an engine). The faults
themselves, on the real stack (an engine's vLLM process, a rollout worker and a trainer rank
killed, a run killed whole and resumed), are `asyncrl bench faults`, run by tests/test_bench.py."""

from __future__ import annotations

import os
import time

import pytest
import ray

from asyncrl.control.weight_sync import WeightSync
from asyncrl.messages import StagedWeights
from asyncrl.trainer.trainer_group import TrainerGroup, TrainerRankDied


class Rank:
    """A trainer rank's stand-in: `step(mode)` answers, raises (a bug), dies after a moment, or
    raises at once as a rank does whose collective broke because its peer is dying."""

    def node_id(self) -> str:
        return ""

    def step(self, mode: str) -> str:
        if mode == "die":
            time.sleep(0.5)
            os._exit(1)
        if mode == "peer_died":
            raise ConnectionError("gloo: connection closed by peer")
        if mode == "bug":
            raise ValueError("shapes do not match")
        return "ok"


@pytest.fixture
def ranks(ray_cluster):
    handles = [ray.remote(Rank).remote() for _ in range(2)]
    yield handles
    for h in handles:
        ray.kill(h)


def test_a_dead_rank_is_a_fault_and_a_raising_rank_is_an_error(ranks):
    group = TrainerGroup(ranks)
    assert group.get([r.step.remote("ok") for r in ranks]) == ["ok", "ok"]
    with pytest.raises(ValueError, match="shapes do not match"):  # every rank alive: a bug, raised as it is
        group.get([r.step.remote(m) for r, m in zip(ranks, ["bug", "ok"])])
    # Rank 1's error comes first, yet the cause is rank 0's death, seen within the grace period.
    peer = r"\(rank 1: ConnectionError: gloo: connection closed by peer\)"
    with pytest.raises(TrainerRankDied, match=r"trainer rank 0 died: .* " + peer):
        group.get([r.step.remote(m) for r, m in zip(ranks, ["die", "peer_died"])])
    with pytest.raises(TrainerRankDied):
        group.check_alive()


class DyingSender(Rank):
    """Trainer rank 0 of a sync: stages, then dies while it sends."""

    def stage_weights(self, version: int, newest: bool) -> StagedWeights:
        return StagedWeights(0.0, {}, version)

    def broadcast_weights(self) -> None:
        time.sleep(0.5)
        os._exit(1)


class StuckEngine:
    """An engine whose update does not end by itself (stuck before its receive: a broadcast would
    have told it the sender is gone)."""

    def update_weights(self, version: int, pause_mode: str) -> None:
        time.sleep(300)


def test_a_trainer_rank_that_dies_in_a_sync_is_found_while_the_engines_still_wait(ray_cluster):
    rank, engine = ray.remote(DyingSender).remote(), ray.remote(StuckEngine).remote()
    try:
        sync = WeightSync(TrainerGroup([rank]), [engine], "gloo")
        sync.connected = True  # nothing travels: the stand-ins need no broadcast group
        ray.get([rank.node_id.remote(), engine.__ray_ready__.remote()])  # started: what is timed is the sync
        t0 = time.monotonic()
        with pytest.raises(TrainerRankDied, match="trainer rank 0 died"):
            sync.sync(1)
        assert time.monotonic() - t0 < 60  # not after the engine's 300 s
    finally:
        ray.kill(engine)
        ray.kill(rank)


def test_past_its_restart_limit_a_fault_stops_the_run_with_one_line(tmp_path):
    from types import SimpleNamespace

    from asyncrl.control.supervisor import Supervisor
    from asyncrl.driver import TrainingError
    from asyncrl.run_config import load_config

    pool = SimpleNamespace  # no actor is started: the supervisor only counts here
    supervisor = Supervisor(load_config(["run.max_worker_restarts=1"]).run, tmp_path, pool(), pool(), pool(),
                            lambda: 3, lambda mirrored: (0, 0, 0))
    supervisor.count_restart("rollout_worker", "max_worker_restarts", "ActorDiedError: killed")
    with pytest.raises(TrainingError) as e:
        supervisor.count_restart("rollout_worker", "max_worker_restarts", "ActorDiedError: killed again")
    assert str(e.value) == ("rollout worker failed (ActorDiedError: killed again) after 1 replacement(s): "
                            "run.max_worker_restarts=1 reached")
    assert supervisor.restarts == {"rollout_worker": 1}


def test_replacements_that_no_worker_routes_to_and_no_routed_engine_alive_are_seen():
    """EnginePool.only_unrouted: the driver gives such replacements the policy at once (the engines
    the workers knew all died between syncs: no group would come, so no step and no sync)."""
    from asyncrl.control.engine_pool import EnginePool

    old, new, other = object(), object(), object()
    pool = object.__new__(EnginePool)  # its bookkeeping only: no actor is started
    pool.engines, pool.routed, pool.starting = [new], [old], {}
    assert pool.only_unrouted()  # the only engine is a replacement the workers do not route to
    pool.routed = [new]
    assert not pool.only_unrouted()
    pool.engines, pool.routed = [new, other], [old, other]
    assert not pool.only_unrouted()  # another engine still serves: the next sync routes the replacement
    pool.engines, pool.routed, pool.starting = [new], [old], {0: None}
    assert not pool.only_unrouted()  # still starting: nothing to give the policy to yet

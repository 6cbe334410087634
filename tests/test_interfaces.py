"""The declared interfaces of asyncrl/interfaces.py hold, for every class asyncrl.actors builds an
engine, a trainer rank or the queue from: the plain classes it hands to `ray.remote` (the originals
behind the actor handles), for each backend. Each has every method of its Protocols, async where the
Protocol's is, with the Protocol's parameters in order (names, kinds, defaults; it may add
parameters after them, with defaults), and no public method its Protocols do not declare. A method
renamed on either side fails here instead of in a run. Annotations are not compared: the sims
narrow them (`adapter_config() -> None`), and the engine's name torch types this test need not load."""

from __future__ import annotations

import inspect
import typing

import pytest
import ray

from asyncrl import actors, interfaces
from asyncrl.control.weight_sync import WeightSync
from asyncrl.engine.engine_actor import EngineActor
from asyncrl.engine.reward_model import RewardModelActor
from asyncrl.engine.sim_engine import SimEngine
from asyncrl.interfaces import (
    EngineInterface,
    QueueInterface,
    RewardModelInterface,
    SharedWeightsEngine,
    SharedWeightsTrainerRank,
    TeacherEngine,
    TrainerRankInterface,
)
from asyncrl.queue.message_queue import MessageQueue
from asyncrl.reward.services import Served
from asyncrl.run_config import load_config
from asyncrl.trainer.sim_trainer import SimTrainerRank
from asyncrl.trainer.trainer_group import TrainerGroup
from asyncrl.trainer.trainer_rank import TrainerRank

# Each implementation and the Protocols it follows: the real engine and rank also carry the shared
# weight-sync transports (a simulated run always broadcasts: test_a_simulated_run_always_broadcasts).
FOLLOWS: dict[type, tuple[type, ...]] = {
    EngineActor: (SharedWeightsEngine, TeacherEngine),
    SimEngine: (EngineInterface,),
    TrainerRank: (SharedWeightsTrainerRank,),
    SimTrainerRank: (TrainerRankInterface,),
    MessageQueue: (QueueInterface,),
    RewardModelActor: (RewardModelInterface,),
}
# Public methods beyond the interface, and why nothing calls them through a handle.
EXTRAS: dict[type, set[str]] = {
    SimTrainerRank: {"step_s"},  # its cost model, called by train_step and the calibration tests
    RewardModelActor: {"text", "sample"},  # how it reads a sample, called by score and its tests
}
SIM = ["recipe=arith", "engine=sim", "trainer=sim"]


def _declared(protocol: type) -> dict[str, typing.Callable]:
    """The methods `protocol` and the Protocols it extends declare (later ones override)."""
    own = [b for b in reversed(protocol.__mro__) if b not in (object, typing.Generic, typing.Protocol)]
    return {name: f for b in own for name, f in vars(b).items() if inspect.isfunction(f) and not name.startswith("_")}


def _shape(p: inspect.Parameter) -> tuple:
    return p.name, p.kind, p.default


def mismatches(protocol: type, cls: type) -> list[str]:
    """What `cls` lacks of `protocol`: missing methods, async where not (or not where), parameters
    that differ from the Protocol's or extra ones without a default."""
    out = []
    for name, want in _declared(protocol).items():
        have = inspect.getattr_static(cls, name, None)
        if not inspect.isfunction(have):
            out.append(f"{cls.__name__}.{name}: missing")
            continue
        if inspect.iscoroutinefunction(have) != inspect.iscoroutinefunction(want):
            out.append(f"{cls.__name__}.{name}: {'async' if inspect.iscoroutinefunction(want) else 'not async'} "
                       f"in {protocol.__name__}")
        w = list(inspect.signature(want).parameters.values())
        h = list(inspect.signature(have).parameters.values())
        extra = [p for p in h[len(w):] if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if [_shape(p) for p in h[:len(w)]] != [_shape(p) for p in w] or extra:
            out.append(f"{cls.__name__}.{name}{inspect.signature(have)} does not take "
                       f"{protocol.__name__}.{name}{inspect.signature(want)}")
    return out


def undeclared(cls: type, protocols: tuple[type, ...]) -> set[str]:
    """Public methods of `cls` that none of `protocols` declares (and EXTRAS does not list)."""
    public = {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}
    return public - {n for p in protocols for n in _declared(p)} - EXTRAS.get(cls, set())


@pytest.fixture
def built(monkeypatch) -> list[type]:
    """The classes asyncrl.actors hands to `ray.remote` for engines, trainer ranks, the queue and reward models,
    with either backend (no actor starts: the wrapped class is recorded and nothing is created)."""
    wrapped: list[type] = []

    class Unstarted:
        def options(self, **_):
            return self

        def remote(self, *_, **__):
            return None

    def remote(cls):
        wrapped.append(cls)
        return Unstarted()

    monkeypatch.setattr(ray, "remote", remote)
    for overrides in (["recipe=arith"], SIM):
        cfg = load_config(overrides)
        actors.create_engine(cfg, 0)
        actors.create_trainer(cfg)
        actors.create_queue(cfg)
    actors.create_service(cfg, Served("reward_model", cfg.reward.model, "rm", 1, 0.5, 1.0), 0)
    return wrapped


def test_every_engine_trainer_rank_and_queue_class_follows_its_interfaces(built):
    assert set(built) == set(FOLLOWS), "a class asyncrl.actors builds is not in FOLLOWS: declare its interfaces"
    problems = [m for cls, protocols in FOLLOWS.items() for protocol in protocols for m in mismatches(protocol, cls)]
    problems += [f"{cls.__name__}.{name}: in none of {[p.__name__ for p in protocols]}"
                 for cls, protocols in FOLLOWS.items() for name in sorted(undeclared(cls, protocols))]
    assert not problems, "\n".join(problems)


def test_the_handles_name_their_interfaces():
    for handle, protocol in ((interfaces.EngineHandle, EngineInterface), (interfaces.QueueHandle, QueueInterface),
                             (interfaces.TrainerRankHandle, TrainerRankInterface),
                             (interfaces.RewardModelHandle, RewardModelInterface)):
        assert typing.get_origin(handle) is ray.actor.ActorHandle and typing.get_args(handle) == (protocol,)


def test_a_simulated_run_always_broadcasts():
    """Why the sims need not carry the shared transports' methods."""
    cfg = load_config([*SIM, "trainer.weight_sync_transport=shared_memory"])
    assert WeightSync.of(cfg, TrainerGroup([object()]), []).wanted == "broadcast"


def test_the_checker_sees_a_rename_on_either_side():
    def renamed(cls: type, old: str, new: str, **methods) -> type:
        body = {(new if n == old else n): f for n, f in vars(cls).items() if inspect.isfunction(f)}
        return type(cls.__name__, (), {**body, **methods})

    engine = renamed(SimEngine, "health", "healthcheck")
    assert mismatches(EngineInterface, engine) == ["SimEngine.health: missing"]
    assert undeclared(engine, (EngineInterface,)) == {"healthcheck"}

    async def pause(self, how: str = "abort") -> float: ...  # a parameter renamed
    [wrong] = mismatches(EngineInterface, renamed(SimEngine, "", "", pause=pause))
    assert wrong.startswith("SimEngine.pause(self, how") and "does not take EngineInterface.pause(self, mode" in wrong

    def size(self) -> int: ...  # fine as it is; async is not
    async def async_size(self) -> int: ...
    assert mismatches(QueueInterface, renamed(MessageQueue, "", "", size=size)) == []
    assert mismatches(QueueInterface, renamed(MessageQueue, "", "", size=async_size)) == [
        "MessageQueue.size: not async in QueueInterface"]

    class Renamed(TrainerRankInterface, typing.Protocol):  # the Protocol's side
        def stage_the_weights(self, version: int) -> None: ...
    assert mismatches(Renamed, SimTrainerRank) == ["SimTrainerRank.stage_the_weights: missing"]

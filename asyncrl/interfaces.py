"""The interfaces of the actors that stand in for one another, declared: an engine (EngineActor:
vLLM; SimEngine: engine.backend=sim), a trainer rank (TrainerRank: megatron-core; SimTrainerRank:
trainer.backend=sim) and the message queue (one class, but the rollout workers that fill it may
not import it: actors never import one another). The driver, the pools, the routers and WeightSync
call only these methods, so a simulated backend runs the same control plane as the real one.
tests/test_interfaces.py checks every class asyncrl.actors builds against them (names, async or
not, parameters), so a method renamed on one side fails there instead of in a run.

Each is written as the plain class's methods: actors are plain classes, wrapped by Ray at the edge
(asyncrl.actors). Through a Ray actor handle `h`, `h.m.remote(*args)` takes `m`'s arguments and
returns an ObjectRef of its result; the handle aliases below say which interface a handle's
methods follow. They type nothing further: Ray types `.remote` calls only for methods decorated
with `@ray.method`, so a static checker lets any call through; the test is what holds the classes
to the interfaces.

The shared weight-sync transports (asyncrl.sync.shared_buckets) add methods to the real engine and
trainer rank only (`SharedWeightsEngine`, `SharedWeightsTrainerRank`): a run with a simulated
backend always broadcasts (asyncrl.control.weight_sync.WeightSync.of; a simulated broadcast is a wait of
its simulated time), so on the sims those methods would be dead code. So would `TeacherEngine`'s:
a teacher is a real engine.
"""

from __future__ import annotations

from typing import Any, Protocol

from ray.actor import ActorHandle

from asyncrl.inference.channel import ChannelAddress
from asyncrl.messages import (
    EngineActivity,
    EngineStartInfo,
    QueueState,
    QueueStats,
    RewardRequest,
    StagedWeights,
    TrainerSetupInfo,
    TrainStepResult,
    WeightUpdateReport,
)
from asyncrl.types import GenerationResult, SamplingSpec, TrajectoryGroup


class EngineInterface(Protocol):
    """One inference engine: token-in/token-out generation with per-token logprobs, pause and
    resume, and new weights from the trainer's broadcast (asyncrl/engine/engine_actor.py)."""

    # -- lifecycle
    async def start(self) -> EngineStartInfo: ...
    async def open_channel(self) -> ChannelAddress: ...
    async def health(self) -> float: ...
    async def shutdown(self) -> None: ...

    # -- generation
    async def generate(self, prompt_token_ids: list[int], sampling: SamplingSpec,
                       request_id: str) -> GenerationResult: ...
    def num_outstanding(self) -> int: ...
    def activity(self) -> EngineActivity: ...
    def get_version(self) -> int: ...

    # -- weight updates
    async def pause(self, mode: str = "abort") -> float: ...
    async def resume(self) -> None: ...
    async def load_weights(self, state_dict: dict[str, Any], version: int) -> float: ...
    def num_workers(self) -> int: ...
    def node_id(self) -> str: ...
    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                secret: str, plan_wire: list, timeout_s: float,
                                adapter_config: dict | None = None) -> None: ...
    async def update_weights(self, version: int, pause_mode: str = "abort") -> WeightUpdateReport: ...


class SharedWeightsEngine(EngineInterface, Protocol):
    """An engine that can also read the trainer's weights from a shared region (shared_memory,
    cuda_ipc) instead of the broadcast: the real engine only (see the module docstring)."""

    async def weight_sync_places(self) -> list[dict]: ...
    async def init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                                secret: str, plan_wire: list, timeout_s: float, adapter_config: dict | None = None,
                                transport: str = "broadcast", share: dict | None = None) -> None: ...


class TeacherEngine(EngineInterface, Protocol):
    """An engine that scores given tokens (a teacher of on-policy distillation, algorithm.distill):
    the real engine only (simulated runs have no teacher)."""

    async def score_tokens(self, token_ids: list[int], start: int, request_id: str) -> list[float]: ...


class TrainerRankInterface(Protocol):
    """One rank of the trainer (asyncrl/trainer/trainer_rank.py); TrainerGroup calls every rank
    alike. The weight-broadcast methods act on rank 0 (the group's source); the others return."""

    def node_id(self) -> str: ...
    def world_address(self, member_nodes: list[str]) -> tuple[str, int]: ...
    def setup(self, master_addr: str, master_port: int, secret: str) -> TrainerSetupInfo: ...
    def train_step(self, groups: list[TrajectoryGroup], policy_version: int) -> TrainStepResult: ...

    # -- weights out
    def weight_plan(self) -> list: ...
    def adapter_config(self) -> dict | None: ...
    def weight_group_address(self, member_nodes: list[str]) -> tuple[str, int]: ...
    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, secret: str) -> None: ...
    def stage_weights(self, version: int, newest: bool = False) -> StagedWeights: ...
    def broadcast_weights(self) -> float: ...
    def export_hf(self, out_dir: str) -> str: ...

    # -- checkpoints
    def save_checkpoint(self, ckpt_dir: str) -> str: ...
    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> int: ...
    def shutdown(self) -> None: ...


class SharedWeightsTrainerRank(TrainerRankInterface, Protocol):
    """A rank that can also hand its weights over through a shared region: the real rank only."""

    def weight_sync_place(self) -> dict: ...
    def init_shared_weights(self, transport: str, secret: str) -> dict | None: ...
    def shared_weights_joined(self) -> None: ...


class QueueInterface(Protocol):
    """The bounded buffer of finished groups between the rollout workers and the trainer
    (asyncrl/queue/message_queue.py)."""

    async def put(self, group: TrajectoryGroup) -> None: ...
    async def get(self, n: int, current_version: int = 0,
                  timeout_s: float | None = None) -> list[TrajectoryGroup]: ...
    def size(self) -> int: ...
    def report(self, values: dict[str, float]) -> None: ...
    def stats(self) -> QueueStats: ...
    def prompt_ids(self) -> list[str]: ...
    def state(self) -> QueueState: ...
    async def restore(self, state: QueueState) -> None: ...


class RewardModelInterface(Protocol):
    """A reward model replica the rollout workers call (asyncrl/reward/reward_model.py)."""

    async def score(self, requests: list[RewardRequest]) -> list[float]: ...
    def health(self) -> bool: ...


# Ray actor handles, by the interface their `.remote` methods follow. A handle of the real engine
# or rank also has the shared transports' methods; they are called only where a run chose one.
EngineHandle = ActorHandle[EngineInterface]
TeacherEngineHandle = ActorHandle[TeacherEngine]
TrainerRankHandle = ActorHandle[TrainerRankInterface]
QueueHandle = ActorHandle[QueueInterface]
RewardModelHandle = ActorHandle[RewardModelInterface]

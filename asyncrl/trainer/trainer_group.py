"""TrainerGroup: the trainer's ranks (Ray actors, built by asyncrl.actors), called as one.

Every rank gets every call with the same arguments (megatron ranks must act in step);
each method returns rank 0's answer. The `*_async` methods return the ranks' refs, for
calls that must overlap with calls to other actors (the weight broadcast).

A rank whose process died raises `TrainerRankDied` as soon as it is seen (the other ranks
may wait in a collective with it until trainer.dist_timeout_s); so does an error of a live
rank while another rank is dead (its collective failed because of the dead one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from asyncrl.interfaces import TrainerRankHandle
from asyncrl.messages import StagedWeights, TrainerSetupInfo, TrainStepResult, error_line
from asyncrl.sync.group_store import new_group_secret
from asyncrl.types import TrajectoryGroup

# After one rank's error, how long the others are given to show whether one of them died.
RANK_ERROR_GRACE_S = 30.0


class TrainerRankDied(RuntimeError):
    """A trainer rank's process is gone: the trainer must be restarted from a checkpoint."""


class TrainerGroup:
    def __init__(self, ranks: list[TrainerRankHandle]):
        if not ranks:
            raise ValueError("a trainer needs at least one rank")
        self.ranks = ranks  # rank 0 first
        self.world_size = len(ranks)

    def on_ranks(self, call: Callable[[TrainerRankHandle], ray.ObjectRef]) -> Any:
        """`call(rank)` on every rank (e.g. `lambda r: r.train_step.remote(groups, v)`); rank 0's
        answer. Tests and benchmarks call the methods a TrainerRank subclass adds this way."""
        return self.get([call(r) for r in self.ranks])[0]

    def get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """The ranks' answers to one call (`refs[i]` is rank i's); `TrainerRankDied` as soon as one
        rank is seen dead."""
        rank = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise TrainerRankDied(f"trainer rank {rank[ready[0]]} died: {error_line(e)}") from None
            except Exception as e:
                # A live rank failed: because another rank died (their collective broke), or a bug.
                for other in ray.wait(pending, num_returns=len(pending), timeout=RANK_ERROR_GRACE_S)[0]:
                    try:
                        ray.get(other)
                    except ray.exceptions.RayActorError as died:
                        raise TrainerRankDied(f"trainer rank {rank[other]} died: {error_line(died)} (rank "
                                              f"{rank[ready[0]]}: {error_line(e)})") from None
                    except Exception:  # the same failure on that rank
                        pass
                raise
        return ray.get(refs)

    def setup(self) -> TrainerSetupInfo:
        """Form the trainer's process group (rank 0 hosts it) and load the model on every rank."""
        nodes = ray.get([r.node_id.remote() for r in self.ranks])
        host, port = ray.get(self.ranks[0].world_address.remote(nodes))
        secret = new_group_secret()  # the world's store is sealed with it, as the weight group's (group_store.py)
        return self.get([r.setup.remote(host, port, secret) for r in self.ranks])[0]

    def train_step(self, groups: list[TrajectoryGroup], policy_version: int) -> TrainStepResult:
        return self.on_ranks(lambda r: r.train_step.remote(groups, policy_version))

    # -- weights out ---------------------------------------------------------------------

    def weight_group_address(self, member_nodes: list[str]) -> tuple[str, int]:
        """Where rank 0 hosts the weight-broadcast group's store, bound already: loopback when
        every other member is on its node (`member_nodes`: their Ray node ids)."""
        return self.get([self.ranks[0].weight_group_address.remote(member_nodes)])[0]

    def check_alive(self) -> None:
        """Raises `TrainerRankDied` if a rank's process is gone."""
        self.get([r.node_id.remote() for r in self.ranks])

    def weight_plan(self) -> list:
        """The bucket plan of the weight broadcast, as wire data (asyncrl.sync.collective.BucketPlan)."""
        return self.on_ranks(lambda r: r.weight_plan.remote())

    def adapter_config(self) -> dict | None:
        """PEFT's adapter_config of what the syncs send (trainer.lora), or None: whole weights."""
        return self.on_ranks(lambda r: r.adapter_config.remote())

    def init_weight_group_async(self, host: str, port: int, world_size: int, backend: str,
                                secret: str) -> list[ray.ObjectRef]:
        return [r.init_weight_group.remote(host, port, world_size, backend, secret) for r in self.ranks]

    # weight_sync_place .. shared_weights_joined: a shared transport's (SharedWeightsTrainerRank), real ranks only
    def weight_sync_place(self) -> dict:
        """Where rank 0 runs (node, GPU, room under /dev/shm): asyncrl.sync.shared_buckets.choose_transport."""
        return self.get([self.ranks[0].weight_sync_place.remote()])[0]

    def init_shared_weights(self, transport: str, secret: str) -> dict:
        """Rank 0 creates the formation's shared region; returns what the engines need to open it."""
        return self.get([self.ranks[0].init_shared_weights.remote(transport, secret)])[0]

    def shared_weights_joined(self) -> None:
        self.get([self.ranks[0].shared_weights_joined.remote()])

    def stage_weights(self, version: int, newest: bool = False) -> StagedWeights:
        return self.on_ranks(lambda r: r.stage_weights.remote(version, newest))

    def broadcast_weights_async(self) -> list[ray.ObjectRef]:
        return [r.broadcast_weights.remote() for r in self.ranks]

    def export_hf(self, out_dir: str) -> str:
        return self.on_ranks(lambda r: r.export_hf.remote(out_dir))

    # -- checkpoints -------------------------------------------------------------------

    def save_checkpoint(self, path: str) -> str:
        """Model, optimizer and scheduler state (a megatron distributed checkpoint) into `path`."""
        return self.on_ranks(lambda r: r.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str, load_optimizer: bool = True) -> int:
        """The state `save_checkpoint` wrote; returns the trainer's step."""
        return self.on_ranks(lambda r: r.load_checkpoint.remote(path, load_optimizer))

    def shutdown(self) -> None:
        try:
            ray.get([r.shutdown.remote() for r in self.ranks], timeout=30)
        except Exception:  # a dead rank cannot shut down cleanly; it is killed below either way
            pass
        for r in self.ranks:
            ray.kill(r)

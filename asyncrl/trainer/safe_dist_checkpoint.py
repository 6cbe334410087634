"""megatron-core's distributed checkpoint, loaded without a general unpickler.

`dist_checkpointing.load` (megatron-core 0.16.1, torch 2.13) reads, from the checkpoint dir:

- `metadata.json`: json; it names the load strategies, which are fixed here instead;
- `common.pt`: megatron's `torch.load` without `weights_only` (weights-only by torch's default,
  a full unpickler with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1). Here: `load_weights_only`;
- `.metadata`: torch's FileSystemReader.read_metadata, `pickle.load`, a full unpickler.
  Here: `RestrictedUnpickler`, and every storage file must lie in the directory;
- tensor items of the `__R_N.distcp` shards: `torch.load(weights_only=True)`, kept;
- byte items of the shards (megatron's ShardedObjects, e.g. a layer's `_extra_state`):
  torch's DefaultLoadPlanner.load_bytes, `torch.load(weights_only=False)`. Here: forced
  weights-only (`forced_weights_only`).

`SafeFileSystemReader` does the last three: megatron's torch_dist strategy builds its reader
through a private function, replaced while `load_dist_checkpoint` runs (megatron_cpu.py,
`dist_checkpoint_reader`). Imports megatron-core: import this module where megatron is needed.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from asyncrl.trainer.megatron_cpu import dist_checkpoint_reader
from asyncrl.trainer.safe_checkpoint import (
    CheckpointRefused,
    forced_weights_only,
    load_weights_only,
    read_dcp_metadata,
    refused_pickle,
)


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's FileSystemReader, except: `.metadata` is read once with `RestrictedUnpickler`
    (and cached, as megatron's CachedMetadataFileSystemReader does), and every item of the
    `.distcp` files loads with the weights-only unpickler, file by file, so a refusal names it."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None):
        super().__init__(path)
        self._metadata = metadata

    # No **kwargs: torch then never falls back to a per-rank `__R.metadata` when this one fails.
    def read_metadata(self) -> Metadata:
        if self._metadata is None:
            self._metadata = read_dcp_metadata(Path(self.path) / ".metadata")
        # What torch's read_metadata sets on the metadata it returns.
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            try:
                with forced_weights_only():  # byte items: torch's load_bytes asks for weights_only=False
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except pickle.UnpicklingError as e:
                raise refused_pickle(Path(self.path) / name, e) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done


class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common-state loader, reading `common.pt` with the weights-only unpickler
    whatever the environment says. (Its `load_sharded_objects`, megatron's torch.load of
    `<key>.pt` files, is never called: the torch_dist strategy loads sharded objects itself.)"""

    def load_common(self, checkpoint_dir: str | os.PathLike) -> Any:
        return load_weights_only(Path(checkpoint_dir) / COMMON_STATE_FNAME)


def load_dist_checkpoint(sharded_state_dict: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """`dist_checkpointing.load(sharded_state_dict, ckpt_dir)`, with no general unpickler on the
    way: raises `CheckpointRefused` (one line) for a file that holds anything but data."""
    metadata = read_dcp_metadata(Path(ckpt_dir) / ".metadata")  # refused here, before torch DCP wraps errors

    def make_reader(checkpoint_dir: str | os.PathLike, cache_metadata: bool = False) -> SafeFileSystemReader:
        same = Path(checkpoint_dir).resolve() == Path(ckpt_dir).resolve()
        return SafeFileSystemReader(checkpoint_dir, metadata if same else None)

    try:
        with dist_checkpoint_reader(make_reader), forced_weights_only():
            return dist_checkpointing.load(sharded_state_dict, ckpt_dir,
                                           sharded_strategy=TorchDistLoadShardedStrategy(),
                                           common_strategy=WeightsOnlyCommonLoadStrategy())
    except CheckpointException as e:  # torch DCP gathers every rank's error into one report
        for error, _ in e.failures.values():
            if isinstance(error, CheckpointRefused):
                raise CheckpointRefused(str(error)) from None
        raise

"""megatron-core's distributed checkpoint, loaded without a general unpickler and without
allocating more than its files hold.

`dist_checkpointing.load` (megatron-core 0.16.1, torch 2.13) reads, from the checkpoint dir:

- `metadata.json`: json; it names the load strategies, which are fixed here instead. Megatron
  opens it itself: here it is checked first to be a regular file of at most 1 MiB;
- `common.pt`: megatron's `torch.load` without `weights_only` (weights-only by torch's default,
  a full unpickler with TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1). Here: `load_weights_only`;
- `.metadata`: torch's FileSystemReader.read_metadata, `pickle.load`, a full unpickler.
  Here: `read_dcp_metadata` (`RestrictedUnpickler`, every storage file in the directory), and
  every byte range it declares must lie in its shard (`check_dcp_storage`);
- tensor items of the `__R_N.distcp` shards: `torch.load(weights_only=True)`, kept;
- byte items of the shards (megatron's ShardedObjects, e.g. a layer's `_extra_state`):
  torch's DefaultLoadPlanner.load_bytes, `torch.load(weights_only=False)`. Here: forced
  weights-only (`forced_weights_only`).

Every file is opened as a regular file (`open_checkpoint_file`: no symbolic link, device or
FIFO) and every torch.save archive checked by `check_torch_zip` before torch.load reads it.
`SafeFileSystemReader` does the last three: megatron's torch_dist strategy builds its reader
through a private function, replaced while `load_dist_checkpoint` runs (megatron_cpu.py,
`dist_checkpoint_reader`). Imports megatron-core: import this module where megatron is needed.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CONFIG_FNAME
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from asyncrl.trainer.megatron_cpu import dist_checkpoint_reader
from asyncrl.trainer.safe_checkpoint import (
    STATE_JSON_MAX_BYTES,
    CheckpointRefused,
    FileRange,
    check_dcp_storage,
    check_shard,
    check_torch_zip,
    forced_weights_only,
    load_weights_only,
    open_checkpoint_file,
    read_checkpoint_bytes,
    read_dcp_metadata,
    refused_pickle,
)


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's FileSystemReader, except: `.metadata` is read once with `read_dcp_metadata`
    (and cached, as megatron's CachedMetadataFileSystemReader does), and `read_data` is asyncrl's:
    each shard opened as a regular file, every byte range of it checked against its size before
    any is read, and every item loaded as a checked torch.save archive with the weights-only
    unpickler, file by file, so a refusal names it."""

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
        """What torch's FileSystemReader.read_data does for the items torch_dist writes (plain
        bytes, no stream transform: `read_dcp_metadata` refuses those), on checked files."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        declared: dict[str, list[Any]] = {}
        for info in self.storage_data.values():
            declared.setdefault(info.relative_path, []).append(info)
        for name, items in by_file.items():
            path = Path(self.path) / name
            with open_checkpoint_file(path) as f:
                # The shard is what its metadata declares, no longer; every range within it; then the reads.
                check_shard(path, os.fstat(f.fileno()).st_size, declared[name])
                parts = [FileRange(f, path, info.offset, info.length)
                         for info in (self.storage_data[item.storage_index] for item in items)]
                for item, part in zip(items, parts):
                    _read_item(item, part, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _read_item(item: ReadItem, part: FileRange, planner: LoadPlanner) -> None:
    """One item of a shard into the planner's state dict, as torch's read_data loads it."""
    if item.type == LoadItemType.BYTE_IO:
        check_torch_zip(part)
        try:
            with forced_weights_only():  # torch's load_bytes asks for weights_only=False
                planner.load_bytes(item, io.BytesIO(part.read()))
        except pickle.UnpicklingError as e:
            raise refused_pickle(part.source, e) from None
        return
    tensor = load_weights_only(part)
    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
        if length < tensor.size(dim):  # the part of the saved chunk this rank reads
            tensor = tensor.narrow(dim, start, length)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise ValueError(f"{part.source}: {item.storage_index.fqn} holds {tuple(tensor.size())} here, "
                         f"the model reads {tuple(target.size())}")
    target.copy_(tensor)
    planner.commit_tensor(item, target)


class WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
    """megatron's common-state loader, reading `common.pt` with the weights-only unpickler
    whatever the environment says. (Its `load_sharded_objects`, megatron's torch.load of
    `<key>.pt` files, is never called: the torch_dist strategy loads sharded objects itself.)"""

    def load_common(self, checkpoint_dir: str | os.PathLike) -> Any:
        return load_weights_only(Path(checkpoint_dir) / COMMON_STATE_FNAME)


def check_megatron_metadata(ckpt_dir: str | os.PathLike) -> None:
    """megatron's `metadata.json`, which megatron opens and parses itself, is a regular file of at
    most `STATE_JSON_MAX_BYTES` (a missing one is megatron's to report)."""
    path = Path(ckpt_dir) / CONFIG_FNAME
    if os.path.lexists(path):
        read_checkpoint_bytes(path, STATE_JSON_MAX_BYTES)


def load_dist_checkpoint(sharded_state_dict: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """`dist_checkpointing.load(sharded_state_dict, ckpt_dir)`, with no general unpickler on the
    way: raises `CheckpointRefused` (one line) for a file that holds anything but data, is not a
    regular file, or declares more bytes than it holds."""
    # Refused here, before megatron reads anything and torch DCP wraps errors.
    check_megatron_metadata(ckpt_dir)
    metadata = read_dcp_metadata(Path(ckpt_dir) / ".metadata")
    check_dcp_storage(metadata, ckpt_dir)

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

"""What a checkpoint file may hold: data, never code (docs/security.md, "Checkpoints").

A checkpoint directory (RUN_DIR/checkpoints/step_N) can come from anywhere: `run.resume_from`
and a trainer restart read it. Every file of it that asyncrl or megatron-core reads is parsed
here, or by the loaders of asyncrl/trainer/safe_dist_checkpoint.py that use what is here:

- `trainer_state.json` (step, LR schedule): JSON, its shape checked (`read_trainer_state`);
- torch DCP's `.metadata`: `RestrictedUnpickler`, which builds the classes of torch DCP's
  metadata (`DCP_METADATA_GLOBALS`, dtypes, layouts) and refuses every other global;
- megatron's `common.pt` and the items of the `.distcp` shards: `torch.load(weights_only=True)`
  (`load_weights_only`, `forced_weights_only`), torch's own loader of tensors and plain data.

A file that asks for anything else raises `CheckpointRefused`: one line naming the file and
what it asked for, raised before the object it asked for is built. Nothing here imports
megatron-core (the driver imports this module to recognise the error).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_FORMAT = 1

# Every class torch 2.13's DCP pickles into `.metadata` (megatron-core 0.16.1's torch_dist
# strategy adds none; _StoragePrefix and BytesIOWriteData appear only in DCP's other save modes),
# as (module, name). torch dtypes, layouts and memory formats (constants, not callables) are
# allowed too: see `_is_torch_constant`.
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch.distributed.checkpoint.planner", "BytesIOWriteData"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
})

_FORCE_WEIGHTS_ONLY = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_FORCE_NO_WEIGHTS_ONLY = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"
_GLOBAL_IN_TORCH_ERROR = re.compile(r"GLOBAL ([\w.]+)")
_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


class CheckpointRefused(Exception):
    """A checkpoint file holds something a checkpoint never holds; nothing of it was built."""


def refused(path: str | os.PathLike, why: str) -> CheckpointRefused:
    return CheckpointRefused(f"checkpoint {path} refused: {why}")


def refused_global(path: str | os.PathLike, name: str) -> CheckpointRefused:
    return refused(path, f"it asks to load {name}, which a checkpoint never holds")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _is_torch_constant(module: str, name: str) -> bool:
    # torch.__dict__, not getattr: torch's module __getattr__ imports submodules on demand.
    return module == "torch" and isinstance(torch.__dict__.get(name), (torch.dtype, torch.layout, torch.memory_format))


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed`: any other one (a function to
    call, a class to build) raises `CheckpointRefused` before it is even imported."""

    def __init__(self, file: IO[bytes], source: str | os.PathLike, allowed: frozenset = DCP_METADATA_GLOBALS):
        super().__init__(file)
        self.source = source
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise refused_global(self.source, f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise refused(self.source, "it holds a persistent id, which DCP metadata never does")


def read_dcp_metadata(path: Path) -> Any:
    """torch DCP's `.metadata` (a `torch.distributed.checkpoint.Metadata`), read with
    `RestrictedUnpickler`; every storage file it names must lie in the checkpoint directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f, path).load()
    except (CheckpointRefused, FileNotFoundError):
        raise
    except Exception as e:  # truncated, or a well-formed pickle of the wrong shape
        raise refused(path, f"it is not torch DCP metadata ({type(e).__name__}: {_one_line(str(e))})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise refused(path, f"it holds a {type(metadata).__name__}, not torch DCP metadata")
    for info in metadata.storage_data.values():
        # DCP joins this to the directory: a path or `..` would read any file on the host.
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
            raise refused(path, f"it points at {name!r}, outside the checkpoint directory")
    return metadata


def refused_pickle(path: str | os.PathLike, error: pickle.UnpicklingError) -> CheckpointRefused:
    """`torch.load(weights_only=True)`'s refusal (a paragraph of advice) as one line."""
    text = str(error)
    found = _GLOBAL_IN_TORCH_ERROR.search(text)
    if found:
        return refused_global(path, found.group(1))
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(_TORCH_BOILERPLATE)]
    return refused(path, f"it is not plain data ({lines[0] if lines else _one_line(text)})")


def load_weights_only(f: str | os.PathLike | IO[bytes], source: str | os.PathLike | None = None) -> Any:
    """`torch.load` with torch's weights-only unpickler (tensors, containers, numbers, strings and
    the classes registered with `torch.serialization.add_safe_globals`); `source` names the file
    in the refusal when `f` is a stream."""
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused_pickle(source if source is not None else f, e) from None


@contextlib.contextmanager
def forced_weights_only() -> Iterator[None]:
    """Every `torch.load` in this process uses the weights-only unpickler while in this context,
    including torch's and megatron's own calls that pass `weights_only=False` or nothing (torch
    documents the variable; TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD, which would contradict it, is unset)."""
    saved = {k: os.environ.get(k) for k in (_FORCE_WEIGHTS_ONLY, _FORCE_NO_WEIGHTS_ONLY)}
    os.environ[_FORCE_WEIGHTS_ONLY] = "1"
    os.environ.pop(_FORCE_NO_WEIGHTS_ONLY, None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# -- trainer_state.json --------------------------------------------------------------------------

def write_trainer_state(ckpt_dir: str | os.PathLike, step: int, scheduler: dict[str, Any]) -> Path:
    """The trainer's step and its LR schedule's state (megatron's OptimizerParamScheduler:
    numbers and style names) as JSON."""
    path = Path(ckpt_dir) / TRAINER_STATE
    path.write_text(json.dumps({"format": TRAINER_STATE_FORMAT, "step": step, "scheduler": scheduler},
                               indent=2) + "\n")
    return path


def read_trainer_state(ckpt_dir: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """(step, scheduler state) from `write_trainer_state`'s file; anything else is refused."""
    path = Path(ckpt_dir) / TRAINER_STATE
    try:
        state = json.loads(path.read_bytes())
    except ValueError as e:  # not JSON, or not text at all (a pickle)
        raise refused(path, f"it is not the JSON asyncrl writes ({type(e).__name__}: {_one_line(str(e))})") from None
    if not (isinstance(state, dict) and set(state) == {"format", "step", "scheduler"}):
        raise refused(path, 'expected {"format", "step", "scheduler"}')
    if state["format"] != TRAINER_STATE_FORMAT:
        raise refused(path, f"format {state['format']!r}; this asyncrl reads format {TRAINER_STATE_FORMAT}")
    step, scheduler = state["step"], state["scheduler"]
    if type(step) is not int or step < 0:
        raise refused(path, f"step {step!r} is not a count of steps")
    if not isinstance(scheduler, dict) or not all(
            v is None or isinstance(v, (bool, int, float, str)) for v in scheduler.values()):
        raise refused(path, "the scheduler's state must map names to numbers or strings")
    return step, scheduler

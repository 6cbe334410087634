"""What a checkpoint file may hold: data, never code, and no more than its own bytes
(docs/security.md, "Checkpoints").

A checkpoint directory (RUN_DIR/checkpoints/step_N) can come from anywhere: `run.resume_from`
and a trainer restart read it. Every file of it that asyncrl or megatron-core reads is parsed
here, or by the loaders of asyncrl/trainer/safe_dist_checkpoint.py that use what is here:

- `trainer_state.json` (step, LR schedule): JSON of at most `STATE_JSON_MAX_BYTES`, every
  number finite, its shape checked (`read_trainer_state`);
- torch DCP's `.metadata`: its opcodes walked first (`check_pickle_bounds`), then
  `RestrictedUnpickler`, which builds the classes of torch DCP's metadata
  (`DCP_METADATA_GLOBALS`, dtypes, layouts) and refuses every other global; every byte range it
  declares must lie in its shard file (`check_dcp_storage`);
- megatron's `common.pt` and the items of the `.distcp` shards: a torch.save zip archive of
  stored entries that fit the file (`check_torch_zip`), then `torch.load(weights_only=True)`
  (`load_weights_only`, `forced_weights_only`), torch's own loader of tensors and plain data.

Every file is opened by `open_checkpoint_file`: a regular file itself, never through a symbolic
link (O_NOFOLLOW), a device, a FIFO or a directory. A file that breaks any of this raises
`CheckpointRefused`: one line naming the file and why, raised before the object it asked for is
built or the size it declared is allocated. Nothing here imports megatron-core (the driver
imports this module to recognise the error).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import pickle
import pickletools
import re
import stat
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any, BinaryIO, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_FORMAT = 1

# The most a checkpoint's small JSON files may hold: asyncrl's trainer_state.json (about 300
# bytes: a step and megatron's dozen scheduler numbers) and megatron's metadata.json (about 120
# bytes: the format's names). Thousands of times either, and harmless to read whole.
STATE_JSON_MAX_BYTES = 1 << 20
ADAPTER_CONFIG_MAX_BYTES = 1 << 20  # a PEFT adapter_config.json: about 1 KiB

# A file holding fewer bytes on disk than this share of its length is sparse (holes read as zeros,
# costing memory but no disk): a checkpoint asyncrl or megatron writes has none. Compressing file
# systems store weights at ~0.9x; zeros-heavy files of a small length are allowed whatever they hold.
SPARSE_MIN_ALLOCATED_SHARE = 1 / 8
SPARSE_CHECKED_FROM_BYTES = 1 << 20

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

_ZIP_LOCAL_HEADER = b"PK\x03\x04"  # how torch.load tells its zip format from its legacy one
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_FILE_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class CheckpointRefused(Exception):
    """A checkpoint file holds something a checkpoint never holds; nothing of it was built."""


def refused(path: str | os.PathLike, why: str) -> CheckpointRefused:
    return CheckpointRefused(f"checkpoint {path} refused: {why}")


def refused_global(path: str | os.PathLike, name: str) -> CheckpointRefused:
    return refused(path, f"it asks to load {name}, which a checkpoint never holds")


def _one_line(text: str) -> str:
    return " ".join(text.split())


# -- reading a file: a regular file, and never more than it holds ---------------------------------

def _refuse_unless_regular(path: str | os.PathLike, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for is_kind, name in _FILE_KINDS if is_kind(mode)), "not a plain file")
        raise refused(path, f"it is {kind}; checkpoint files are read as regular files only")


def open_checkpoint_file(path: str | os.PathLike) -> BinaryIO:
    """`path` opened for reading (unbuffered) if it is a regular file: not a symbolic link (to
    /dev/zero, or to a file of the host), a device, a FIFO or a directory. Close it (`with`)."""
    # lstat first: a device or FIFO is refused without being opened (opening one can block or act).
    _refuse_unless_regular(path, os.lstat(path).st_mode)
    try:
        # O_NOFOLLOW: a link put there since the lstat is refused, not followed; O_NONBLOCK: a FIFO
        # put there returns at once, to be refused by the fstat (no effect on a regular file).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refused(path, "it is a symbolic link; checkpoint files are read as regular files only") from None
        raise
    try:
        st = os.fstat(fd)
        _refuse_unless_regular(path, st.st_mode)  # what is read is the file checked
        _refuse_sparse(path, st)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


def _refuse_sparse(path: str | os.PathLike, st: os.stat_result) -> None:
    """A file much longer than what it holds on disk is refused before it is read: reading it would
    cost its length in memory (holes read as zeros) for a few KiB of disk."""
    on_disk = st.st_blocks * 512
    if st.st_size >= SPARSE_CHECKED_FROM_BYTES and on_disk < st.st_size * SPARSE_MIN_ALLOCATED_SHARE:
        raise refused(path, f"it is sparse: {st.st_size} bytes long with {on_disk} on disk; checkpoint files "
                            "hold every byte they declare")


def read_checkpoint_bytes(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The whole of a regular checkpoint file (`open_checkpoint_file`), refused when larger than
    `max_bytes`."""
    with open_checkpoint_file(path) as f:
        size = os.fstat(f.fileno()).st_size
        if max_bytes is not None and size > max_bytes:
            raise refused(path, f"it is {size} bytes; this file is at most {max_bytes} bytes")
        return f.read(size)  # no more than the size checked, whatever the file does meanwhile


def check_range(path: str | os.PathLike, size: int, offset: int, length: int) -> None:
    """Refuse bytes [offset, offset + length) declared of a file of `size` bytes that are not in it."""
    if offset < 0 or length < 0 or offset + length > size:
        raise refused(path, f"its .metadata declares bytes {offset}..{offset + length} of it, "
                            f"past its {size} bytes")


class FileRange(io.RawIOBase):
    """Bytes [offset, offset + length) of an open checkpoint file, read as a file of their own:
    reads stop at its end and never allocate more than is left, whatever size a reader asks for
    (zipfile asks for the size a central directory declares). Refused when past the file's end."""

    def __init__(self, f: BinaryIO, source: str | os.PathLike, offset: int = 0, length: int | None = None):
        super().__init__()
        size = os.fstat(f.fileno()).st_size
        self.length = size - offset if length is None else length
        check_range(source, size, offset, self.length)
        self._file, self.source, self._offset, self._pos = f, source, offset, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.length}[whence]
        if base + pos < 0:
            raise ValueError(f"seek to {base + pos}, before the start")
        self._pos = base + pos
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self._pos))
        if n == 0:
            return 0
        self._file.seek(self._offset + self._pos)
        got = self._file.readinto(memoryview(buffer).cast("B")[:n]) or 0
        self._pos += got
        return got

    def read(self, size: int = -1) -> bytes:
        left = max(0, self.length - self._pos)
        return super().read(left if size is None or size < 0 else min(size, left))


# -- torch DCP's .metadata ------------------------------------------------------------------------

def _is_torch_constant(module: str, name: str) -> bool:
    # torch.__dict__, not getattr: torch's module __getattr__ imports submodules on demand.
    return module == "torch" and isinstance(torch.__dict__.get(name), (torch.dtype, torch.layout, torch.memory_format))


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals in `allowed`: any other one (a function to
    call, a class to build) raises `CheckpointRefused` before it is even imported. Give it a pickle
    `check_pickle_bounds` has walked: it allocates the sizes a pickle names."""

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


def check_pickle_bounds(data: bytes, source: str | os.PathLike) -> None:
    """Walk a pickle's opcodes, building nothing, so that the C unpickler run next allocates no
    size the pickle merely names: pickletools reads each declared string, bytes or number against
    the bytes that remain; a frame must fit them too, and a memo index must be the next one (the
    unpickler sizes its memo table by the index: `r` and a 4-byte index, 2 GiB)."""
    stored = 0  # objects put in the memo so far: a pickler numbers them 0, 1, 2, ...
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name == "FRAME" and arg > len(data) - pos:
                raise refused(source, f"it declares a frame of {arg} bytes at byte {pos}, past its end")
            if op.name in _MEMO_PUTS:
                if arg > stored:
                    raise refused(source, f"it puts object number {arg} in its memo after {stored} objects")
                stored += 1
            elif op.name == "MEMOIZE":
                stored += 1
    except ValueError as e:  # truncated, or a length past the end
        raise refused(source, f"it is not a well-formed pickle ({_one_line(str(e))})") from None


def read_dcp_metadata(path: Path) -> Any:
    """torch DCP's `.metadata` (a `torch.distributed.checkpoint.Metadata`), read with
    `RestrictedUnpickler`; every storage file it names must lie in the checkpoint directory, as
    plain bytes (no stream transform) at a valid offset."""
    from torch.distributed.checkpoint.metadata import Metadata

    data = read_checkpoint_bytes(path)  # in proportion to the model, so no cap but its size
    check_pickle_bounds(data, path)
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data), path).load()
    except CheckpointRefused:
        raise
    except Exception as e:  # a well-formed pickle of the wrong shape
        raise refused(path, f"it is not torch DCP metadata ({type(e).__name__}: {_one_line(str(e))})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise refused(path, f"it holds a {type(metadata).__name__}, not torch DCP metadata")
    for info in metadata.storage_data.values():
        # DCP joins this to the directory: a path or `..` would read any file on the host.
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or os.sep in name:
            raise refused(path, f"it points at {name!r}, outside the checkpoint directory")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise refused(path, f"it gives {name} a byte range of offset {offset!r}, length {length!r}")
        # A transform (torch's zstd) would inflate an item past its bytes; torch_dist writes none.
        if getattr(info, "transform_descriptors", None):
            raise refused(path, f"it asks to decode {name} with {list(info.transform_descriptors)!r}; "
                                "asyncrl reads only plain, untransformed items")
    return metadata


def check_dcp_storage(metadata: Any, ckpt_dir: str | os.PathLike) -> None:
    """Every byte range `metadata` (from `read_dcp_metadata`) declares lies in its shard, a
    regular file of the directory: checked before any shard is read."""
    by_file: dict[str, list[Any]] = {}
    for info in metadata.storage_data.values():
        by_file.setdefault(info.relative_path, []).append(info)
    for name, infos in by_file.items():
        path = Path(ckpt_dir) / name
        with open_checkpoint_file(path) as f:
            size = os.fstat(f.fileno()).st_size
        check_shard(path, size, infos)


def check_shard(path: str | os.PathLike, size: int, infos: list[Any]) -> None:
    """A shard of `size` bytes holds exactly the byte ranges (`_StorageInfo`s) its metadata declares
    of it: each within it, and nothing after the last (torch writes them back to back)."""
    for info in infos:
        check_range(path, size, info.offset, info.length)
    declared = max((info.offset + info.length for info in infos), default=0)
    if size != declared:
        raise refused(path, f"it is {size} bytes; its .metadata declares {declared}")


# -- torch.save archives (common.pt, the items of the .distcp shards) ------------------------------

def check_torch_zip(f: FileRange) -> None:
    """Refuse a torch.save archive that torch.load would make larger than its bytes, before it
    does: a zip archive (torch's legacy format allocates each storage at the size its pickle
    names), every entry stored uncompressed as torch.save writes it (a deflated entry inflates up
    to ~1000x), and declaring no more bytes than lie before the next entry (torch allocates a
    record at its declared size before reading it)."""
    source = f.source
    f.seek(0)
    if f.read(len(_ZIP_LOCAL_HEADER)) != _ZIP_LOCAL_HEADER:
        raise refused(source, "it is not a torch.save archive (a zip file)")
    try:
        entries = sorted(zipfile.ZipFile(f).infolist(), key=lambda e: e.header_offset)
    except Exception as e:  # zipfile's errors for a malformed archive are of several types
        raise refused(source, f"it is not a readable zip archive ({type(e).__name__}: {_one_line(str(e))})") from None
    ends = [e.header_offset for e in entries[1:]] + [f.length]
    for entry, end in zip(entries, ends):
        if entry.compress_type != zipfile.ZIP_STORED:
            raise refused(source, f"its entry {entry.filename!r} is compressed (zip method {entry.compress_type}); "
                                  "torch.save stores entries uncompressed")
        if entry.file_size != entry.compress_size or entry.header_offset + entry.file_size > end:
            raise refused(source, f"its entry {entry.filename!r} declares {entry.file_size} bytes, "
                                  f"more than the archive holds there")
    f.seek(0)


def refused_pickle(path: str | os.PathLike, error: pickle.UnpicklingError) -> CheckpointRefused:
    """`torch.load(weights_only=True)`'s refusal (a paragraph of advice) as one line."""
    text = str(error)
    found = _GLOBAL_IN_TORCH_ERROR.search(text)
    if found:
        return refused_global(path, found.group(1))
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and not ln.strip().startswith(_TORCH_BOILERPLATE)]
    return refused(path, f"it is not plain data ({lines[0] if lines else _one_line(text)})")


def load_weights_only(f: str | os.PathLike | FileRange) -> Any:
    """A torch.save archive (a file's path, or a `FileRange` of one), checked by
    `check_torch_zip`, then loaded by `torch.load` with torch's weights-only unpickler (tensors,
    containers, numbers, strings and the classes registered with
    `torch.serialization.add_safe_globals`)."""
    if not isinstance(f, FileRange):
        with open_checkpoint_file(f) as opened:
            return load_weights_only(FileRange(opened, f))
    check_torch_zip(f)
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused_pickle(f.source, e) from None


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


# -- trainer_state.json ----------------------------------------------------------------------------

class _NotFinite(ValueError):
    pass


def _finite(text: str) -> float:
    value = float(text)  # "1e999" parses, as inf
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def _refuse_constant(name: str) -> Any:
    raise _NotFinite(name)  # NaN, Infinity, -Infinity: JSON's extensions that Python accepts


def read_checkpoint_json(path: str | os.PathLike, max_bytes: int | None = STATE_JSON_MAX_BYTES) -> Any:
    """A JSON file of a checkpoint (`read_checkpoint_bytes`, at most `max_bytes`; None: any length),
    every number in it finite."""
    data = read_checkpoint_bytes(path, max_bytes)
    try:
        return json.loads(data, parse_float=_finite, parse_constant=_refuse_constant)
    except _NotFinite as e:
        raise refused(path, f"it holds {e}; every number in it must be finite") from None
    except (ValueError, RecursionError) as e:  # not JSON, or not text at all (a pickle); nested too deep
        raise refused(path, f"it is not the JSON asyncrl writes ({type(e).__name__}: {_one_line(str(e))})") from None


def write_trainer_state(ckpt_dir: str | os.PathLike, step: int, scheduler: dict[str, Any]) -> Path:
    """The trainer's step and its LR schedule's state (megatron's OptimizerParamScheduler:
    numbers and style names) as JSON."""
    path = Path(ckpt_dir) / TRAINER_STATE
    # allow_nan=False: a NaN or infinite number fails here, not at the load that would refuse it.
    path.write_text(json.dumps({"format": TRAINER_STATE_FORMAT, "step": step, "scheduler": scheduler},
                               indent=2, allow_nan=False) + "\n")
    return path


def read_trainer_state(ckpt_dir: str | os.PathLike) -> tuple[int, dict[str, Any]]:
    """(step, scheduler state) from `write_trainer_state`'s file; anything else is refused."""
    path = Path(ckpt_dir) / TRAINER_STATE
    state = read_checkpoint_json(path)
    if not (isinstance(state, dict) and set(state) == {"format", "step", "scheduler"}):
        raise refused(path, 'expected {"format", "step", "scheduler"}')
    if state["format"] != TRAINER_STATE_FORMAT:
        raise refused(path, f"format {state['format']!r}; this asyncrl reads format {TRAINER_STATE_FORMAT}")
    step, scheduler = state["step"], state["scheduler"]
    if type(step) is not int or not 0 <= step <= MAX_COUNT:
        raise refused(path, f"step {step!r} is not a count of steps")
    if not isinstance(scheduler, dict):
        raise refused(path, "the scheduler's state must map names to numbers or strings")
    try:
        _SchedulerState.model_validate(scheduler)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]
        raise refused(path, f"scheduler.{'.'.join(str(x) for x in error['loc'])}: {error['msg']}") from None
    return step, scheduler


# What megatron-core 0.16.1's OptimizerParamScheduler.state_dict holds: its numbers within what a run can
# have set (the learning rate the optimizer takes from it: 1e308 was accepted), its styles by name.
MAX_COUNT = 10**12  # steps or samples
_Count = Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
_Rate = Annotated[float, Field(strict=True, ge=0, le=1, allow_inf_nan=False)]  # learning rates
_Decay = Annotated[float, Field(strict=True, ge=0, le=10, allow_inf_nan=False)]  # weight decay


class _SchedulerState(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    max_lr: _Rate
    min_lr: _Rate
    lr_warmup_steps: _Count
    num_steps: _Count
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
    lr_decay_steps: _Count
    start_wd: _Decay
    end_wd: _Decay
    wd_incr_style: Literal["constant", "linear", "cosine"]
    wd_incr_steps: _Count

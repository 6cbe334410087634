"""Loading a checkpoint never runs code from it (docs/security.md, "Checkpoints").

One real trainer (TP=1, gloo, in a Ray actor) trains a step and saves a checkpoint; each attack
copies it, plants a pickle whose `__reduce__` runs `touch MARKER` into one file the load reads,
and loads it into the same trainer: the load must fail with one line naming the file and what
it asked for, and the marker must not exist. The trainer runs with
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (an operator's setting that turns torch.load's safe default
off): what holds must not depend on the environment. Other attacks make a small checkpoint
ask for far more memory than its bytes (a shard linked to /dev/zero, a byte range past its file):
the load must be refused before that memory is asked for. Then the honest checkpoint still loads
exactly. The fast tests at the end check the parsers without a trainer, on the files alone or on
a tiny torch DCP checkpoint written in this process.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import stat
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from asyncrl.actors import create_trainer
from asyncrl.messages import error_line
from asyncrl.run_config import load_config
from asyncrl.trainer.trainer_rank import TrainerRank
from tests.trainer_data import make_groups


class Payload:
    """What an attacker plants: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class CheckpointProbeRank(TrainerRank):
    """A TrainerRank that can set an environment variable and report its LR schedule."""

    def set_env(self, key: str, value: str) -> None:
        os.environ[key] = value

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()


def refusal(e: BaseException) -> str:
    """The error's one line (a trainer error arrives wrapped by Ray); fails if it has several."""
    cause = getattr(e, "cause", None)
    text = str(cause if isinstance(cause, BaseException) else e)
    assert "\n" not in text.strip(), f"not one line: {text[:3000]}"
    return error_line(e)


# -- one trainer, one honest checkpoint -------------------------------------------------------

@pytest.fixture(scope="module")
def trainer(ray_cluster, base_model):
    group = create_trainer(load_config([]), rank_class=CheckpointProbeRank)
    try:
        group.setup()
        group.on_ranks(lambda r: r.set_env.remote("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1"))
        yield group
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def honest(trainer, base_model, tmp_path_factory) -> dict:
    """A checkpoint after one train step (non-trivial Adam state, step 1), and what it holds."""
    root = tmp_path_factory.mktemp("ckpt")
    trainer.train_step(make_groups(AutoTokenizer.from_pretrained(base_model), seed=0), 0)
    path = Path(trainer.save_checkpoint(str(root / "step_000001")))
    weights = load_file(f"{trainer.export_hf(str(root / 'hf'))}/model.safetensors")
    return {"path": path, "weights": weights, "scheduler": trainer.on_ranks(lambda r: r.scheduler_state.remote())}


@pytest.fixture
def ckpt(honest, tmp_path) -> Path:
    """A copy of the honest checkpoint to plant things in."""
    return Path(shutil.copytree(honest["path"], tmp_path / "step_000001"))


@pytest.fixture
def marker(tmp_path) -> Path:
    m = tmp_path / "pwned"
    yield m
    assert not m.exists(), "the planted pickle ran"


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def refused_line(path: Path, name: str) -> str:
    return f"CheckpointRefused: checkpoint {path} refused: it asks to load {name}, which a checkpoint never holds"


def load_refused(trainer, ckpt: Path) -> str:
    with pytest.raises(Exception) as info:
        trainer.load_checkpoint(str(ckpt))
    return refusal(info.value)


def own_metadata(path: Path):
    """The `.metadata` a test has just written, read with asyncrl's restricted unpickler (no test
    unpickles with a general one: what it edits is data, and it stays so)."""
    from asyncrl.trainer.safe_checkpoint import DCP_METADATA_GLOBALS, RestrictedUnpickler

    # torch's own save records the directory as a PosixPath (megatron's does not)
    allowed = DCP_METADATA_GLOBALS | {("pathlib", "PosixPath"), ("pathlib._local", "PosixPath")}
    return RestrictedUnpickler(io.BytesIO(path.read_bytes()), path, allowed).load()


def rewrite_item(ckpt: Path, want_bytes: bool, payload: bytes, outside: Path | None = None) -> Path:
    """Point one item of the DCP metadata (a byte item, e.g. a layer's `_extra_state`, or a
    tensor chunk) at `payload`: appended to its .distcp file, or in `outside` (a file beside the
    checkpoint). The metadata stays well formed: only its own classes. Returns the file read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_file = ckpt / ".metadata"
    metadata = own_metadata(meta_file)
    fqn = next(k for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) == want_bytes)
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    if outside is None:
        target = ckpt / info.relative_path
        info.offset = target.stat().st_size
        with open(target, "ab") as f:
            f.write(payload)
    else:
        target = outside
        target.write_bytes(payload)
        info.relative_path, info.offset = os.path.relpath(target, ckpt), 0
    info.length = len(payload)
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    return target


# -- the attacks -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.attack
def test_trainer_state_pickle_is_refused(trainer, ckpt, marker):
    """(a) The trainer's own state file replaced by a pickle (under its old and new names)."""
    blob = torch_saved({"step": 1, "scheduler": Payload(marker)})
    for name in ("trainer_state.pt", "trainer_state.json"):
        (ckpt / name).write_bytes(blob)
    line = load_refused(trainer, ckpt)
    assert line.startswith(f"CheckpointRefused: checkpoint {ckpt / 'trainer_state.json'} refused: "), line


@pytest.mark.slow
@pytest.mark.attack
def test_dcp_metadata_pickle_is_refused(trainer, ckpt, marker):
    """(b) torch DCP's `.metadata`, which torch reads with a full pickle.load."""
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    assert load_refused(trainer, ckpt) == refused_line(ckpt / ".metadata", "posix.system")


@pytest.mark.slow
@pytest.mark.attack
def test_dcp_metadata_with_a_payload_inside_is_refused(trainer, ckpt, marker):
    """(b') A well-formed `.metadata` carrying the payload in one of its fields."""
    metadata = own_metadata(ckpt / ".metadata")
    metadata.planner_data = {"x": Payload(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    assert load_refused(trainer, ckpt) == refused_line(ckpt / ".metadata", "posix.system")


@pytest.mark.slow
@pytest.mark.attack
def test_common_pt_pickle_is_refused(trainer, ckpt, marker):
    """(c) megatron's `common.pt` (torch.load without an explicit weights_only)."""
    (ckpt / "common.pt").write_bytes(torch_saved({"optimizer": Payload(marker)}))
    assert load_refused(trainer, ckpt) == refused_line(ckpt / "common.pt", "posix.system")


@pytest.mark.slow
@pytest.mark.attack
def test_distcp_byte_item_pickle_is_refused(trainer, ckpt, marker):
    """(d) A byte item of a `.distcp` shard (megatron's ShardedObjects, e.g. `_extra_state`),
    which torch's DefaultLoadPlanner.load_bytes reads with torch.load(weights_only=False)."""
    target = rewrite_item(ckpt, want_bytes=True, payload=torch_saved(Payload(marker)))
    assert load_refused(trainer, ckpt) == refused_line(target, "posix.system")


@pytest.mark.slow
@pytest.mark.attack
def test_distcp_tensor_item_pickle_is_refused(trainer, ckpt, marker):
    """(e) A tensor chunk of a `.distcp` shard (torch reads it with weights_only=True)."""
    target = rewrite_item(ckpt, want_bytes=False, payload=torch_saved(Payload(marker)))
    assert load_refused(trainer, ckpt) == refused_line(target, "posix.system")


@pytest.mark.slow
@pytest.mark.attack
def test_metadata_pointing_outside_the_checkpoint_is_refused(trainer, ckpt, marker, tmp_path):
    """(f) `.metadata` pointing a byte item at a file outside the checkpoint directory."""
    rewrite_item(ckpt, want_bytes=True, payload=torch_saved(Payload(marker)), outside=tmp_path / "elsewhere.bin")
    line = load_refused(trainer, ckpt)
    assert line == (f"CheckpointRefused: checkpoint {ckpt / '.metadata'} refused: it points at "
                    f"'../elsewhere.bin', outside the checkpoint directory"), line


# A byte range no machine can allocate: a reader that trusts it fails with MemoryError at once,
# one that checks it refuses the checkpoint without asking for any memory.
HUGE = 2 ** 40


def byte_item_shard(ckpt: Path, length: int) -> Path:
    """Declare `length` bytes for one byte item of the DCP metadata (the metadata stays well
    formed); returns the shard that item lies in."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_file = ckpt / ".metadata"
    metadata = own_metadata(meta_file)
    fqn = next(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    info.length = length
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    return ckpt / info.relative_path


@pytest.mark.slow
@pytest.mark.attack
def test_distcp_shard_linked_to_dev_zero_is_refused(trainer, ckpt):
    """(g) A shard replaced by a symbolic link to /dev/zero, one of its items declared 1 TiB long:
    torch would read 1 TiB of zeros (a 1 GiB declaration took 1 GiB before the load failed)."""
    shard = byte_item_shard(ckpt, HUGE)
    shard.unlink()
    shard.symlink_to("/dev/zero")
    assert load_refused(trainer, ckpt) == (f"CheckpointRefused: checkpoint {shard} refused: it is a symbolic "
                                           f"link; checkpoint files are read as regular files only")


@pytest.mark.slow
@pytest.mark.attack
def test_distcp_byte_range_past_the_shard_is_refused(trainer, ckpt):
    """(h) An item of a regular shard declared 1 TiB long: refused by the shard's size, before
    torch allocates what the metadata declares."""
    shard = byte_item_shard(ckpt, HUGE)
    line = load_refused(trainer, ckpt)
    assert line.startswith(f"CheckpointRefused: checkpoint {shard} refused: its .metadata declares bytes "), line
    assert line.endswith(f", past its {shard.stat().st_size} bytes"), line


@pytest.mark.slow
def test_honest_checkpoint_loads_exactly(trainer, honest, tmp_path):
    """After all the refusals, the honest checkpoint loads: same step, weights, LR schedule."""
    assert trainer.load_checkpoint(str(honest["path"])) == 1
    weights = load_file(f"{trainer.export_hf(str(tmp_path / 'hf'))}/model.safetensors")
    assert set(weights) == set(honest["weights"])
    assert all(torch.equal(weights[k], honest["weights"][k]) for k in weights)
    state = json.loads((honest["path"] / "trainer_state.json").read_text())
    assert state == {"format": 1, "step": 1, "scheduler": honest["scheduler"]}
    # megatron's scheduler.load_state_dict adds the saved step count to its own, and this trainer
    # has trained one step (asyncrl loads checkpoints only into fresh trainers).
    assert trainer.on_ranks(lambda r: r.scheduler_state.remote()) == {**honest["scheduler"], "num_steps": 2}


# -- the parsers, without a trainer -------------------------------------------------------------

def test_restricted_unpickler_refuses_any_other_global(tmp_path):
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_dcp_metadata

    path = tmp_path / ".metadata"
    for obj, name in [(Payload(tmp_path / "x"), "posix.system"), (print, "builtins.print"),
                      (torch.load, "torch.serialization.load"), (getattr, "builtins.getattr")]:
        path.write_bytes(pickle.dumps(obj))
        with pytest.raises(CheckpointRefused, match=re.escape(f"it asks to load {name},")):
            read_dcp_metadata(path)
    assert not (tmp_path / "x").exists()


def test_trainer_state_must_be_the_json_asyncrl_writes(tmp_path):
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_trainer_state, write_trainer_state

    write_trainer_state(tmp_path, 3, SCHEDULER)
    assert read_trainer_state(tmp_path) == (3, SCHEDULER)
    for bad in ['{"format": 1, "step": "3", "scheduler": {}}', '{"format": 1, "step": 3, "scheduler": {"a": [1]}}',
                '{"format": 2, "step": 3, "scheduler": {}}', "[1]", "{"]:
        (tmp_path / "trainer_state.json").write_text(bad)
        with pytest.raises(CheckpointRefused) as info:
            read_trainer_state(tmp_path)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"checkpoint {tmp_path}/trainer_state.json")


# megatron-core 0.16.1's OptimizerParamScheduler.state_dict(), as a run with the defaults writes it
SCHEDULER = {"max_lr": 1e-4, "lr_warmup_steps": 0, "num_steps": 3, "lr_decay_style": "constant",
             "lr_decay_steps": 100, "min_lr": 0.0, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
             "wd_incr_steps": 100}


@pytest.mark.attack
@pytest.mark.parametrize("change,why", [
    ({"max_lr": 1e308}, "scheduler.max_lr: Input should be less than or equal to 1"),
    ({"min_lr": -1.0}, "scheduler.min_lr: Input should be greater than or equal to 0"),
    ({"num_steps": 10**15}, "scheduler.num_steps: Input should be less than or equal to 1000000000000"),
    ({"lr_warmup_steps": 2.5}, "scheduler.lr_warmup_steps: Input should be a valid integer"),
    ({"lr_decay_style": "exponential"}, "scheduler.lr_decay_style: Input should be 'constant'"),
    ({"start_wd": "0"}, "scheduler.start_wd: Input should be a valid number"),
    ({"extra": 1}, "scheduler.extra: Extra inputs are not permitted"),
], ids=["max_lr", "min_lr", "num_steps", "warmup-float", "style", "wd-string", "extra-key"])
def test_trainer_state_numbers_out_of_range_are_refused(tmp_path, change, why):
    """A finite but absurd max_lr (1e308) became the optimizer's learning rate."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_trainer_state, write_trainer_state

    write_trainer_state(tmp_path, 3, {**SCHEDULER, **change})
    with pytest.raises(CheckpointRefused, match=re.escape(why)):
        read_trainer_state(tmp_path)
    write_trainer_state(tmp_path, 10**13, SCHEDULER)
    with pytest.raises(CheckpointRefused, match="step 10000000000000 is not a count of steps"):
        read_trainer_state(tmp_path)


# -- a checkpoint asks for no more memory than it holds, without a trainer -------------------------

def tiny_dcp(root: Path) -> Path:
    """A torch DCP checkpoint written in this process (no process group): one tensor item and two
    byte items in `__0_0.distcp`, as megatron's torch_dist strategy writes them."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(12.0).reshape(3, 4), "obj": {"a": [1, 2], "b": "x"}},
             checkpoint_id=str(root), no_dist=True)
    metadata = own_metadata(root / ".metadata")
    metadata.storage_meta = None  # torch records the directory as a PosixPath, which megatron's save does not
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    return root


def load_tiny_dcp(root: Path) -> dict:
    """`tiny_dcp`'s checkpoint through asyncrl's reader; a refusal raised as itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from asyncrl.trainer.safe_dist_checkpoint import SafeFileSystemReader

    state = {"w": torch.zeros(3, 4), "obj": {"a": None, "b": None}}
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(root), no_dist=True)
    except CheckpointException as e:  # torch DCP's report of every rank's error
        raise next(error for error, _ in e.failures.values()) from None
    return state


def edit_storage(root: Path, fqn: str, **fields) -> Path:
    """Set fields of one item's storage info in `.metadata`; returns the shard it lies in."""
    metadata = own_metadata(root / ".metadata")
    info = next(v for k, v in metadata.storage_data.items() if k.fqn == fqn)
    for name, value in fields.items():
        setattr(info, name, value)
    (root / ".metadata").write_bytes(pickle.dumps(metadata))
    return root / info.relative_path


def deflated(archive: bytes) -> bytes:
    """The same torch.save archive with every entry deflated (what torch.save never writes)."""
    source, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for entry in source.infolist():
            z.writestr(entry.filename, source.read(entry))
    return out.getvalue()


def test_honest_tiny_dcp_loads_exactly(tmp_path):
    state = load_tiny_dcp(tiny_dcp(tmp_path / "ckpt"))
    assert torch.equal(state["w"], torch.arange(12.0).reshape(3, 4)) and state["obj"] == {"a": [1, 2], "b": "x"}


def reader_of(root: Path, name: str):
    """What reads checkpoint file `name` of the directory `root` (a shard: the whole tiny DCP load)."""
    from asyncrl.trainer.safe_checkpoint import load_weights_only, read_dcp_metadata, read_trainer_state

    return {"trainer_state.json": lambda: read_trainer_state(root), ".metadata": lambda: read_dcp_metadata(root / name),
            "common.pt": lambda: load_weights_only(root / name), "__0_0.distcp": lambda: load_tiny_dcp(root)}[name]


@pytest.mark.attack
@pytest.mark.parametrize("name", ["trainer_state.json", ".metadata", "common.pt"])
def test_checkpoint_file_linked_to_dev_zero_is_refused(tmp_path, name):
    """(i) A checkpoint file as a symbolic link to /dev/zero: trainer_state.json so linked ran the
    trainer to MemoryError (2.5 GiB). Refused before a byte is read, as is a link to a regular file."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    path = tmp_path / name
    load = reader_of(tmp_path, name)
    for target in ("/dev/zero", tmp_path / "elsewhere"):
        (tmp_path / "elsewhere").write_bytes(torch_saved({"x": 1}))
        path.unlink(missing_ok=True)
        path.symlink_to(target)
        with pytest.raises(CheckpointRefused) as info:
            load()
        assert str(info.value) == (f"checkpoint {path} refused: it is a symbolic link; "
                                   "checkpoint files are read as regular files only")


@pytest.mark.attack
@pytest.mark.parametrize("kind", ["FIFO", "character device", "directory"])
@pytest.mark.parametrize("name", ["trainer_state.json", ".metadata", "common.pt", "__0_0.distcp"])
def test_checkpoint_file_that_is_not_a_regular_file_is_refused(tmp_path, name, kind):
    """(j) A checkpoint file that is a FIFO (opening it waited for a writer forever), a device (a
    copy of /dev/zero's node) or a directory: refused without reading, or opening a FIFO or device."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    root = tiny_dcp(tmp_path / "ckpt")
    path = root / name
    path.unlink(missing_ok=True)
    try:
        {"FIFO": lambda: os.mkfifo(path), "directory": lambda: path.mkdir(),
         "character device": lambda: os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))}[kind]()
    except PermissionError:
        pytest.skip(f"this machine lets no one here make a {kind}")
    load = reader_of(root, name)
    with pytest.raises(CheckpointRefused) as info:
        load()
    assert str(info.value) == (f"checkpoint {path} refused: it is a {kind}; "
                               "checkpoint files are read as regular files only")


@pytest.mark.attack
@pytest.mark.parametrize("item", ["common.pt", "byte item", "tensor item"])
def test_deflated_torch_archive_is_refused(tmp_path, item):
    """(k) A torch.save archive whose entries are deflated: 64 KiB that torch.load would inflate
    into a 64 MiB tensor (0.5 MiB made 512 MiB). Refused before torch.load reads it, as
    common.pt and as an item of a shard."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, load_weights_only

    bomb = deflated(torch_saved(torch.zeros(2 ** 26, dtype=torch.uint8)))
    assert len(bomb) < 2 ** 17
    root = tiny_dcp(tmp_path / "ckpt")
    if item == "common.pt":
        path = root / "common.pt"
        path.write_bytes(bomb)
        load = lambda: load_weights_only(path)  # noqa: E731
    else:
        path = root / "__0_0.distcp"
        offset = path.stat().st_size
        with open(path, "ab") as f:
            f.write(bomb)
        edit_storage(root, "obj.a" if item == "byte item" else "w", offset=offset, length=len(bomb))
        load = lambda: load_tiny_dcp(root)  # noqa: E731
    with pytest.raises(CheckpointRefused) as info:
        load()
    assert re.fullmatch(rf"checkpoint {re.escape(str(path))} refused: its entry '[\w/.]+' is compressed "
                        r"\(zip method 8\); torch.save stores entries uncompressed", str(info.value)), info.value


@pytest.mark.attack
def test_byte_range_past_the_shard_is_refused_before_it_is_read(tmp_path):
    """(l) asyncrl's DCP reader, on its own: an item declared 1 TiB long (or past the shard's end)
    is refused by the shard's size before anything is read or allocated."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    root = tiny_dcp(tmp_path / "ckpt")
    shard = root / "__0_0.distcp"
    size = shard.stat().st_size
    for offset, length in [(0, HUGE), (size, 1)]:
        edit_storage(root, "obj.b", offset=offset, length=length)
        with pytest.raises(CheckpointRefused) as info:
            load_tiny_dcp(root)
        assert str(info.value) == (f"checkpoint {shard} refused: its .metadata declares bytes "
                                   f"{offset}..{offset + length} of it, past its {size} bytes")


@pytest.mark.attack
@pytest.mark.parametrize("kind", ["sparse", "appended"])
def test_a_shard_longer_than_its_metadata_declares_is_refused_before_it_is_read(tmp_path, kind):
    """A shard 512 MiB long with 12 KiB on disk, its items declaring a few bytes, loaded and cost +515 MiB
    of RSS. A shard holds its items back to back and nothing else."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    root = tiny_dcp(tmp_path / "ckpt")
    shard = root / "__0_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        if kind == "sparse":
            f.truncate(512 << 20)
        else:
            f.seek(0, 2)
            f.write(b"x" * 100)
    why = f"it is sparse: {512 << 20} bytes long with " if kind == "sparse" else \
        f"it is {size + 100} bytes; its .metadata declares {size}"
    with pytest.raises(CheckpointRefused, match=re.escape(f"checkpoint {shard} refused: {why}")):
        load_tiny_dcp(root)


@pytest.mark.attack
@pytest.mark.parametrize("pickled,why", [
    (b"\x80\x02N" + b"r" + struct.pack("<I", 2 ** 32 - 1) + b".", "it puts object number 4294967295 in its memo"),
    (b"\x80\x04\x8e" + struct.pack("<Q", HUGE) + b"x.", "it is not a well-formed pickle"),
    (b"\x80\x04\x95" + struct.pack("<Q", HUGE) + b"N.", "it declares a frame of"),
], ids=["memo-index", "bytes-length", "frame-length"])
def test_dcp_metadata_declaring_more_than_it_holds_is_refused(tmp_path, pickled, why):
    """(m) A `.metadata` of a few bytes naming a size: a memo index (python's unpickler sizes its
    memo table by it: 9 bytes took 2 GiB), a bytes object or a frame of 1 TiB. Refused before
    the unpickler runs, not by its MemoryError."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_dcp_metadata

    path = tmp_path / ".metadata"
    path.write_bytes(pickled)
    with pytest.raises(CheckpointRefused, match=re.escape(f"checkpoint {path} refused: {why}")):
        read_dcp_metadata(path)


def test_dcp_metadata_asking_to_decompress_is_refused(tmp_path):
    """A stream transform (torch's zstd) would inflate an item past its bytes: refused."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_dcp_metadata

    root = tiny_dcp(tmp_path / "ckpt")
    edit_storage(root, "w", transform_descriptors=["stream.zstd/1"])
    with pytest.raises(CheckpointRefused, match=re.escape("it asks to decode __0_0.distcp with ['stream.zstd/1']")):
        read_dcp_metadata(root / ".metadata")


def test_torch_archive_entries_must_fit_the_file(tmp_path):
    """A stored entry declaring more bytes than lie before the next one is refused before torch
    allocates the record (torch's zip reader sizes it by the declaration)."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, load_weights_only

    archive = bytearray(torch_saved(torch.zeros(4, dtype=torch.uint8)))
    name = next(n for n in zipfile.ZipFile(io.BytesIO(bytes(archive))).namelist() if n.endswith("data/0"))
    # Its record in the central directory: signature, 42 bytes, then the name.
    record = archive.index(b"PK\x01\x02")
    while archive[record + 46:record + 46 + len(name)] != name.encode():
        record = archive.index(b"PK\x01\x02", record + 4)
    struct.pack_into("<II", archive, record + 20, 2 ** 31, 2 ** 31)  # its compressed and plain sizes
    path = tmp_path / "common.pt"
    path.write_bytes(archive)
    with pytest.raises(CheckpointRefused, match=re.escape(f"its entry '{name}' declares 2147483648 bytes")):
        load_weights_only(path)


@pytest.mark.attack
@pytest.mark.parametrize("number", ["NaN", "-Infinity", "Infinity", "1e999", "-1e999"])
def test_trainer_state_numbers_must_be_finite(tmp_path, number):
    """(n) A learning rate (or any number) of trainer_state.json that is NaN or infinite: Python's
    json reads them (JSON has none), and the run would train with it."""
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_trainer_state

    path = tmp_path / "trainer_state.json"
    path.write_text(f'{{"format": 1, "step": 3, "scheduler": {{"max_lr": {number}, "num_steps": 3}}}}')
    with pytest.raises(CheckpointRefused) as info:
        read_trainer_state(tmp_path)
    assert str(info.value) == f"checkpoint {path} refused: it holds {number}; every number in it must be finite"


@pytest.mark.attack
def test_trainer_state_over_its_cap_is_refused(tmp_path):
    """(o) A trainer_state.json over STATE_JSON_MAX_BYTES (1 MiB; asyncrl writes ~300 bytes) is
    refused by its size, before it is read: its JSON below is otherwise valid."""
    from asyncrl.trainer.safe_checkpoint import STATE_JSON_MAX_BYTES, CheckpointRefused, read_trainer_state

    path = tmp_path / "trainer_state.json"
    path.write_text('{"format": 1, "step": 3, "scheduler": {}}' + " " * STATE_JSON_MAX_BYTES)
    with pytest.raises(CheckpointRefused) as info:
        read_trainer_state(tmp_path)
    assert str(info.value) == (f"checkpoint {path} refused: it is {path.stat().st_size} bytes; "
                               f"this file is at most {STATE_JSON_MAX_BYTES} bytes")


@pytest.mark.attack
@pytest.mark.parametrize("name", ["run_state.json", "queue.json", "ledger.json", "loops.json"])
def test_the_drivers_checkpoint_files_linked_to_dev_zero_are_refused(tmp_path, name):
    """The run's own files of a checkpoint (asyncrl/control/run_checkpoint.py) are read as regular
    files too: a link to /dev/zero is refused, not read until memory runs out."""
    from asyncrl.control.run_checkpoint import RunCheckpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    for other in ("run_state.json", "queue.json", "ledger.json", "loops.json"):
        (tmp_path / other).write_text("{}")
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to("/dev/zero")
    with pytest.raises(CheckpointRefused, match=f"{name} refused: it is a symbolic link"):
        RunCheckpoint.read(tmp_path)


CRAFTED_SAMPLES = {  # what a crafted queue.json can hold that numpy would have read as numbers, or too large
    "token id of 2**70": {"token": 2**70},
    "token id as a string": {"token": "3"},
    "token id as a float": {"token": 3.5},
    "reward of 1e200": {"reward": 1e200},
    "NaN teacher logprob": {"teacher": "NaN"},
}


@pytest.mark.attack
@pytest.mark.parametrize("what", CRAFTED_SAMPLES)
def test_a_crafted_queue_in_a_checkpoint_is_dropped_before_it_is_trained(tmp_path, what):
    """queue.json's groups are trained as they are: a group the trust checks refuse (by type, then by
    value: a token id of 2**70 or "3" would crash the train step, a reward of 1e200 overflow it) is
    dropped and its prompt starts again. A NaN anywhere refuses the file."""
    from asyncrl.control.run_checkpoint import drop_untrainable
    from asyncrl.messages import QueueState
    from asyncrl.rollout.trust import TrajectoryLimits
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused, read_checkpoint_json
    from asyncrl.types import Segment, Trajectory, TrajectoryGroup

    def group(name, token=3, reward=0.0, teacher=-1.0):
        trajs = [Trajectory(name, name, [1, 2], [Segment.from_policy([token], [-1.0], 0)], reward=reward + i,
                            teacher_logprobs=[teacher]) for i in range(2)]
        return TrajectoryGroup(name, name, trajs)

    queue = QueueState([group("honest"), group("crafted", **CRAFTED_SAMPLES[what])], produced=2, consumed=0,
                       staleness_histogram={})
    (tmp_path / "queue.json").write_text(json.dumps(queue.to_dict()).replace('"NaN"', "NaN"))
    if what == "NaN teacher logprob":
        with pytest.raises(CheckpointRefused, match="queue.json refused: it holds NaN"):
            read_checkpoint_json(tmp_path / "queue.json", None)
        return
    restored = QueueState.from_dict(read_checkpoint_json(tmp_path / "queue.json", None))
    assert drop_untrainable(restored, TrajectoryLimits(vocab_size=64)) == ["crafted"]
    assert [g.group_id for g in restored.groups] == ["honest"]


def _sparse(path, length: int = 1 << 30) -> None:
    with open(path, "wb") as f:
        f.write(b"{")
        f.truncate(length)  # a hole: 1 GiB long, a few KiB on disk


@pytest.mark.attack
@pytest.mark.parametrize("name", ["ledger.json", "queue.json", "loops.json", "run_state.json"])
def test_a_sparse_driver_file_is_refused_before_it_is_read(tmp_path, name):
    """A file 1 GiB long with 4 KiB on disk was read whole before it was refused (+1.0-1.3 GiB RSS)."""
    from asyncrl.control.run_checkpoint import RunCheckpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    for other in ("run_state.json", "queue.json", "ledger.json", "loops.json"):
        (tmp_path / other).write_text("{}")
    _sparse(tmp_path / name)
    with pytest.raises(CheckpointRefused, match=f"{name} refused: it is sparse: 1073741824 bytes long with "):
        RunCheckpoint.read(tmp_path)  # refused when opened, before a byte is read


@pytest.mark.attack
def test_a_ledger_past_its_cap_is_refused_before_it_is_read(tmp_path):
    from asyncrl.control.run_checkpoint import FILE_CAPS, RunCheckpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    for other in ("run_state.json", "queue.json", "loops.json"):
        (tmp_path / other).write_text("{}")
    (tmp_path / "ledger.json").write_bytes(b" " * (FILE_CAPS["ledger.json"] + 1))  # on disk: not sparse
    with pytest.raises(CheckpointRefused, match=r"ledger\.json refused: it is \d+ bytes; this file is at most"):
        RunCheckpoint.read(tmp_path)


@pytest.mark.attack
def test_a_driver_file_of_another_shape_is_refused_naming_it(tmp_path):
    """A crafted run_state.json or queue.json used to raise a bare KeyError or TypeError."""
    from asyncrl.control.run_checkpoint import RunCheckpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    account = {"states": {}, "reasons": {}, "trained": [], "rejected": 0, "duplicates_dropped": 0}
    (tmp_path / "ledger.json").write_text(json.dumps(account))
    (tmp_path / "loops.json").write_text("[]")
    (tmp_path / "queue.json").write_text('{"groups": [{"group_id": "g"}], "produced": 0, "consumed": 0}')
    (tmp_path / "run_state.json").write_text('{"step": 1}')
    with pytest.raises(CheckpointRefused, match=r"run_state\.json refused: KeyError: 'base_eval'"):
        RunCheckpoint.read(tmp_path)


@pytest.mark.attack
def test_a_crafted_prompt_account_in_a_checkpoint_is_refused(tmp_path):
    """ledger.json is the prompt account a resumed run continues with: a state that is none of the
    account's (or a value of the wrong type) is refused with the file's name, before anything runs."""
    from asyncrl.control.run_checkpoint import RunCheckpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    account = {"states": {"p": "lost"}, "reasons": {}, "trained": [], "rejected": 0, "duplicates_dropped": 0}
    for crafted in (account, {**account, "states": {"p": "running"}, "rejected": "0"}, ["not", "an", "object"]):
        for name, text in (("run_state.json", "{}"), ("queue.json", "{}"), ("loops.json", "[]"),
                           ("ledger.json", json.dumps(crafted))):
            (tmp_path / name).write_text(text)
        with pytest.raises(CheckpointRefused, match=r"ledger\.json refused: not a prompt account"):
            RunCheckpoint.read(tmp_path)


@pytest.mark.attack
def test_a_sparse_adapter_config_is_refused_before_it_is_read(tmp_path):
    """`asyncrl eval ADAPTER_DIR` read a 1 GiB sparse adapter_config.json whole (+2 GiB)."""
    from asyncrl.evaluate import resolve_checkpoint
    from asyncrl.trainer.safe_checkpoint import CheckpointRefused

    _sparse(tmp_path / "adapter_config.json")
    with pytest.raises(CheckpointRefused, match=r"adapter_config\.json refused: it is sparse"):
        resolve_checkpoint(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": "/m", "r": 8}')
    assert resolve_checkpoint(str(tmp_path))[0].endswith("/m")

"""Loading a checkpoint never runs code from it (docs/security.md, "Checkpoints").

One real trainer (TP=1, gloo, in a Ray actor) trains a step and saves a checkpoint; each attack
copies it, plants a pickle whose `__reduce__` runs `touch MARKER` into one file the load reads,
and loads it into the same trainer: the load must fail with one line naming the file and what
it asked for, and the marker must not exist. The trainer runs with
TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (an operator's setting that turns torch.load's safe default
off): what holds must not depend on the environment. Then the honest checkpoint still loads
exactly. The fast tests at the end check the parsers without a trainer.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
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


def rewrite_item(ckpt: Path, want_bytes: bool, payload: bytes, outside: Path | None = None) -> Path:
    """Point one item of the DCP metadata (a byte item, e.g. a layer's `_extra_state`, or a
    tensor chunk) at `payload`: appended to its .distcp file, or in `outside` (a file beside the
    checkpoint). The metadata stays well formed: only its own classes. Returns the file read."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta_file = ckpt / ".metadata"
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # our own honest file
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
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
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

    scheduler = {"max_lr": 1e-4, "num_steps": 3, "lr_decay_style": "constant"}
    write_trainer_state(tmp_path, 3, scheduler)
    assert read_trainer_state(tmp_path) == (3, scheduler)
    for bad in ['{"format": 1, "step": "3", "scheduler": {}}', '{"format": 1, "step": 3, "scheduler": {"a": [1]}}',
                '{"format": 2, "step": 3, "scheduler": {}}', "[1]", "{"]:
        (tmp_path / "trainer_state.json").write_text(bad)
        with pytest.raises(CheckpointRefused) as info:
            read_trainer_state(tmp_path)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"checkpoint {tmp_path}/trainer_state.json")

"""The shared-memory weight transport (asyncrl/sync/shared_buckets.py) in one process: the
trainer's side packs into the segment, an engine worker's side maps it and hands out the
buckets as the broadcast's receive does; who may create, open or plant the segment; and the
choice of transport. Through real engines and trainer ranks: test_weight_sync.py; names, links
and modes planted under the segment's name: test_security_weight_sync.py."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch

from asyncrl.sync.collective import BackendUnavailable, BucketPlan, byte_checksum, pack_buckets
from asyncrl.sync.group_store import new_group_secret
from asyncrl.sync.shared_buckets import (
    SHM_DIR,
    SharedBucketsReader,
    SharedBucketsWriter,
    bucket_offsets,
    choose_transport,
    segment_path,
)

CPU = torch.device("cpu")


def model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(64, 32, generator=g), "a": torch.randn(3, 5, generator=g),
            "b": torch.randn(7, generator=g).to(torch.bfloat16), "c": torch.randn(9, generator=g)}


def plan_of(tensors: dict[str, torch.Tensor]) -> BucketPlan:
    specs = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    return BucketPlan.build(specs, bucket_bytes=96, alone_bytes=1024)  # big alone; a, b | c


@pytest.fixture
def secret():
    s = new_group_secret()
    yield s
    if os.path.lexists(segment_path(s)):  # a test that failed half way
        os.unlink(segment_path(s))


def test_buckets_packed_into_the_segment_reach_a_reader_in_place_or_as_views_with_their_checksums(secret):
    tensors = model(0)
    plan = plan_of(tensors)
    assert [[s.name for s in b] for b in plan.buckets] == [["big"], ["a", "b"], ["c"]]
    writer = SharedBucketsWriter("shared_memory", plan, secret, CPU)
    try:
        reader = SharedBucketsReader("shared_memory", plan, secret, writer.share, CPU)
        writer.unlink_name()  # as after every worker joined: the mappings stay, the name goes
        assert not os.path.lexists(segment_path(secret))
        pack_buckets(plan, iter(tensors.items()), CPU, out=writer.buffers())
        param = torch.zeros(64, 32)  # the engine's parameter "big" arrives in
        got, in_place = {}, {}
        for bucket, alone, sums in reader.receive_buckets({"big": param}):
            for (name, t), s in zip(bucket, sums):
                got[name], in_place[name] = t, alone
                assert s == byte_checksum(tensors[name])  # what the driver compares with the trainer's
        assert in_place == {"big": True, "a": False, "b": False, "c": False}
        assert got["big"].data_ptr() == param.data_ptr() and torch.equal(param, tensors["big"])
        assert all(torch.equal(got[n], tensors[n]) for n in tensors)
        # The next stage writes the segment again: views follow it, own copies (a load that may
        # keep the tensors) do not.
        kept = {name: t for bucket, _, _ in reader.receive_buckets(own_copies=True) for name, t in bucket}
        newer = model(1)
        writer.write(pack_buckets(plan, iter(newer.items()), CPU))
        assert torch.equal(got["a"], newer["a"]) and torch.equal(kept["a"], tensors["a"])
        assert [s for _, _, sums in reader.receive_buckets() for s in sums] == \
            [byte_checksum(newer[n]) for n in ("big", "a", "b", "c")]
        reader.close()
    finally:
        writer.close()


def test_the_segment_is_named_by_the_secret_created_0600_never_reused_and_gone_after_close(secret):
    plan = plan_of(model(0))
    path = segment_path(secret)
    assert os.path.dirname(path) == SHM_DIR and secret not in path and path != segment_path(new_group_secret())
    writer = SharedBucketsWriter("shared_memory", plan, secret, CPU)
    try:
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        assert st.st_size == bucket_offsets(plan)[1] == writer.share["nbytes"]
        with pytest.raises(FileExistsError):  # a second formation under the same name: refused, not reused
            SharedBucketsWriter("shared_memory", plan, secret, CPU)
    finally:
        writer.close()
    assert not os.path.lexists(path)
    with pytest.raises(RuntimeError, match="segment is not there"):
        SharedBucketsReader("shared_memory", plan, secret, {"nbytes": bucket_offsets(plan)[1]}, CPU)


def test_a_full_dev_shm_fails_the_formation_in_one_line_and_leaves_nothing(secret, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(BackendUnavailable, match="cannot hold .* trainer.weight_sync_transport=broadcast"):
        SharedBucketsWriter("shared_memory", plan_of(model(0)), secret, CPU)
    assert not os.path.lexists(segment_path(secret))


def place(node: str, gpu: str = "", free: int = 1 << 30) -> dict:
    return {"node": node, "device": f"{node}/{gpu}", "shm_free_bytes": free}


def test_auto_shares_only_where_every_engine_worker_is_where_rank_0_is():
    here, there = place("n0", "gpu-a"), place("n1", "gpu-a")
    assert choose_transport("auto", "cpu", here, [[here], [here, here]], 100) == "shared_memory"
    assert choose_transport("auto", "cpu", here, [[here], [there]], 100) == "broadcast"
    assert choose_transport("auto", "cpu", place("n0", free=99), [[here]], 100) == "broadcast"  # /dev/shm too small
    assert choose_transport("broadcast", "cpu", here, [[here]], 100) == "broadcast"
    # GPUs: the same GPU of the same node (NCCL refuses two ranks on one device); another GPU broadcasts
    assert choose_transport("auto", "cuda", here, [[place("n0", "gpu-a")]], 100) == "cuda_ipc"
    assert choose_transport("auto", "cuda", here, [[place("n0", "gpu-b")]], 100) == "broadcast"
    assert choose_transport("shared_memory", "cuda", here, [[here]], 100) == "cuda_ipc"
    with pytest.raises(ValueError, match="1 engine worker.* not on trainer rank 0's node; set it to auto"):
        choose_transport("shared_memory", "cpu", here, [[here], [there]], 100)
    with pytest.raises(BackendUnavailable, match="enlarge it"):
        choose_transport("shared_memory", "cpu", place("n0", free=99), [[here]], 100)
    with pytest.raises(ValueError, match="one of auto, broadcast, shared_memory"):
        choose_transport("ipc", "cpu", here, [[here]], 100)


# -- CUDA IPC: skipped without a GPU (none here: this test has not run yet) ------------------------

def _read_over_ipc(plan_wire: list, secret: str, share: dict, out) -> None:
    """An engine worker's side, in a process of its own (CUDA IPC does not open in the allocating one)."""
    plan = BucketPlan.from_wire(plan_wire)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    reader = SharedBucketsReader("cuda_ipc", plan, secret, share, device)
    param = torch.zeros(64, 32, device=device)
    sums = [s for _, _, bucket_sums in reader.receive_buckets({"big": param}) for s in bucket_sums]
    out.put((sums, param.cpu()))
    reader.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_buckets_packed_on_the_gpu_reach_another_process_on_it_through_a_cuda_ipc_handle(secret):
    import multiprocessing

    pytest.importorskip("cupy")
    device = torch.device("cuda", 0)
    tensors = {n: t.to(device) for n, t in model(0).items()}
    plan = plan_of(tensors)
    writer = SharedBucketsWriter("cuda_ipc", plan, secret, device)
    try:
        assert writer.path is None and len(writer.share["handle"]) == 64  # a handle, no file
        writer.write(pack_buckets(plan, iter(tensors.items()), device, out=writer.buffers()))
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        child = context.Process(target=_read_over_ipc, args=(plan.to_wire(), secret, writer.share, out))
        child.start()
        sums, param = out.get(timeout=120)
        child.join(60)
        assert child.exitcode == 0
        assert sums == [byte_checksum(tensors[n]) for n in ("big", "a", "b", "c")]
        assert torch.equal(param, tensors["big"].cpu())
    finally:
        writer.close()

"""The weight broadcast's bucket plan and checksum, and the seal of its group's store (no
processes: the broadcast itself is tested end to end in test_weight_sync.py, attacks on the
store in test_security_servers.py)."""

from __future__ import annotations

import re
import sys
import types

import pytest
import torch

from asyncrl.sync.collective import (
    DTYPES,
    BackendUnavailable,
    BucketPlan,
    ReceiveBuffers,
    broadcast_backend,
    bucket_checksums,
    byte_checksum,
    create_group,
    cupy_nccl,
    decode_nccl_uid,
    encode_nccl_uid,
    pack_buckets,
    range_sums_numpy,
    range_sums_running,
)
from asyncrl.sync.group_store import (
    LOOPBACK,
    NAME_PREFIX,
    GroupSeal,
    StoreTampered,
    bind_store_socket,
    new_group_secret,
    store_host,
)


def unpack(plan: BucketPlan, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver yields: views into each bucket at the plan's offsets."""
    return {s.name: buffers[i][s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
            for i, bucket in enumerate(plan.buckets) for s in bucket}


def test_buckets_round_trip_and_checksums_match_on_both_sides():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(40, 8)}
    plan = BucketPlan.build([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()],
                            bucket_bytes=100)
    # a (60 B) and b (14 B, from byte 64) share a bucket; c (1280 B) is bigger than one and
    # gets its own, at once, while a and b's bucket waits to be full or last.
    assert [[s.name for s in b] for b in plan.buckets] == [["c"], ["a", "b"]]
    received = unpack(plan, pack_buckets(plan, iter(tensors.items()), torch.device("cpu")))
    for name, t in tensors.items():
        assert torch.equal(received[name], t)
        assert byte_checksum(received[name]) == byte_checksum(t)


def signed64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


def test_byte_checksum_is_the_wrapped_sum_of_the_64_bit_words():
    t = torch.randn(1000)
    words = t.view(torch.int64).tolist()
    assert byte_checksum(t) == signed64(sum(words))
    # A tail that is no whole word: its bytes are added one by one.
    b = torch.randn(7).to(torch.bfloat16)  # 14 bytes: one word and 6 bytes
    raw = b.view(torch.uint8)
    assert byte_checksum(b) == raw[:8].view(torch.int64).item() + sum(raw[8:].tolist())


def test_byte_checksum_sees_a_one_bit_change():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[122] ^= 1  # the lowest mantissa bit of one element: the low half of word 61
    assert signed64(byte_checksum(flipped) - byte_checksum(t)) == (1 if t.view(torch.int32)[122] % 2 == 0 else -1)


def test_bucket_checksums_equal_each_tensors_byte_checksum():
    torch.manual_seed(0)
    # Tails of 6 (bf16 x 7), 4 (f32 x 3) and 2 (f16 x 5) bytes; random bits overflow 64-bit sums.
    tensors = {"a": torch.randn(7).to(torch.bfloat16), "b": torch.randn(3), "c": torch.randn(5).half(),
               "d": torch.randn(16, 9), "big": torch.randn(300)}
    specs = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()]
    plan = BucketPlan.build(specs, bucket_bytes=1024, alone_bytes=1200)
    assert [len(b) for b in plan.buckets] == [1, 4]  # "big" alone, the rest packed
    buffers = pack_buckets(plan, tensors.items(), torch.device("cpu"))
    for bucket, buffer in zip(plan.buckets, buffers):
        for s, after in zip(bucket, bucket[1:]):  # padding between slots is not part of any tensor
            buffer[s.offset + s.nbytes:after.offset] = 255
        expected = [byte_checksum(tensors[s.name]) for s in bucket]
        assert bucket_checksums(buffer, bucket) == expected


def test_range_sums_wrap_around_and_skip_gaps_both_ways():
    words = torch.randint(-2**63, 2**63 - 1, (20,), dtype=torch.int64)  # random words: the sums overflow

    def by_hand(starts, ends):
        return [signed64(sum(words[s:e].tolist())) for s, e in zip(starts, ends)]

    # gaps, ranges touching, an empty range (a tensor shorter than a word), one running to the end, one at the end
    for starts, ends in [([0, 3, 9], [2, 9, 20]), ([1, 4, 4, 7], [4, 4, 6, 12]), ([0, 5, 20], [5, 20, 20])]:
        assert range_sums_numpy(words, starts, ends) == by_hand(starts, ends)
        scratch = torch.full((30,), 12345, dtype=torch.int64)  # kept from an earlier, bigger bucket
        assert range_sums_running(words, starts, ends) == range_sums_running(words, starts, ends, scratch) \
            == by_hand(starts, ends)


def test_slots_start_on_8_byte_boundaries():
    plan = BucketPlan.build([("a", "bfloat16", [3]), ("b", "float32", [2]), ("c", "float16", [5])], bucket_bytes=64)
    assert [s.offset for s in plan.buckets[0]] == [0, 8, 16]


def test_tensors_of_alone_bytes_get_buckets_of_their_own():
    specs = [("a", "float32", [4]), ("big", "float32", [64]), ("b", "float32", [4]), ("c", "float32", [4])]
    plan = BucketPlan.build(specs, bucket_bytes=1024, alone_bytes=256)
    # big (256 B) travels alone; the small ones before and after it share one bucket.
    assert [[s.name for s in b] for b in plan.buckets] == [["big"], ["a", "b", "c"]]
    assert [[s.name for s in b] for b in BucketPlan.build(specs, bucket_bytes=1024).buckets] == [["a", "big", "b", "c"]]


def test_receive_buffers_take_turns_and_grow():
    buffers = ReceiveBuffers(torch.device("cpu"))
    first, second = buffers.take(10), buffers.take(20)
    assert first.numel() == 10 and second.numel() == 20 and first.data_ptr() != second.data_ptr()
    again = buffers.take(5)  # the first slot, its bucket loaded by now: reused, not reallocated
    assert again.numel() == 5 and again.data_ptr() == first.data_ptr()
    assert buffers.take(30).data_ptr() != second.data_ptr()  # too small for 30 bytes: replaced
    scratch = buffers.checksum_scratch(80)
    assert scratch.numel() == 11 and buffers.checksum_scratch(40).data_ptr() == scratch.data_ptr()


def test_packing_checks_every_tensor_against_the_plan():
    plan = BucketPlan.build([("a", "float32", [2]), ("b", "float32", [3])], bucket_bytes=64)
    ok = {"a": torch.ones(2), "b": torch.zeros(3)}
    assert len(pack_buckets(plan, reversed(list(ok.items())), torch.device("cpu"))) == 1  # any order
    for bad, message in [({"a": ok["a"]}, "not given"), ({**ok, "c": torch.ones(1)}, "not in the bucket plan"),
                         ({"a": ok["a"], "b": torch.zeros(4)}, "the plan says [3]")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            pack_buckets(plan, iter(bad.items()), torch.device("cpu"))


# -- the cupy NCCL backend: what runs without a GPU (scripts/gpu_check.sh runs the rest) ------

def test_the_backend_is_gloo_on_cpu_and_cupy_on_gpus():
    assert broadcast_backend("cpu") == "gloo" and broadcast_backend("cuda") == "cupy"
    with pytest.raises(ValueError, match="no weight-broadcast backend for device 'tpu'"):
        broadcast_backend("tpu")
    with pytest.raises(ValueError, match="weight-broadcast backend 'mpi': one of gloo, nccl, cupy"):
        create_group("127.0.0.1", 1, 0, 1, "mpi", new_group_secret())


def test_the_nccl_unique_id_round_trips_through_the_store_as_bytes():
    uid = tuple(range(-128, 0))  # cupy's ids are 128 signed chars
    assert len(encode_nccl_uid(uid)) == 128 and decode_nccl_uid(encode_nccl_uid(uid)) == uid
    assert encode_nccl_uid(bytes(range(128))) == bytes(range(128))  # cupy 14 gives bytes
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        decode_nccl_uid(b"abc")


def test_without_cupy_the_gpu_broadcast_says_what_to_install_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # not importable, as on this CPU machine
    with pytest.raises(BackendUnavailable) as info:
        create_group("127.0.0.1", 1, 0, 1, "cupy", new_group_secret())
    assert "\n" not in str(info.value) and "install the cupy wheel of your CUDA" in str(info.value)


def test_with_cupy_but_no_cuda_device_the_gpu_broadcast_says_so_in_one_line(monkeypatch):
    nccl = types.ModuleType("cupy.cuda.nccl")
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    for name, module in (("cupy", cupy), ("cupy.cuda", cuda), ("cupy.cuda.nccl", nccl)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable, match="needs a CUDA device, and this process sees none") as info:
        cupy_nccl()
    assert "\n" not in str(info.value)


# -- the group store's seal and binding (group_store.py) ---------------------------------------

def test_a_sealed_value_opens_only_with_its_secret_and_its_key():
    seal, other = GroupSeal(new_group_secret()), GroupSeal(new_group_secret())
    uid = bytes(range(128))
    sealed = seal.seal("nccl_unique_id", uid)
    assert seal.open("nccl_unique_id", sealed) == uid
    assert uid not in sealed and sealed != seal.seal("nccl_unique_id", uid)  # encrypted, a fresh nonce each time
    assert seal.open("empty", seal.seal("empty", b"")) == b""
    flipped = bytearray(sealed)
    flipped[20] ^= 1
    for key, value in [("nccl_unique_id", bytes(flipped)), ("nccl_unique_id", other.seal("nccl_unique_id", uid)),
                       ("0/1", sealed), ("nccl_unique_id", uid), ("nccl_unique_id", b"")]:
        with pytest.raises(StoreTampered, match=f"value for {key!r} does not carry this group's seal") as info:
            seal.open(key, value)
        assert "\n" not in str(info.value)


def test_key_names_are_secret_and_per_group():
    seal = GroupSeal(new_group_secret())
    name = seal.name("nccl_unique_id")
    assert name == seal.name("nccl_unique_id") and re.fullmatch(re.escape(NAME_PREFIX) + "[0-9a-f]{32}", name)
    assert name != seal.name("weight_group/0/0") and name != GroupSeal(new_group_secret()).name("nccl_unique_id")
    with pytest.raises(ValueError, match="at least 32 characters"):
        GroupSeal("guessable")


def test_the_store_binds_loopback_for_a_local_group_and_never_every_interface():
    assert store_host("10.0.0.5", "node-a", ["node-a", "node-a"]) == LOOPBACK
    assert store_host("10.0.0.5", "node-a", []) == LOOPBACK  # rank 0 alone
    assert store_host("10.0.0.5", "node-a", ["node-a", "node-b"]) == "10.0.0.5"
    for everywhere in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="binds to one address"):
            bind_store_socket(everywhere)
    with bind_store_socket(LOOPBACK) as sock, bind_store_socket("localhost") as by_name:
        assert sock.getsockname()[0] == LOOPBACK and sock.getsockname()[1] > 0
        assert by_name.getsockname()[0] in (LOOPBACK, "::1")

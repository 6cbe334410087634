"""The weight broadcast's bucket plan and checksum (no processes: the broadcast itself is
tested end to end in test_weight_sync.py)."""

from __future__ import annotations

import torch

from asyncrl.sync.collective import DTYPES, BucketPlan, byte_checksum, pack_buckets


def unpack(plan: BucketPlan, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a receiver yields: views into each bucket at the plan's offsets."""
    return {s.name: buffers[i][s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape)
            for i, bucket in enumerate(plan.buckets) for s in bucket}


def test_buckets_round_trip_and_checksums_match_on_both_sides():
    torch.manual_seed(0)
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(40, 8)}
    plan = BucketPlan.build([(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors.items()],
                            bucket_bytes=100)
    # a (60 B) and b (14 B) share a bucket; c (1280 B) is bigger than one and gets its own.
    assert [[s.name for s in b] for b in plan.buckets] == [["a", "b"], ["c"]]
    received = unpack(plan, pack_buckets(plan, iter(tensors.items()), torch.device("cpu")))
    for name, t in tensors.items():
        assert torch.equal(received[name], t)
        assert byte_checksum(received[name]) == byte_checksum(t)


def test_byte_checksum_sees_a_one_bit_change_and_is_exact():
    t = torch.randn(1000)
    flipped = t.clone()
    flipped.view(torch.int32)[123] ^= 1  # the lowest mantissa bit of one element
    assert byte_checksum(flipped) == byte_checksum(t) + (1 if t.view(torch.int32)[123] % 2 == 0 else -1)
    # Exact integer arithmetic: the order of summation cannot change it.
    assert byte_checksum(t.flip(0)) == byte_checksum(t)

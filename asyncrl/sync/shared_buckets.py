"""Weight sync without a collective, for engines that share the trainer's host or device.

A transport (`trainer.weight_sync_transport`, resolved per formation by `choose_transport`):
  - `broadcast`: the collective of collective.py (gloo on CPU, NCCL through cupy on GPUs);
  - `shared_memory` (CPU): the trainer's packed buckets live in one POSIX shared-memory file
    under /dev/shm, which every engine worker on the host maps read-only;
  - `cuda_ipc` (GPU): they live in one device allocation of trainer rank 0's GPU, which every
    engine worker on that same GPU opens through a CUDA IPC handle (NCCL refuses two ranks on
    one device, so the broadcast cannot connect them).
`auto` takes the shared one when every engine worker is where trainer rank 0 is (its node on
CPU, its GPU on GPUs) and the buckets fit; else the broadcast.

The bucket plan, the in-place receives and the checksums are the broadcast's: the trainer packs
its buckets straight into the shared region at `stage_weights` (while the engines still
generate), and each worker "receives" bucket by bucket by copying from it: a bucket alone in
the plan straight into its parameter, the others handed to the load as views of the region
(the captured load's replay copies them; any other load gets its own copies, as the
broadcast's fresh buffers). Each worker checksums what it loaded from, and the driver compares
that with what the trainer packed, as for the broadcast. The trainer writes the region only
in `stage_weights`, which the driver runs after the previous sync has returned, so no engine
reads while it is written.

Who can read or plant weights (the standard group_store.py set for the broadcast's store):
  - the file's name is an HMAC of the formation's secret (handed through Ray only): no one
    without it can find the name, or create it ahead to plant weights;
  - rank 0 creates it with O_CREAT | O_EXCL | O_NOFOLLOW, mode 0600 (only its user reads it);
    an existing name fails the formation instead of being reused;
  - a worker opens it O_RDONLY | O_NOFOLLOW and maps it read-only, after checking that it is a
    regular file of its own user, mode 0600, of the plan's size;
  - once every worker has mapped it, rank 0 unlinks the name (`unlink_name`): nothing can open
    it afterwards, and nothing is left under /dev/shm when a process dies;
  - the CUDA IPC handle travels through Ray only (never a file or the store): holding it is what
    lets a process open the allocation.
Processes of the same user can read the mapping anyway (they can ptrace the trainer too).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import mmap
import os
import stat
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from asyncrl.config.schema import WEIGHT_SYNC_TRANSPORTS as TRANSPORTS
from asyncrl.sync.collective import DTYPES, SLOT_ALIGN, BackendUnavailable, BucketPlan, bucket_checksums

SHARED = ("shared_memory", "cuda_ipc")  # what `auto` or `shared_memory` resolve to, by device
SHM_DIR = "/dev/shm"
SHM_PREFIX = "asyncrl-weights-"


def bucket_offsets(plan: BucketPlan) -> tuple[list[int], int]:
    """Each bucket's offset in the shared region (buckets back to back, each on a word) and its size."""
    offsets, used = [], 0
    for i in range(len(plan.buckets)):
        offsets.append(used)
        used = -(-(used + plan.bucket_nbytes(i)) // SLOT_ALIGN) * SLOT_ALIGN
    return offsets, max(used, SLOT_ALIGN)


def segment_path(secret: str) -> str:
    """The formation's shared-memory file: its name computable only with the secret."""
    digest = hmac.new(secret.encode(), b"asyncrl weight group shared memory", hashlib.sha256).hexdigest()
    return os.path.join(SHM_DIR, SHM_PREFIX + digest[:32])


def shm_free_bytes() -> int:
    """Room left under /dev/shm (0 where there is none): the segment must fit, or its pages fail."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def choose_transport(wanted: str, device: str, trainer_place: dict, engine_places: list[list[dict]],
                     total_bytes: int) -> str:
    """`broadcast`, `shared_memory` or `cuda_ipc` for one formation. `wanted`: the config's
    (TRANSPORTS); places: what `device_place` returns, trainer rank 0's and each engine
    worker's. `shared_memory` forced where an engine is elsewhere raises (it cannot work)."""
    if wanted not in TRANSPORTS:
        raise ValueError(f"trainer.weight_sync_transport={wanted!r}: one of {', '.join(TRANSPORTS)}")
    if wanted == "broadcast":
        return "broadcast"
    shared = "shared_memory" if device == "cpu" else "cuda_ipc"
    key = "node" if device == "cpu" else "device"  # CUDA IPC: the same GPU (NCCL refuses it, DESIGN.md)
    away = [p for places in engine_places for p in places if p[key] != trainer_place[key]]
    short = device == "cpu" and trainer_place["shm_free_bytes"] < total_bytes
    if wanted == "auto":
        return "broadcast" if away or short else shared
    if away:
        raise ValueError(f"trainer.weight_sync_transport=shared_memory: {len(away)} engine worker(s) are not "
                         f"on trainer rank 0's {'node' if device == 'cpu' else 'GPU'}; set it to auto or broadcast")
    if short:
        raise BackendUnavailable(f"trainer.weight_sync_transport=shared_memory: the weights take {total_bytes} "
                                 f"bytes, {SHM_DIR} has {trainer_place['shm_free_bytes']} free; enlarge it "
                                 "(docker: --shm-size) or set the transport to auto or broadcast")
    return shared


def device_place(node_id: str, device: torch.device) -> dict:
    """Where a member runs, for `choose_transport`: its Ray node, its GPU (node + UUID; the index
    differs between processes with their own CUDA_VISIBLE_DEVICES) and the room under /dev/shm."""
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    return {"node": node_id, "device": f"{node_id}/{gpu}", "shm_free_bytes": shm_free_bytes()}


# -- trainer rank 0's side -------------------------------------------------------------------------

class SharedBucketsWriter:
    """Trainer rank 0's shared region for one formation: `buffers()` are the packed buckets (views
    into it), `share` what the engines need to open it besides the secret (wire data)."""

    def __init__(self, transport: str, plan: BucketPlan, secret: str, device: torch.device):
        if transport not in SHARED:
            raise ValueError(f"no shared region for transport {transport!r}")
        self.transport, self.plan = transport, plan
        self.offsets, self.nbytes = bucket_offsets(plan)
        self.path: str | None = None
        self._ipc: Any = None
        if transport == "shared_memory":
            self.path = segment_path(secret)
            self.region = _create_segment(self.path, self.nbytes)
            self.share: dict = {"nbytes": self.nbytes}
        else:
            self.region, self._ipc, handle = _cuda_ipc_region(self.nbytes, device)
            self.share = {"nbytes": self.nbytes, "handle": handle}

    def buffers(self) -> list[torch.Tensor]:
        """One view per bucket: `pack_buckets(..., out=...)` writes straight into them."""
        return [self.region[o:o + self.plan.bucket_nbytes(i)] for i, o in enumerate(self.offsets)]

    def write(self, buckets: list[torch.Tensor]) -> None:
        """Copy packed buckets (of this plan) into the region, unless they already are its views;
        on a GPU, wait for the copies (the engines read on other streams, in other processes)."""
        for dst, src in zip(self.buffers(), buckets):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        if self.region.is_cuda:
            torch.cuda.current_stream(self.region.device).synchronize()

    def unlink_name(self) -> None:
        """Every worker holds the region: remove its name, so nothing else can open it."""
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.path = None

    def close(self) -> None:
        self.unlink_name()
        self.region = None
        self._ipc = None  # the device allocation goes with the last reference


def _create_segment(path: str, nbytes: int) -> torch.Tensor:
    """A new 0600 file of `nbytes` at `path` (never an existing one), mapped read-write, as uint8."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        try:
            os.posix_fallocate(fd, 0, nbytes)  # the pages now: a full /dev/shm fails here, not by SIGBUS later
        except OSError as e:
            raise BackendUnavailable(f"weight sync over shared memory: {SHM_DIR} cannot hold {nbytes} bytes "
                                     f"({os.strerror(e.errno)}); enlarge it (docker: --shm-size) or set "
                                     "trainer.weight_sync_transport=broadcast") from None
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    os.close(fd)  # the mapping keeps the file
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _cuda_ipc_region(nbytes: int, device: torch.device) -> tuple[torch.Tensor, Any, bytes]:
    """A device allocation of its own (cudaMalloc through cupy, not torch's caching allocator,
    whose blocks are parts of larger allocations that an IPC handle would expose whole), as a
    torch tensor, its owner, and its CUDA IPC handle. Untested here (no GPU)."""
    import cupy

    with cupy.cuda.Device(device.index):
        memory = cupy.cuda.Memory(nbytes)  # cudaMalloc: an allocation of its own
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(memory.ptr))
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=device), memory, handle


# -- an engine worker's side -----------------------------------------------------------------------

class SharedBucketsReader:
    """An engine worker's view of trainer rank 0's shared region (read-only), with the plan's
    bucket offsets; `receive_buckets` hands out the buckets as collective.receive_buckets does."""

    def __init__(self, transport: str, plan: BucketPlan, secret: str, share: dict, device: torch.device):
        if transport not in SHARED:
            raise ValueError(f"no shared region for transport {transport!r}")
        self.transport, self.plan = transport, plan
        self.offsets, nbytes = bucket_offsets(plan)
        if share["nbytes"] != nbytes:
            raise ValueError(f"the trainer's shared region has {share['nbytes']} bytes, the plan {nbytes}")
        self._ipc: Any = None
        if transport == "shared_memory":
            self.region = _open_segment(segment_path(secret), nbytes)
        else:
            self.region, self._ipc = _open_cuda_ipc(share["handle"], nbytes, device)
        self.scratch: torch.Tensor | None = None

    def receive_buckets(self, destinations: dict[str, torch.Tensor] | None = None, own_copies: bool = False,
                        ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool, list[int]]]:
        """As collective.receive_buckets: each bucket's (name, tensor) pairs, whether it went in
        place, and each tensor's byte_checksum. A bucket alone in the plan whose tensor is in
        `destinations` is copied straight into it; the others are views of the region, which the
        trainer overwrites at its next stage: load them before the sync returns, or ask for
        `own_copies` (a load that may keep the tensors)."""
        destinations = destinations or {}
        for i, bucket in enumerate(self.plan.buckets):
            view = self.region[self.offsets[i]:self.offsets[i] + self.plan.bucket_nbytes(i)]
            dst = destinations.get(bucket[0].name) if len(bucket) == 1 else None
            if dst is not None:
                buffer = dst.view(-1).view(torch.uint8)
                buffer.copy_(view)
            else:
                buffer = view.clone() if own_copies else view
            running_sum = len(bucket) > 1 and buffer.device.type != "cpu"  # bucket_checksums' scratch
            if running_sum and (self.scratch is None or self.scratch.numel() < buffer.numel() // 8 + 1):
                self.scratch = torch.empty(buffer.numel() // 8 + 1, dtype=torch.int64, device=buffer.device)
            tensors = [(s.name, buffer[s.offset:s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape))
                       for s in bucket]
            yield tensors, dst is not None, bucket_checksums(buffer, bucket, self.scratch if running_sum else None)
        if self.region.is_cuda:  # the caller's copies out of the last views done before the trainer may write again
            torch.cuda.current_stream(self.region.device).synchronize()

    def close(self) -> None:
        self.region = None
        if self._ipc is not None:
            self._ipc.close()
            self._ipc = None


def _open_segment(path: str, nbytes: int) -> torch.Tensor:
    """Rank 0's file at `path`, checked (a regular file of this user, 0600, `nbytes` long) and
    mapped read-only, as uint8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RuntimeError(f"weight sync over shared memory: the trainer's segment is not there ({path}); "
                           "the engine must run on trainer rank 0's host") from None
    except OSError as e:  # ELOOP: a symbolic link planted under the name
        raise RuntimeError(f"weight sync over shared memory: refused {path}: {os.strerror(e.errno)}") from None
    try:
        st = os.fstat(fd)
        problems = [what for what, bad in [
            ("not a regular file", not stat.S_ISREG(st.st_mode)),
            (f"owned by uid {st.st_uid}, not {os.getuid()}", st.st_uid != os.getuid()),
            (f"mode {stat.S_IMODE(st.st_mode):o}, not 600", stat.S_IMODE(st.st_mode) != 0o600),
            (f"{st.st_size} bytes, not {nbytes}", st.st_size != nbytes)] if bad]
        if problems:
            raise RuntimeError(f"weight sync over shared memory: refused {path}: {'; '.join(problems)}")
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "not writable": nothing writes to it (receive_buckets reads only)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


class _IpcMapping:
    def __init__(self, ptr: int, device: int):
        self.ptr, self.device = ptr, device

    def close(self) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            cupy.cuda.runtime.ipcCloseMemHandle(self.ptr)


def _open_cuda_ipc(handle: bytes, nbytes: int, device: torch.device) -> tuple[torch.Tensor, _IpcMapping]:
    """The trainer's allocation, opened on this worker's device (the same GPU: choose_transport).
    Untested here (no GPU)."""
    import cupy

    with cupy.cuda.Device(device.index):
        ptr = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        mapping = _IpcMapping(ptr, device.index)
        memory = cupy.cuda.UnownedMemory(ptr, nbytes, mapping)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=device), mapping

"""Attacks on the weight-broadcast group's store (asyncrl/sync/group_store.py): the TCP store
trainer rank 0 hosts while the group forms, through which gloo's members exchange their
addresses and the cupy backend hands out NCCL's unique id. An outsider is a process that
connects to the store's port without the group's secret. gloo's members run as processes of
their own (as trainer rank 0 and vLLM's workers do); the NCCL unique id's store is hosted in
this process (publishing and reading the id needs no GPU). No engine, no Ray.

Before the fix the store listened on every interface (`*:PORT`), and gloo's rendezvous keys
sat under well-known names (`tcp://HOST:PORT/0/RANK`, the unique id under
`asyncrl/nccl_unique_id`), readable by whoever connected; a value written there before a
member read it was taken as rank 0's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import psutil
import pytest
import torch

from asyncrl.sync.collective import NCCL_UID_KEY, BucketPlan, publish_nccl_uid, read_nccl_uid
from asyncrl.sync.group_store import (
    LOOPBACK,
    NAME_PREFIX,
    GroupSeal,
    SealedStore,
    StoreTampered,
    bind_store_socket,
    new_group_secret,
    open_group_store,
)
from asyncrl.sync.shared_buckets import SharedBucketsReader, SharedBucketsWriter, bucket_offsets, segment_path
from tests.conftest import REPO

# A gloo member as the trainer's rank 0 and a vLLM worker are: its secret arrives on stdin (through
# Ray in a run; never on a command line), it says its store's port, then "formed" with what rank 0
# broadcast, or "refused" and the error, as JSON on one line (its lines start with SAYS: vLLM logs
# to stdout too).
GROUP_MEMBER = """
import json, sys
from asyncrl.sync.group_store import bind_store_socket
host, port, rank, timeout_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
secret = sys.stdin.readline().strip()
sock = bind_store_socket(host) if rank == 0 else None
if sock:  # said before the slow imports, so that the other member starts meanwhile
    port = sock.getsockname()[1]
    print("@member port", port, flush=True)
import torch
from asyncrl.sync.collective import create_group
try:
    group = create_group(host, port, rank, 2, "gloo", secret, timeout_s, listen_socket=sock)
except Exception as e:
    print("@member refused", json.dumps([type(e).__name__, str(e)]), flush=True)
    sys.exit(1)
t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
group.broadcast(t).wait()
print("@member formed", json.dumps(t.tolist()), flush=True)
sys.stdin.readline()  # holds the group (and rank 0 its store) until the test is done
"""
SAYS = "@member "
OLD_NAMES = ["asyncrl/nccl_unique_id", NCCL_UID_KEY, "0/0", "0/1", "weight_group/0/0", "weight_group/0/1"]


def _member(rank: int, port: int, secret: str, timeout_s: float = 300) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", GROUP_MEMBER, LOOPBACK, str(port), str(rank), str(timeout_s)],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    proc.stdin.write(secret + "\n")
    proc.stdin.flush()
    return proc


def _said(proc: subprocess.Popen, word: str) -> str:
    """The rest of what the member says next, which must start with `word`."""
    while (line := proc.stdout.readline()) and not line.startswith(SAYS):
        pass
    said = line.removeprefix(SAYS).strip()
    assert said.startswith(word + " "), f"expected {word!r} from the member, got {said!r} (exit {proc.poll()})"
    return said[len(word) + 1:]


def _outsider(port: int) -> torch.distributed.TCPStore:
    """A process's connection to the group's store, without the secret (waiting while rank 0,
    which holds the port already, imports torch and starts to serve)."""
    return torch.distributed.TCPStore(LOOPBACK, port, None, False, timedelta(seconds=120))


def _plant(outsider: torch.distributed.TCPStore, name: str, value: bytes) -> None:
    """Write `value` under `name` and wait until the store holds it (a TCPStore's `set` is not
    answered: read back on the same connection, it has been applied)."""
    outsider.set(name, value)
    outsider.get(name)


def _names(outsider: torch.distributed.TCPStore, count: int) -> list[str]:
    """The names in the store, once there are `count` (what members write reaches it in its time)."""
    deadline = time.monotonic() + 120
    while len(names := outsider.list_keys()) < count:
        assert time.monotonic() < deadline, f"{len(names)} key(s) in the store, waiting for {count}"
        time.sleep(0.05)
    return names


def _listening(port: int) -> list[str]:
    """The addresses a socket listens on at `port`, any process's."""
    return [c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.stdin.write("\n")
            proc.stdin.flush()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gloo_group() -> Iterator[tuple[int, list[str]]]:
    """A formed two-member gloo group on loopback (rank 0 holding its store), and the old
    well-known names an outsider planted values under while it formed: (port, planted names)."""
    secret = new_group_secret()
    rank0 = _member(0, 0, secret)
    rank1 = None
    try:
        port = int(_said(rank0, "port"))
        # Before rank 1 joins: what the unfixed store's rank 1 would have read as rank 0's address.
        outsider = _outsider(port)
        planted = [f"tcp://{LOOPBACK}:{port}/0/0", f"tcp://{LOOPBACK}:{port}/0/1", *OLD_NAMES]
        for name in planted:
            _plant(outsider, name, b"\x02" + b"\x00" * 177)
        rank1 = _member(1, port, secret)
        for proc in (rank0, rank1):
            assert json.loads(_said(proc, "formed")) == [0.0, 1.0, 2.0, 3.0]  # rank 0's tensor: the real rank 0
        yield port, planted
    finally:
        _stop(*[p for p in (rank0, rank1) if p is not None])


@pytest.mark.attack
@pytest.mark.slow
def test_a_local_groups_store_listens_on_loopback_only(gloo_group):
    port, _ = gloo_group
    assert _listening(port) == [LOOPBACK]  # not 0.0.0.0 or :: (every interface)


@pytest.mark.attack
@pytest.mark.slow
def test_an_outsider_on_the_group_store_finds_nothing_under_the_old_names_and_reads_only_sealed_values(gloo_group):
    port, planted = gloo_group
    outsider = _outsider(port)
    ours = [n for n in outsider.list_keys() if n not in planted]
    # gloo's rendezvous (one key per rank): under names derived from the secret, nothing under
    # the well-known ones but what the outsider planted itself, which no member read.
    assert len(ours) >= 2 and all(re.fullmatch(re.escape(NAME_PREFIX) + "[0-9a-f]{32}", n) for n in ours)
    for name in ours:
        value = outsider.get(name)
        assert b"\x7f\x00\x00\x01" not in value  # the members' loopback addresses, in clear before the fix
        with pytest.raises(StoreTampered):  # and no other group's secret opens them
            GroupSeal(new_group_secret()).open(name, value)


@pytest.mark.attack
@pytest.mark.slow
def test_a_gloo_rendezvous_value_planted_by_an_outsider_is_refused_in_one_line():
    secret = new_group_secret()
    # Rank 0 waits as long as rank 1 may take to start under load (it imports torch): with a
    # short wait it gave up and closed the store before rank 1 connected (seen in CI).
    rank0 = _member(0, 0, secret)
    rank1 = None
    try:
        port = int(_said(rank0, "port"))
        outsider = _outsider(port)
        (name,) = _names(outsider, 1)  # rank 0's address, once published
        _plant(outsider, name, b"\x02" + b"\x00" * 177)  # the outsider's own "rank 0 address" over rank 0's
        rank1 = _member(1, port, secret)
        kind, message = json.loads(_said(rank1, "refused"))
        assert kind == "StoreTampered" and "\n" not in message
        assert "'weight_group/0/0' does not carry this group's seal" in message
    finally:
        rank0.kill()  # it would wait its timeout for rank 1, which refused
        _stop(*[p for p in (rank0, rank1) if p is not None])


@pytest.fixture
def uid_store() -> Iterator[tuple[SealedStore, SealedStore, torch.distributed.TCPStore]]:
    """The cupy backend's store, hosted here: rank 0's view, a member's and an outsider's connection."""
    secret = new_group_secret()
    sock = bind_store_socket(LOOPBACK)
    port = sock.getsockname()[1]
    rank0 = open_group_store(LOOPBACK, port, 0, secret, 10, listen_socket=sock)
    member = open_group_store(LOOPBACK, port, 1, secret, 10)
    yield rank0, member, _outsider(port)


def test_the_nccl_unique_id_reaches_a_member_through_the_sealed_store(uid_store):
    rank0, member, _ = uid_store
    uid = bytes(range(128))
    publish_nccl_uid(rank0, tuple(b - 256 if b > 127 else b for b in uid))  # as cupy 13 gives it
    assert read_nccl_uid(member) == uid == read_nccl_uid(rank0)


@pytest.mark.attack
def test_an_outsider_can_neither_find_nor_read_the_nccl_unique_id(uid_store):
    rank0, _, outsider = uid_store
    uid = bytes(range(128))
    publish_nccl_uid(rank0, uid)
    assert _listening(rank0.store.port) == [LOOPBACK]
    (name,) = _names(outsider, 1)
    assert not any(outsider.check([old]) for old in OLD_NAMES)
    assert name != NCCL_UID_KEY and uid not in outsider.get(name)  # encrypted under a name that says nothing


@pytest.mark.attack
@pytest.mark.parametrize("planted", ["its own id", "sealed by another group", "one bit flipped",
                                     "its own id, before rank 0's"])
def test_an_nccl_unique_id_planted_by_an_outsider_is_refused_in_one_line(uid_store, planted):
    """The outsider writes under the name members read: found with `list_keys` after rank 0
    published, or (the last case) known in advance, as if it could guess it."""
    rank0, member, outsider = uid_store
    fake = bytes(range(128, 256))
    if planted == "its own id, before rank 0's":
        _plant(outsider, member.seal.name(NCCL_UID_KEY), fake)
    else:
        publish_nccl_uid(rank0, bytes(range(128)))
        (name,) = _names(outsider, 1)
        if planted == "its own id":
            _plant(outsider, name, fake)
        elif planted == "sealed by another group":  # e.g. a member of an earlier formation
            _plant(outsider, name, GroupSeal(new_group_secret()).seal(NCCL_UID_KEY, fake))
        else:
            sealed = bytearray(outsider.get(name))
            sealed[-40] ^= 1  # in the ciphertext
            _plant(outsider, name, bytes(sealed))
    for reader in (member, rank0):  # rank 0 reads the id back too before it makes its communicator
        with pytest.raises(StoreTampered, match=f"value for '{NCCL_UID_KEY}' does not carry this group's seal") as info:
            read_nccl_uid(reader)
        assert "\n" not in str(info.value)


# -- the shared-memory transport's segment ---------------------------------------------------------

def tiny_plan() -> BucketPlan:
    return BucketPlan.build([("a", "float32", [64, 32]), ("b", "float32", [9])], bucket_bytes=1024)


@pytest.fixture
def secret():
    s = new_group_secret()
    yield s
    if os.path.lexists(segment_path(s)):  # what a test planted
        os.unlink(segment_path(s))


@pytest.mark.attack
@pytest.mark.parametrize("planted", ["a file", "a symbolic link"])
def test_a_name_planted_ahead_fails_the_formation(secret, tmp_path, planted):
    """Whoever learnt the name could plant weights under it before rank 0 creates it: O_EXCL
    refuses to take over any existing name, a symbolic link included."""
    path = segment_path(secret)
    if planted == "a file":
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    else:
        os.symlink(tmp_path / "elsewhere", path)
    with pytest.raises(FileExistsError):
        SharedBucketsWriter("shared_memory", tiny_plan(), secret, torch.device("cpu"))
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.attack
@pytest.mark.parametrize("planted,message", [("mode 644", "mode 644, not 600"), ("short", "bytes, not"),
                                             ("link", "refused"), ("another user's", "owned by uid 65534")])
def test_a_reader_refuses_a_segment_it_did_not_get_from_rank_0(secret, tmp_path, planted, message):
    if planted == "another user's" and os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")
    plan = tiny_plan()
    nbytes = bucket_offsets(plan)[1]
    path = segment_path(secret)
    if planted == "link":
        target = tmp_path / "weights"
        target.write_bytes(b"\0" * nbytes)
        target.chmod(0o600)
        os.symlink(target, path)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, nbytes if planted == "mode 644" else nbytes - 8)
        os.fchmod(fd, 0o644 if planted == "mode 644" else 0o600)
        if planted == "another user's":
            os.fchown(fd, 65534, -1)  # nobody
        os.close(fd)
    with pytest.raises(RuntimeError, match=message):
        SharedBucketsReader("shared_memory", plan, secret, {"nbytes": nbytes}, torch.device("cpu"))

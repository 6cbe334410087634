"""The weight-broadcast group's rendezvous store: bound to the group's address, every key
sealed with a secret of the group.

The group forms through a TCP store (torch's TCPStore) that trainer rank 0 hosts: gloo's
ranks publish their addresses there, torch's NCCL and the cupy backend their NCCL unique id.
The store has no authentication, and its server listens on every interface whatever host it
is given (torch 2.13: `*:PORT`, IPv4 and IPv6). So:

1. Binding. Rank 0 binds the listening socket itself (`bind_store_socket`) to the group's host
   (`store_host`): loopback when every member runs on rank 0's node, the node's own address
   otherwise; never 0.0.0.0. TCPStore takes it as `master_listen_fd` (a documented argument).
   The socket is held from the moment its port is chosen, so no other process can take the
   port between the choice and the store's start and play the store itself.
2. The secret. The driver makes one per formation of the group (`new_group_secret`, at start
   and at every scale event) and hands it to every member through Ray, beside host and port.
3. Sealed keys. Members see the store only through `SealedStore`: a key is stored under an
   HMAC of the secret and its name (no well-known name to read or to plant a value under in
   advance), and its value is encrypted and authenticated with keys derived from the secret
   (`GroupSeal`: HMAC-SHA256 as a keystream, then an HMAC tag over name, nonce and ciphertext).
   A value that does not verify (planted, altered, or of another formation) is refused with one
   line (`StoreTampered`) and the group does not form. Everything gloo's and NCCL's rendezvous
   write goes through it, and the cupy backend's NCCL unique id.

What it does not protect: the store still accepts any connection to its port (a TCPStore
cannot ask for credentials), from any local process (and, on a multi-node group, any host that
reaches the node's address). Such a process can list the opaque names (TCPStore has
`list_keys`), delete or overwrite values, bump counters (`add` is not sealed: torch's stores
read its values as integers) or hold connections open: a denial of service that fails the
group's formation with a clear error, never a member of its choosing, nor the unique id or
the members' addresses in clear. gloo's and NCCL's own connections, opened after the
rendezvous, are neither authenticated nor encrypted: the weights travel in clear.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
SECRET_MIN_CHARS = 32  # new_group_secret gives 64 hex chars (256 bits)
NONCE_BYTES = 16
TAG_BYTES = 32  # HMAC-SHA256
NAME_PREFIX = "asyncrl/"  # of every key a SealedStore writes: HMAC-derived names follow it


class StoreTampered(RuntimeError):
    """A value in the group's store does not carry the group's seal."""


def new_group_secret() -> str:
    """A fresh secret for one formation of the weight-broadcast group."""
    return secrets.token_hex(32)


def store_host(node_ip: str, node_id: str, member_nodes: Iterable[str]) -> str:
    """Where rank 0 (on `node_id`, whose address is `node_ip`) binds the group's store: loopback
    when every member runs on its node, the node's address otherwise."""
    return LOOPBACK if all(n == node_id for n in member_nodes) else node_ip


def bind_store_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (host, port) and listening, for TCPStore's `master_listen_fd`
    (port 0: a free one, read back with `getsockname()`)."""
    family, _, _, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0]
    if not host or ipaddress.ip_address(address[0].split("%")[0]).is_unspecified:
        raise ValueError(f"the weight-broadcast group's store binds to one address, not {host!r} (every interface)")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(128)  # members connect before rank 0's store starts to serve: they wait in the backlog
    except OSError:
        sock.close()
        raise
    return sock


class GroupSeal:
    """The keys one group secret gives: for key names, for encryption and for authentication
    (each an HMAC of the secret and its purpose, so that no two uses share a key)."""

    def __init__(self, secret: str):
        if len(secret) < SECRET_MIN_CHARS:
            raise ValueError(f"a weight-broadcast group secret has at least {SECRET_MIN_CHARS} characters "
                             f"(new_group_secret), got {len(secret)}")

        def derive(purpose: bytes) -> bytes:
            return hmac.new(secret.encode(), b"asyncrl weight group " + purpose, hashlib.sha256).digest()

        self._names, self._pad, self._tag = derive(b"names"), derive(b"encryption"), derive(b"authentication")

    def name(self, key: str) -> str:
        """The name `key` is stored under: not computable without the secret."""
        return NAME_PREFIX + hmac.new(self._names, key.encode(), hashlib.sha256).hexdigest()[:32]

    def seal(self, key: str, value: bytes) -> bytes:
        """nonce + (value XOR keystream) + tag: `value` encrypted and bound to `key`."""
        nonce = os.urandom(NONCE_BYTES)
        body = _xor(value, self._keystream(nonce, len(value)))
        return nonce + body + self._mac(key, nonce, body)

    def open(self, key: str, sealed: bytes) -> bytes:
        """The value `seal(key, value)` sealed; `StoreTampered` for anything else."""
        nonce, body, tag = sealed[:NONCE_BYTES], sealed[NONCE_BYTES:-TAG_BYTES], sealed[-TAG_BYTES:]
        if len(sealed) < NONCE_BYTES + TAG_BYTES or not hmac.compare_digest(tag, self._mac(key, nonce, body)):
            raise StoreTampered(f"weight-broadcast group: the store's value for {key!r} does not carry this "
                                "group's seal (written by a process without the group's secret, or altered); "
                                "the group was not formed")
        return _xor(body, self._keystream(nonce, len(body)))

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        # HMAC-SHA256 in counter mode, a fresh nonce per value: a keystream never repeats.
        blocks = (hmac.new(self._pad, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                  for i in range(-(-n // 32)))
        return b"".join(blocks)[:n]

    def _mac(self, key: str, nonce: bytes, body: bytes) -> bytes:
        name = key.encode()
        return hmac.new(self._tag, len(name).to_bytes(4, "big") + name + nonce + body, hashlib.sha256).digest()


def _xor(data: bytes, pad: bytes) -> bytes:
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(len(data), "big")


class SealedStore(dist.Store):
    """A view of a store in which every key is named and every value sealed by a `GroupSeal`
    (see the module docstring). torch's C++ (gloo's, NCCL's rendezvous) calls these methods;
    it holds a Python store by pointer only, so whoever forms a group over one must keep it
    referenced as long as the group lives (`TorchGroup`, `CupyNcclGroup`)."""

    def __init__(self, store: dist.Store, seal: GroupSeal):
        super().__init__()
        self.store, self.seal = store, seal
        super().set_timeout(store.timeout)

    def set(self, key: str, value: bytes | str) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.store.set(self.seal.name(key), self.seal.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.seal.open(key, self.store.get(self.seal.name(key)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self.seal.name(k) for k in keys]
        self.store.wait(names) if timeout is None else self.store.wait(names, timeout)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self.seal.name(k) for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self.seal.name(key), amount)  # a counter: named, not sealed

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self.seal.name(key))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)
        super().set_timeout(timeout)


def open_group_store(host: str, port: int, rank: int, secret: str, timeout_s: float,
                     listen_socket: socket.socket | None = None) -> SealedStore:
    """The group's store as member `rank` sees it. Rank 0 hosts it on `listen_socket` (its own
    from then on), or on a socket it binds to (host, port) itself; the others connect."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        sock = listen_socket if listen_socket is not None else bind_store_socket(host, port)
        fd = sock.detach()
        try:
            # No world size: the store does not count connections (anyone could connect); the
            # rendezvous itself waits for every member's sealed keys.
            store = dist.TCPStore(host, port, None, is_master=True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=fd)
        except Exception:
            socket.close(fd)
            raise
    else:
        store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
    return SealedStore(store, GroupSeal(secret))

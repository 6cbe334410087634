"""Attacks on the env server (asyncrl/agents/server.py) and the engine request channel
(asyncrl/inference/channel.py), over real loopback sockets: the server runs in real uvicorn
with the server's own settings (`uvicorn_config`), in a subprocess, hosting a small agent
whose rollout is one request to a tiny inference server on loopback in this process. No
engine, no Ray.

Each test marked `attack` is one attack; tests/conftest.py counts them. The server's rules
(its module docstring) as the attacks expect them: no token -> 401 and wrong token -> 403
whatever the body (never read: no 413 or 422 without a token); then 413 / 408 / 422 for a
body too large, too slow or not strict JSON; 403 for inference outside loopback; 422 for more
than MAX_ROLLOUTS_PER_REQUEST rollouts after expansion; 503 past the rollouts in flight; never
a 5xx, never a hang, /health always answering: floods of connections without the token
(idle, trickling) keep out neither /health nor a client with it, and an answer never read
drops its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import resource
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import pytest

from asyncrl.agents.api import MAX_ROLLOUTS_PER_REQUEST, Agent
from asyncrl.inference import channel
from asyncrl.inference.channel import ChannelServer
from asyncrl.tasks import Problem
from asyncrl.types import GenerationResult, SamplingSpec, Segment, Trajectory, TrajectoryStatus

REPO = Path(__file__).resolve().parents[1]
TOKEN = "attack-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "SECRET-7f3a9c"  # what the inference server says when it fails: must never reach a client
MAX_REQUEST_BYTES = 256 * 1024
READ_TIMEOUT_S = 1.0
MAX_IN_FLIGHT = 1500  # below the cap of a request here: a test fills it with fewer rollouts
ENV = "echo"
HELDOUT = 500  # x (1 greedy + 8 samples) > MAX_ROLLOUTS_PER_REQUEST
MAX_CONNECTIONS = 64  # small, so that a flood of FLOOD connections is far past them
MAX_UNAUTHENTICATED = 32
MAX_UNAUTHENTICATED_PER_PEER = 16  # over the 8 + 1 connections of the fuzz at once
WRITE_TIMEOUT_S = 2.0
FLOOD = 600


# -- the server's side: an agent whose rollout is one generation --------------------------

class EchoAgent(Agent):
    """Problems p0..p49 (train) and h0..h499 (held-out); a rollout asks the inference endpoint
    for one completion and is failed, with the error as its reason, when that raises (as the
    agent loops' failures are)."""

    tokenizer = None

    def __init__(self) -> None:  # no config: the server reads only these
        self.env_id, self.weight, self.agent_loop = ENV, 1.0, "single_turn"

    def load_splits(self) -> dict[str, list[Problem]]:
        def make(prefix: str, n: int) -> list[Problem]:
            return [Problem(f"{prefix}{i}", "echo", f"q{i}", f"q{i}", "", env_id=ENV) for i in range(n)]

        return {"train": make("p", 50), "heldout": make("h", HELDOUT)}

    def reward(self, problem: Problem, response: str) -> float:
        return 1.0

    def sampling(self, temperature: float | None = None) -> SamplingSpec:
        return SamplingSpec(max_new_tokens=4, temperature=1.0 if temperature is None else temperature)

    async def rollout(self, problem: Problem, inference: object, sampling: SamplingSpec | None = None,
                      group_id: str = "") -> Trajectory:
        traj = Trajectory(problem.prompt_id, group_id or problem.prompt_id, [1, 2, 3], env_id=ENV)
        try:
            result = await inference.agenerate([1, 2, 3], sampling or self.sampling(), problem.prompt_id)
        except Exception as e:
            traj.status, traj.failure_reason = TrajectoryStatus.FAILED, f"loop_error: {type(e).__name__}: {e}"
            return traj
        traj.segments.append(Segment(result.token_ids, result.logprobs, [1] * len(result.token_ids),
                                     result.versions))
        traj.reward = 1.0
        return traj


def serve(port: int) -> None:
    """The env server over an EchoAgent, as `asyncrl serve-env` runs it (python -m tests.test_security_servers PORT)."""
    import uvicorn

    from asyncrl.agents.http_guard import ServerLimits, uvicorn_config
    from asyncrl.agents.server import create_app

    limits = ServerLimits(max_request_bytes=MAX_REQUEST_BYTES, read_timeout_s=READ_TIMEOUT_S,
                          max_rollouts_in_flight=MAX_IN_FLIGHT, inference_hosts=("gpu-node-3", "10.9.0.0/16"),
                          max_connections=MAX_CONNECTIONS, max_unauthenticated=MAX_UNAUTHENTICATED,
                          max_unauthenticated_per_peer=MAX_UNAUTHENTICATED_PER_PEER, write_timeout_s=WRITE_TIMEOUT_S)
    app = create_app(SimpleNamespace(agents={ENV: EchoAgent()}), TOKEN, limits)
    uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning")).run()


# -- this side: an inference server on loopback ----------------------------------------------

class Upstream:
    """An OpenAI-compatible completions server on loopback (asyncio, in a thread of this process),
    by path: /ok/v1 answers a completion, /secret/v1 fails with a body holding SECRET, /garbled/v1
    answers 200 with SECRET where token ids go, /long/v1 with more tokens than asked for,
    /redirect/v1 redirects elsewhere, /stall/v1 waits until `release()`."""

    def __init__(self) -> None:
        self.calls = 0
        started = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            self._released = asyncio.Event()
            server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0, backlog=512))
            self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
            started.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        assert started.wait(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                length = next((int(v) for k, _, v in (line.partition(": ") for line in lines[1:])
                               if k.lower() == "content-length"), 0)
                await reader.readexactly(length)
                self.calls += 1
                kind = lines[0].split(" ")[1].split("/")[1]
                if kind == "stall":
                    await self._released.wait()
                status, extra, body = {
                    "secret": ("500 Internal Server Error", "", f"internal error: {SECRET}"),
                    "garbled": ("200 OK", "", json.dumps({"choices": [{"token_ids": [SECRET]}]})),
                    "long": ("200 OK", "", json.dumps({"choices": [{"token_ids": [7] * 100_000}]})),
                    "redirect": ("302 Found", f"Location: http://127.0.0.1:9/{SECRET}\r\n", SECRET),
                }.get(kind, ("200 OK", "", json.dumps({"choices": [{"token_ids": [5, 6], "finish_reason": "stop",
                                                                  "logprobs": {"token_logprobs": [-0.1, -0.2]}}]})))
                data = body.encode()
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self._released.set)

    def endpoint(self, kind: str = "ok") -> dict[str, str]:
        return {"base_url": f"{self.url}/{kind}/v1", "model": "m"}

    def close(self) -> None:
        self.release()
        self.loop.call_soon_threadsafe(self.loop.stop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = (tmp_path_factory.mktemp("env_server") / "server.log").open("w")  # a file: a pipe nobody reads blocks
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_security_servers", str(port)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, Path(log.name).read_text()[-3000:]
            assert time.time() < deadline, "the env server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
        assert proc.poll() is None, "the env server died: " + Path(log.name).read_text()[-3000:]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _raw(port: int, data: bytes, wait_s: float = 5.0) -> tuple[bytes, bool]:
    """Send `data` on a fresh connection; what comes back within `wait_s`, and whether the
    server closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        out, deadline = b"", time.time() + wait_s
        while time.time() < deadline:
            s.settimeout(max(0.01, deadline - time.time()))
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return out, False
            except ConnectionResetError:
                return out, True
            if not chunk:
                return out, True
            out += chunk
        return out, False


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


# -- the env server ---------------------------------------------------------------------

@pytest.mark.attack
def test_repeated_problem_ids_cannot_expand_past_the_rollout_cap(server, upstream):
    over = MAX_ROLLOUTS_PER_REQUEST + 1
    r = httpx.post(server + "/rollouts/", headers=AUTH, timeout=30,
                   json={"env_id": ENV, "problem_ids": ["p0"] * over, "inference": upstream.endpoint()})
    assert r.status_code == 422
    assert r.json()["detail"] == f"{over} problems = {over} rollouts, over {MAX_ROLLOUTS_PER_REQUEST} per request"
    r = httpx.post(server + "/grouped_rollouts/", headers=AUTH, timeout=30,
                   json={"env_id": ENV, "problem_ids": ["p1"] * 600, "group_size": 7, "inference": upstream.endpoint()})
    assert r.status_code == 422 and "600 groups x 7 = 4200 rollouts" in r.json()["detail"]
    assert httpx.get(server + "/health", timeout=2).json() == {"status": "ok"}


@pytest.mark.attack
def test_evaluation_is_capped_at_problems_times_samples(server, upstream):
    r = httpx.post(server + "/evaluation/", headers=AUTH, timeout=30,  # num_problems 0: all 500 held-out
                   json={"env_id": ENV, "n_samples": 8, "inference": upstream.endpoint()})
    assert r.status_code == 422
    assert r.json()["detail"] == f"{HELDOUT} problems x (1 greedy + 8 samples) = {HELDOUT * 9} rollouts, " \
                                 f"over {MAX_ROLLOUTS_PER_REQUEST} per request"
    r = httpx.post(server + "/evaluation/", headers=AUTH, timeout=30,
                   json={"env_id": ENV, "problem_ids": ["h0"] * 5, "n_samples": 2, "pass_k": [1] * 3,
                         "inference": upstream.endpoint()})
    assert r.status_code == 422 and r.json()["detail"] == "pass_k repeats a k"
    # within the cap: answered (180 rollouts; the timeout is for a loaded machine, not a bound on speed)
    r = httpx.post(server + "/evaluation/", headers=AUTH, timeout=300,
                   json={"env_id": ENV, "num_problems": 20, "n_samples": 8, "pass_k": [1, 8],
                         "inference": upstream.endpoint()})
    assert r.status_code == 200 and r.json()["metrics"]["pass@8"] == 1.0


@pytest.mark.attack
@pytest.mark.parametrize("base_url", ["http://10.0.0.1:8000/v1", "http://example.com/v1",
                                      "http://169.254.169.254/latest/meta-data", "http://0.0.0.0:8000/v1",
                                      "http://[::ffff:127.0.0.1]:8000/v1", "http://127.0.0.1.nip.io/v1",
                                      "http://gpu-node-3.evil.com/v1", "http://10.10.0.1/v1",
                                      "http://2130706433/v1", "https://user@example.com/v1"])
def test_inference_is_sent_only_to_loopback_and_the_hosts_allowed_at_start(server, base_url):
    for path, extra in [("/rollouts/", {}), ("/grouped_rollouts/", {"group_size": 2}), ("/evaluation/", {})]:
        r = httpx.post(server + path, headers=AUTH, timeout=30,
                       json={"env_id": ENV, "inference": {"base_url": base_url}, **extra})
        assert r.status_code == 403, (path, r.text)
        assert "is not allowed: this server sends inference requests only to loopback" in r.json()["detail"]


def test_allowed_hosts_are_loopback_names_addresses_and_networks():
    from asyncrl.agents.server import InferenceHosts

    hosts = InferenceHosts(["gpu-node-3", "10.9.0.0/16", "192.168.1.7", "[fd00::1]"])
    for host in ["127.0.0.1", "127.8.9.1", "::1", "localhost", "LOCALHOST.", "gpu-node-3", "10.9.200.1",
                 "192.168.1.7", "fd00::1"]:
        assert hosts.allows(host), host
    for host in ["", "10.10.0.1", "192.168.1.8", "gpu-node-30", "node-3", "0.0.0.0", "::", "::ffff:127.0.0.1",
                 "localhost.example.com", "2130706433", "fd00::2"]:
        assert not hosts.allows(host), host
    with pytest.raises(ValueError, match="not a host name, IP address or network"):
        InferenceHosts(["*.example.com"])


@pytest.mark.attack
def test_a_malformed_base_url_gets_a_4xx_not_a_crash(server):
    for base_url, status in [("http://[::1/v1", 422), ("http://exa mple.com/v1", 403), ("http://:99999/v1", 422),
                             ("http://", 403), ("ftp://127.0.0.1/v1", 422), ("http://127.0.0.1:99999/v1", 422)]:
        r = httpx.post(server + "/rollouts/", headers=AUTH, timeout=30,
                       json={"env_id": ENV, "inference": {"base_url": base_url}})
        assert r.status_code == status, (base_url, r.status_code, r.text)


@pytest.mark.attack
@pytest.mark.parametrize("kind", ["secret", "garbled", "redirect", "long"])
def test_what_the_inference_endpoint_answers_is_never_echoed(server, upstream, kind):
    r = httpx.post(server + "/rollouts/", headers=AUTH, timeout=30,
                   json={"env_id": ENV, "problem_ids": ["p0", "p1"], "inference": upstream.endpoint(kind)})
    assert r.status_code == 200 and SECRET not in r.text
    reasons = {t["failure_reason"] for t in r.json()["rollouts"]}
    where = f"{upstream.url}/{kind}/v1/completions"
    assert reasons == {{"secret": f"loop_error: RuntimeError: {where} answered 500",
                        "garbled": f"loop_error: RuntimeError: {where} answered 200 with a reply that is not a "
                                   "completion (ValidationError)",
                        "redirect": f"loop_error: RuntimeError: {where} answered 302",
                        "long": f"loop_error: RuntimeError: {where} answered 100000 token ids for max_tokens=4"}[kind]}


@pytest.mark.attack
@pytest.mark.parametrize("body", [b"{not json", b'{"env_id": "echo", "split": "train"}', b"x" * 10_000_000])
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}"])
def test_without_the_token_the_body_is_not_read(server, body, auth):
    """No token: 401; a wrong one: 403; whatever the body (not 413 or 422: it is never parsed), and
    the connection closes. The 10 MB body is declared but not sent: the answer comes anyway."""
    head = (f"POST /problems/ HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n").encode()
    t0 = time.time()
    response, closed = _raw(_port(server), head + body[:100])
    assert _status(response) == (401 if auth is None else 403) and closed
    assert time.time() - t0 < 2


@pytest.mark.attack
@pytest.mark.parametrize("body,why", [
    (b'{"env_id": "echo", "inference": {"base_url": "http://127.0.0.1:9/v1"}, "num_rollouts": NaN}', "NaN is not JSON"),
    (b'{"env_id": "echo", "split": Infinity}', "Infinity is not JSON"),
    (b'{"env_id": "echo", "sampling": {"max_new_tokens": 4, "temperature": -Infinity}}', "-Infinity is not JSON"),
    (b'{"env_id": "echo", "n_samples": 1e999}', "overflows a float"),
    (b'{"env_id": "echo", "n_samples": ' + b"9" * 5000 + b"}", "integer of 5000 digits"),
    (b"[" * 50 + b"]" * 50, "nested deeper than 32 levels"),
    (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 32 levels"),
    (b'{"env_id": "\xff\xfe"}', "not UTF-8 text"),
    (b'{"env_id": "echo"', "Expecting ',' delimiter"),
])
def test_bodies_that_are_not_strict_json_get_422(server, body, why):
    for path in ["/problems/", "/rollouts/", "/evaluation/", "/envs/"]:
        r = httpx.request("GET" if path == "/envs/" else "POST", server + path, content=body, timeout=10,
                          headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 422, (path, r.text)
        assert r.json()["detail"][0]["msg"] == "JSON decode error" and why in r.json()["detail"][0]["ctx"]["error"]


@pytest.mark.attack
def test_oversized_bodies_get_413_declared_or_streamed(server):
    big = json.dumps({"env_id": "x" * MAX_REQUEST_BYTES}).encode()
    r = httpx.post(server + "/problems/", content=big, headers=AUTH, timeout=10)
    assert r.status_code == 413 and f"limit of {MAX_REQUEST_BYTES} bytes" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: chunked
        for _ in range(20):
            yield b" " * 65536

    r = httpx.post(server + "/problems/", content=chunks(), headers=AUTH, timeout=10)
    assert r.status_code == 413
    response, closed = _raw(_port(server), f"POST /problems/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                                           f"Content-Length: {'9' * 19}\r\n\r\n".encode())
    assert _status(response) == 413 and closed


@pytest.mark.attack
def test_slow_and_stalled_clients_are_dropped(server):
    port, t0 = _port(server), time.time()
    bound = READ_TIMEOUT_S + 2

    # connects and says nothing
    response, closed = _raw(port, b"", wait_s=bound + 1)
    assert response == b"" and closed and time.time() - t0 < bound

    # trickles its headers, a byte every 0.1 s (each byte would rearm a keep-alive timer)
    t0 = time.time()
    with socket.create_connection(("127.0.0.1", port), timeout=bound + 1) as s:
        try:
            for byte in b"GET /envs/ HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
                s.sendall(bytes([byte]))
                time.sleep(0.1)
                assert time.time() - t0 < bound, "still connected"
            raise AssertionError("the slow headers were never dropped")
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert time.time() - t0 < bound

    # sends its headers and part of its body, then stalls: 408, and the connection closes
    t0 = time.time()
    response, closed = _raw(port, f"POST /problems/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                                  "Content-Length: 100\r\n\r\n{\"env_id\"".encode(), wait_s=bound + 1)
    assert _status(response) == 408 and closed and time.time() - t0 < bound

    # headers over 16 KiB: 431 (400 where they arrive in parts) and closed
    for path in [b"/envs/", b"/health"]:
        response, closed = _raw(port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        assert _status(response) in (400, 431) and closed
    assert httpx.get(server + "/health", timeout=2).status_code == 200


@pytest.mark.attack
def test_health_answers_while_the_server_is_full_and_past_it_requests_get_503(server, upstream):
    """1000 rollouts stalled at the inference endpoint, then running: /health answers at once
    throughout, and rollouts past max_rollouts_in_flight are refused with 503 and Retry-After."""

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def health_latency(polls: int) -> float:
                slowest = 0.0
                for _ in range(polls):
                    t0 = time.time()
                    assert (await client.get(server + "/health", timeout=5)).status_code == 200
                    slowest = max(slowest, time.time() - t0)
                    await asyncio.sleep(0.05)
                return slowest

            full = asyncio.create_task(client.post(server + "/rollouts/", headers=AUTH, json={
                "env_id": ENV, "problem_ids": ["p0"] * 1000, "inference": upstream.endpoint("stall")}))
            await asyncio.sleep(1.0)
            stalled = await health_latency(10)
            r = await client.post(server + "/rollouts/", headers=AUTH, json={
                "env_id": ENV, "problem_ids": ["p1"] * (MAX_IN_FLIGHT - 1000 + 1), "inference": upstream.endpoint()})
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert r.json()["detail"] == f"busy: 1000 rollouts in flight and {MAX_IN_FLIGHT - 1000 + 1} asked for, " \
                                         f"over the server's limit of {MAX_IN_FLIGHT}; retry later"
            beside = asyncio.create_task(client.post(server + "/rollouts/", headers=AUTH, json={  # fits beside it
                "env_id": ENV, "num_rollouts": 50, "inference": upstream.endpoint()}))
            upstream.release()
            running = await health_latency(20)
            assert (await beside).status_code == 200
            r = await full
            assert r.status_code == 200 and [t["status"] for t in r.json()["rollouts"]] == ["ok"] * 1000
            assert stalled < 0.5 and running < 1.0, f"/health took {stalled:.2f} s (stalled), {running:.2f} s (running)"

    try:
        asyncio.run(main())
    finally:
        upstream.release()


# -- floods without the token ---------------------------------------------------------------
# All from one peer (127.0.0.1), as the clients that must still be served: what keeps them
# served cannot be a per-address refusal alone.

def _flood(port: int, firsts: list[bytes]) -> list[socket.socket]:
    """FLOOD connections to the server, the i-th having sent `firsts[i % len(firsts)]`
    (non-blocking from then on)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 512:  # one descriptor a connection
        resource.setrlimit(resource.RLIMIT_NOFILE, (FLOOD + 512 if hard == resource.RLIM_INFINITY
                                                    else min(FLOOD + 512, hard), hard))
    flood = []
    for i in range(FLOOD):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        with contextlib.suppress(OSError):  # the server may have dropped it already
            s.sendall(firsts[i % len(firsts)])
        s.setblocking(False)
        flood.append(s)
    return flood


def _dropped(flood: list[socket.socket], within_s: float) -> int:
    """How many of the flood's connections the server has closed within `within_s` (what it
    sends is read and discarded)."""
    open_, deadline = set(flood), time.monotonic() + within_s
    poller = select.poll()
    by_fd = {s.fileno(): s for s in flood}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    while open_ and time.monotonic() < deadline:
        # wait for the next socket with something to say (data, a close, a reset), not a fixed pause
        for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            s = by_fd[fd]
            try:
                if s.recv(65536):
                    continue
            except BlockingIOError:
                continue
            except OSError:  # reset
                pass
            open_.discard(s)
            poller.unregister(fd)
    return len(flood) - len(open_)


def _serves(url: str) -> None:
    """/health and a request with the token are answered (the timeouts are generous bounds)."""
    r = httpx.get(url + "/health", timeout=5)
    assert r.status_code == 200, r.text
    r = httpx.get(url + "/envs/", headers=AUTH, timeout=5)
    assert r.status_code == 200 and r.json()["envs"][0]["env_id"] == ENV, r.text


def test_the_connection_budget_closes_the_oldest_unauthenticated_connection_of_the_biggest_peer():
    """The policy behind the floods' tests, connection by connection (no sockets, no timers)."""
    from asyncrl.agents.http_guard import ServerLimits, _Budget, _Connection

    class Conn(_Connection):
        def __init__(self, budget: _Budget, peer: str) -> None:
            self.budget, self.peer, self.dropped = budget, peer, ""

        def drop(self, why: str) -> None:
            self.dropped = why
            self.budget.remove(self)

    async def main() -> None:
        budget = _Budget(ServerLimits(max_connections=8, max_unauthenticated=4, max_unauthenticated_per_peer=3))
        client, other = Conn(budget, "10.0.0.1"), Conn(budget, "10.0.0.2")
        assert budget.admit(client) and budget.admit(other)
        budget.authenticate(client)
        flood = [Conn(budget, "10.0.0.9") for _ in range(100)]
        assert all(budget.admit(c) for c in flood)
        # past max_connections, each new connection closed the flood's oldest, never another address's
        assert [c for c in flood if not c.dropped] == flood[-6:] and not client.dropped and not other.dropped
        assert flood[0].dropped == "the server's connections are full"
        budget.settle()  # what SETTLE_S later does: the flood is cut to its address's share
        assert [c for c in flood if not c.dropped] == flood[-3:]
        assert flood[-4].dropped == "its address's unauthenticated connections are full"
        budget.began(flood[-3])  # a request began on it: now its address's youngest
        late = Conn(budget, "10.0.0.9")
        assert budget.admit(late)
        budget.settle()
        assert flood[-2].dropped and not flood[-3].dropped and not late.dropped
        # all authenticated: a new connection is refused, none closed
        full = _Budget(ServerLimits(max_connections=2, max_unauthenticated=1, max_unauthenticated_per_peer=1))
        held = [Conn(full, "10.0.0.1"), Conn(full, "10.0.0.2")]
        for c in held:
            assert full.admit(c)
            full.authenticate(c)
        assert not full.admit(Conn(full, "10.0.0.3")) and not any(c.dropped for c in held)

    asyncio.run(main())


@pytest.mark.attack
def test_a_flood_of_idle_connections_keeps_out_neither_health_nor_a_client_with_the_token(server):
    """600 connections that send nothing, far past max_connections: /health and a client with the
    token (from the same address) are answered while they are open, and each is dropped."""
    flood = _flood(_port(server), [b""])
    try:
        _serves(server)
        assert _dropped(flood, READ_TIMEOUT_S + 10) == FLOOD
        _serves(server)
    finally:
        for s in flood:
            s.close()


@pytest.mark.attack
def test_a_flood_of_trickled_requests_keeps_out_neither_health_nor_a_client_with_the_token(server):
    """600 requests that send a byte every 0.5 s, for longer than any deadline or keep-alive: a
    /health with a body of 1 GB declared, or chunked, or headers that never end. /health and a
    client with the token are answered throughout, each of the flood's connections is dropped,
    and a /health with a body is refused at once."""
    port = _port(server)
    kinds = [(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n", b"x"),
             (b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", b"1\r\nx\r\n"),
             (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a")]
    flood = _flood(port, [head for head, _ in kinds])
    try:
        for tick in range(14):  # 7 s: past READ_TIMEOUT_S and the 5 s keep-alive
            for i, s in enumerate(flood):
                with contextlib.suppress(OSError):  # dropped
                    s.send(kinds[i % len(kinds)][1])
            if tick % 4 == 0:
                _serves(server)
            time.sleep(0.5)  # the attack's own pace (a byte every 0.5 s), not a wait for the server
        _serves(server)
        assert _dropped(flood, READ_TIMEOUT_S + 10) == FLOOD
    finally:
        for s in flood:
            s.close()
    for head, trickle in kinds[:2]:  # not waited for
        response, closed = _raw(port, head + trickle, wait_s=READ_TIMEOUT_S + 5)
        assert _status(response) == 400 and b"/health takes no body" in response and closed


@pytest.mark.attack
def test_pipelined_requests_whose_answers_are_never_read_are_dropped(server):
    """A client with the token sends 300 requests in one go and reads none of the answers (10 MB,
    more than the socket buffers hold): the server drops the connection once it cannot write
    for its write deadline, and serves on."""
    body = json.dumps({"env_id": ENV, "split": "heldout"}).encode()  # 500 problems: ~35 KB an answer
    request = (f"POST /problems/ HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    sent_requests = 300
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect(("127.0.0.1", _port(server)))
        s.setblocking(False)
        data, sent, deadline = request * sent_requests, 0, time.monotonic() + 10
        while sent < len(data) and time.monotonic() < deadline:  # what the server takes before it stops reading
            try:
                sent += s.send(data[sent:])
            except BlockingIOError:
                select.select([], [s], [], max(0.0, deadline - time.monotonic()))  # until it takes more
            except OSError:  # dropped already
                break
        poller = select.poll()  # wait for the server's close without reading (reading would unblock it)
        poller.register(s, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        poller.poll((WRITE_TIMEOUT_S + 10) * 1000)
        answers, closed, deadline = b"", False, time.monotonic() + 20
        while not closed and time.monotonic() < deadline:
            try:
                chunk = s.recv(1 << 20)
                answers += chunk
                closed = not chunk
            except BlockingIOError:
                select.select([s], [], [], max(0.0, deadline - time.monotonic()))  # until there is more
            except OSError:  # reset
                closed = True
    assert closed and answers.count(b"HTTP/1.1 200 OK") < sent_requests, \
        f"{answers.count(b'HTTP/1.1 200 OK')} of {sent_requests} answered, closed: {closed}"
    _serves(server)

# -- the fuzz ---------------------------------------------------------------------------

FUZZ_REQUESTS = 1000
_PATHS = ["/health", "/envs/", "/problems/", "/rollouts/", "/rollouts/", "/grouped_rollouts/", "/grouped_rollouts/",
          "/evaluation/", "/", "/docs", "/openapi.json", "/rollouts", "/envs/../health", "/%00", "/%ff%fe",
          "/rollouts/?x=" + "a" * 2000, "/" + "b" * 5000, "/evaluation/evaluation/", "//rollouts/", "*",
          "http://127.0.0.1/rollouts/"]
_METHODS = ["GET", "POST", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "CONNECT",
            "G\x00T", "get"]
_HEADERS = [b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"Content-Length: 5", b"Content-Length: -1",
            b"Content-Length: 99999999999999999999999", b"Expect: 100-continue", b"Content-Encoding: gzip",
            b"X-Forwarded-For: 10.0.0.1", b"Host: evil.com", b"Authorization: Bearer x",
            b"X-Big: " + b"a" * 9000, b"Bad Header: x", b"X-Ctl: a\x01b", b"Upgrade: websocket\r\nConnection: upgrade",
            b"Cookie: " + b"c=1; " * 500, b"Content-Type: multipart/form-data; boundary=x"]


def _fuzz_value(rng: random.Random, depth: int = 0) -> object:
    choice = rng.randrange(12)
    if choice == 0 or depth > 4:
        return rng.choice([None, True, False, 0, -1, 1, 2**31, -(2**63), 2**64, 10**60, 0.5, -1e308, 1e-320])
    if choice == 1:
        return rng.choice(["", "p0", "h0", "echo", "x" * rng.randrange(1, 5000), "\u0000", "\ud7ff\u202e", "../../"])
    if choice == 2:
        return [_fuzz_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    if choice == 3:
        return {rng.choice(["env_id", "inference", "problem_ids", "x"]): _fuzz_value(rng, depth + 1)
                for _ in range(rng.randrange(0, 4))}
    return rng.choice(["p0", "p1", "h0", 3, 8, -5, 0, 1.5, [], {}, "train", "heldout"])


def _fuzz_body(rng: random.Random, upstream: Upstream) -> bytes:
    """A request body: a valid one (about a third), or one with a valid one's shape, mutated."""
    valid: dict[str, object] = {
        "env_id": rng.choice([ENV] * 8 + ["nope", "os.system"]),
        "inference": rng.choice([upstream.endpoint()] * 6 + [
            upstream.endpoint("secret"), upstream.endpoint("garbled"), {"base_url": "http://10.0.0.1/v1"},
            {"base_url": "file:///etc/passwd"}, {"base_url": upstream.url + "/ok/v1", "extra": 1}]),
    }
    if rng.random() < 0.5:
        valid["problem_ids"] = [rng.choice(["p0", "p1", "p49", "p50", "h0"])] * rng.choice([1, 2, 5, 4097, 30000])
    if rng.random() < 0.3:
        valid[rng.choice(["num_rollouts", "num_groups", "group_size", "n_samples", "num_problems"])] = \
            rng.choice([0, 1, 3, 9, -1, 2**40, 10**30])
    if rng.random() < 0.2:
        valid["sampling"] = {"max_new_tokens": rng.choice([1, 4, 0, 10**9]),
                             "temperature": rng.choice([0.0, 1.0, 1e308]), "top_p": rng.choice([0.5, 1.0, 2.0])}
    if rng.random() < 0.2:
        valid[rng.choice(list(valid) + ["split", "pass_k", "group_ids", "junk"])] = _fuzz_value(rng)
    body = json.dumps(valid).encode()
    mutation = rng.randrange(20)
    if mutation == 0:
        return body.replace(b"1", b"NaN", 1) if b"1" in body else b"NaN"
    if mutation == 1:
        return body.replace(b"1", b"1e999", 1) if b"1" in body else b"-Infinity"
    if mutation == 2:
        depth = rng.choice([10, 33, 500, 20000])
        return b'{"env_id": ' + b"[" * depth + b"]" * depth + b"}"
    if mutation == 3:
        return rng.randbytes(rng.randrange(1, 3000))
    if mutation == 4:
        return b"x" * rng.choice([MAX_REQUEST_BYTES + 1, 2 * MAX_REQUEST_BYTES])
    if mutation == 5:
        return json.dumps(_fuzz_value(rng)).encode()
    if mutation == 6:
        return body[: rng.randrange(len(body))]  # cut short (and declared so)
    if mutation == 7:
        return body.replace(b'"', b"'", rng.randrange(1, 4))
    if mutation == 8:
        return b'{"env_id": "echo", "num_rollouts": ' + b"1" * rng.choice([20, 400, 4400]) + b"}"
    if mutation == 9:
        return body.replace(b"}", b', "env_id": "echo"}', 1)  # a repeated key
    return body


def _fuzz_request(rng: random.Random, upstream: Upstream) -> tuple[bytes, bool]:
    """Raw bytes of one request, and whether the server may fairly wait for more of it (a body
    shorter than its Content-Length: it answers 408 after its read timeout)."""
    aimed = rng.random() < 0.5  # at a rollout endpoint, as a client would
    method = "POST" if aimed else rng.choice(_METHODS)
    path = rng.choice(["/rollouts/", "/grouped_rollouts/", "/evaluation/"] if aimed else _PATHS)
    body = _fuzz_body(rng, upstream)
    auth = AUTH["Authorization"] if aimed or rng.random() < 0.7 else rng.choice(
        ["", "Bearer x", f"Bearer {TOKEN}x", TOKEN, f"bearer {TOKEN}", f"Bearer  {TOKEN} ", f"Bearer {TOKEN[:-1]}"])
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    if auth:
        lines.append(f"Authorization: {auth}".encode())
    lines.append(b"Content-Type: " + rng.choice([b"application/json"] * 4 + [b"text/plain", b"application/x-json",
                                                                              b"application/json; charset=latin-1"]))
    declared, stalls = len(body), False
    if rng.random() < 0.05:  # declared longer than sent: the server waits for the rest
        declared, stalls = len(body) + rng.randrange(1, 100), True
    elif rng.random() < 0.05:
        declared = rng.randrange(0, max(1, len(body)))  # shorter: the rest reads as a next request
    lines.append(f"Content-Length: {declared}".encode())
    if rng.random() < 0.12:
        lines.append(rng.choice(_HEADERS))
        stalls = stalls or lines[-1].startswith(b"Transfer-Encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body, stalls


async def _exchange(port: int, request: bytes, timeout_s: float) -> tuple[int, bytes]:
    """Send a raw request and read the answer to the end: its status (0: the connection closed
    without one) and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        with contextlib.suppress(ConnectionError):  # the server may refuse (and close) before all of it is sent
            writer.write(request)
            await writer.drain()
        answer = b""
        async with asyncio.timeout(timeout_s):
            with contextlib.suppress(ConnectionError):
                while chunk := await reader.read(65536):
                    answer += chunk
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return (_status(head) if head else 0), body


@pytest.mark.attack
def test_a_seeded_fuzz_of_1000_requests_gets_no_5xx_and_health_answers_throughout(server, upstream):
    """1000 seeded requests, 8 at a time, of random methods, paths, headers and bodies (NaN, huge
    numbers, deep nesting, wrong types, repeated ids, oversized, cut short, bytes), most with the
    token; /health is polled all the while. No 5xx, no answer that quotes the inference server,
    every request answered (or its connection closed) within its bound, /health within 1 s."""
    rng = random.Random(24)
    requests = [_fuzz_request(rng, upstream) for _ in range(FUZZ_REQUESTS)]
    port = _port(server)
    statuses: dict[int, int] = {}
    health: list[float] = []
    failures: list[str] = []

    async def main() -> None:
        done = asyncio.Event()
        queue = list(enumerate(requests))

        async def worker() -> None:
            while queue:
                i, (request, stalls) = queue.pop()
                try:
                    status, body = await _exchange(port, request, READ_TIMEOUT_S + 10 if stalls else 30)
                except TimeoutError:
                    failures.append(f"request {i} {request[:200]!r}: no answer")
                    continue
                statuses[status] = statuses.get(status, 0) + 1
                if status >= 500 or SECRET.encode() in body:
                    failures.append(f"request {i} {request[:300]!r}: {status} {body[:300]!r}")

        async def poll_health() -> None:
            async with httpx.AsyncClient(timeout=5) as client:
                while not done.is_set():
                    t0 = time.time()
                    try:
                        ok = (await client.get(server + "/health")).status_code == 200
                    except httpx.HTTPError as e:
                        ok = False
                        failures.append(f"/health: {type(e).__name__}")
                    health.append(time.time() - t0 if ok else float("inf"))
                    await asyncio.sleep(0.05)

        poller = asyncio.create_task(poll_health())
        await asyncio.wait_for(asyncio.gather(*[worker() for _ in range(8)]), 120)
        done.set()
        await poller

    t0 = time.time()
    asyncio.run(main())
    print(f"fuzz: {FUZZ_REQUESTS} requests in {time.time() - t0:.1f} s; statuses {dict(sorted(statuses.items()))}; "
          f"/health polled {len(health)} times, slowest {max(health):.3f} s")
    assert not failures, "\n".join(failures[:20])
    assert statuses.get(0, 0) < 0.05 * FUZZ_REQUESTS and statuses.get(200, 0) > 20  # it did serve rollouts
    assert len(health) > 10 and max(health) < 1.0


# -- the rollout worker's inference gateway (asyncrl/rollout/gateway.py) -------------------------

@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[str, str]]:
    """A gateway over an engine that answers one token (and then the stop tokens it was asked to stop
    at, so that a test sees them arrive), served as in training; (its URL, its key)."""
    from asyncrl.inference.protocol import InferenceInterface
    from asyncrl.rollout.gateway import InferenceGateway

    class OneToken(InferenceInterface):
        async def agenerate(self, prompt_token_ids, sampling, request_id):
            n = 1 + len(sampling.stop_token_ids)
            return GenerationResult([7, *sampling.stop_token_ids], [-0.5] * n, [3] * n, "length")

    ready, stop = threading.Event(), None
    box: dict = {}

    def run() -> None:
        async def main() -> None:
            nonlocal stop
            stop = asyncio.Event()
            gw = InferenceGateway(lambda: OneToken(), SimpleNamespace(encode=lambda text: [1], decode=lambda ids: "x"))
            endpoint = await gw.serve()
            box.update(url=endpoint.base_url.removesuffix("/v1"), key=endpoint.api_key, server=gw._server)
            ready.set()
            await stop.wait()
            await gw.stop()

        box["loop"] = asyncio.new_event_loop()
        box["loop"].run_until_complete(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield box["url"], box["key"]
    box["loop"].call_soon_threadsafe(stop.set)
    thread.join(30)


@pytest.mark.attack
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key"])
def test_the_gateway_answers_without_its_key_before_reading_the_body(gateway, auth):
    """A 38 MB keyless body blocked the worker's loop and took 500 MB before: now 401/403 from the
    headers, the body never read (declared, not sent), the connection closed."""
    url, _ = gateway
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {38 * 2**20}\r\n" + (f"Authorization: {auth}\r\n" if auth else "") + "\r\n").encode()
    t0 = time.time()
    response, closed = _raw(_port(url), head + b"[" * 100)
    assert _status(response) == (401 if auth is None else 403) and closed and time.time() - t0 < 2


@pytest.mark.attack
def test_the_gateway_bounds_bodies_and_takes_only_strict_json(gateway):
    from asyncrl.rollout.gateway import GATEWAY_LIMITS

    url, key = gateway
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(url + "/v1/completions", content=b" " * (GATEWAY_LIMITS.max_request_bytes + 1), headers=auth,
                   timeout=10)
    assert r.status_code == 413
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": [1], "temperature": NaN}', headers=auth, timeout=10)
    assert r.status_code == 422
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7]
    # vLLM's stop_token_ids reach the engine; at most 64 of them, none negative
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "stop_token_ids": [258]}, headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 258]
    for bad in ([-1], list(range(65))):
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "stop_token_ids": bad}, headers=auth,
                       timeout=10)
        assert r.status_code == 422, bad


def test_the_gateway_serves_under_the_env_servers_connection_budget(gateway):
    """Its connections are the env server's h11 layer: the budget and deadlines of ServerLimits
    (tested against the env server above), not uvicorn's own."""
    from asyncrl.agents.http_guard import ServerLimits
    from asyncrl.rollout.gateway import GATEWAY_LIMITS

    assert isinstance(GATEWAY_LIMITS, ServerLimits)
    url, key = gateway
    # a trickled request without the key is dropped at the read deadline, whatever it declared
    with socket.create_connection(("127.0.0.1", _port(url)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0, closed = time.time(), False
        while time.time() - t0 < GATEWAY_LIMITS.read_timeout_s + 5:
            try:
                s.sendall(b"X")
                s.settimeout(0.5)
                if s.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.time() - t0 <= GATEWAY_LIMITS.read_timeout_s + 3


# -- the engine request channel ------------------------------------------------------------

async def _channel(engine_received: list) -> tuple[ChannelServer, str, int, str]:
    async def generate(prompt: list[int], sampling: SamplingSpec, request_id: str) -> GenerationResult:
        engine_received.append(request_id)
        return GenerationResult([1], [0.0], [0], "stop")

    server = ChannelServer(generate, "engine-0")
    address = await server.start("127.0.0.1")
    return server, address.host, address.port, address.token


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    """Whether the engine closed the connection within `seconds` (anything it sends is read)."""
    try:
        async with asyncio.timeout(seconds):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


@pytest.mark.attack
@pytest.mark.parametrize("claimed", [channel.MAX_TOKEN_FRAME_BYTES + 1, 2**20, channel.MAX_FRAME_BYTES, 2**32 - 1])
def test_a_first_frame_claiming_more_than_a_token_is_dropped_before_it_is_read(claimed):
    async def main() -> None:
        received: list = []
        server, host, port, _ = await _channel(received)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(claimed.to_bytes(4, "big") + b"x" * 100)  # and never the rest
        await writer.drain()
        assert await _closed_within(reader, 2.0)  # not after AUTH_TIMEOUT_S, waiting for `claimed` bytes
        writer.close()
        server.close()
        assert received == []

    asyncio.run(main())


@pytest.mark.attack
@pytest.mark.parametrize("first", [b"0" * 32, b"", b"\x00" * 256, "🔑".encode() * 8])
def test_a_wrong_token_is_dropped(first):
    async def main() -> None:
        received: list = []
        server, host, port, token = await _channel(received)
        reader, writer = await asyncio.open_connection(host, port)
        request = msgspec.msgpack.encode(channel._Request("r", [1], SamplingSpec(4)))
        writer.write(_frame(first) + _frame(request))
        assert await _closed_within(reader, 2.0)
        writer.close()
        server.close()
        assert received == []

    asyncio.run(main())


@pytest.mark.attack
def test_a_silent_peer_is_dropped_after_the_auth_timeout(monkeypatch):
    monkeypatch.setattr(channel, "AUTH_TIMEOUT_S", 0.3)

    async def main() -> None:
        server, host, port, _ = await _channel([])
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"\x00\x00")  # half a length
        assert await _closed_within(reader, 2.0)
        writer.close()
        server.close()

    asyncio.run(main())


@pytest.mark.attack
@pytest.mark.parametrize("garbage", [
    b"\xc1" * 10,  # not msgpack
    msgspec.msgpack.encode({"request_id": "r"}),  # msgpack, not a request
    msgspec.msgpack.encode(["r", "not tokens", [4, 1.0, 1.0, [], False]]),
    msgspec.msgpack.encode(["r", [1], [4, 1.0, 1.0, [], False], "extra", "fields"]) + b"\x00",
    b"",
])
def test_garbage_frames_after_the_token_drop_the_connection_and_the_engine_serves_on(garbage):
    async def main() -> None:
        received: list = []
        server, host, port, token = await _channel(received)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(token.encode()) + _frame(garbage))
        assert await _closed_within(reader, 2.0)
        writer.close()
        # an oversized frame after the token too
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(token.encode()) + (channel.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        assert await _closed_within(reader, 2.0)
        writer.close()
        assert received == []
        # a well-formed request on a fresh connection is answered
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(token.encode()) + _frame(msgspec.msgpack.encode(
            channel._Request("ok", [1], SamplingSpec(4)))))
        length = int.from_bytes(await reader.readexactly(4), "big")
        reply = channel._decode_reply(await reader.readexactly(length))
        assert reply.request_id == "ok" and reply.result.token_ids == [1] and received == ["ok"]
        writer.close()
        server.close()

    asyncio.run(main())


if __name__ == "__main__":
    serve(int(sys.argv[1]))

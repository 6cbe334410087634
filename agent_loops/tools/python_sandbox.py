"""python: runs model-written code in an OS sandbox (docs/security.md).

With `isolation: bwrap` (the default) each run is one bubblewrap container:
  - its own PID, network, mount, IPC and UTS namespaces: it sees no other process, has no
    network (not even loopback), and the whole container dies with its first process or
    when the tool kills it (a detached or daemonized child cannot outlive the run);
  - a read-only view of /usr and of the Python installation (its site-packages hidden: the
    standard library only), nothing else of the host's files; a private writable directory (the
    working directory, also TMPDIR and HOME) that is a tmpfs of `disk_mb` inside the container,
    gone with it: nothing the code writes reaches the host's disk or outlives the call;
  - an unprivileged user: when asyncrl runs as root a uid never used before on this host (a
    host-wide counter), capabilities dropped, no-new-privs; the caller's own uid in a user
    namespace otherwise;
  - a system-call filter (syscall_filter.py) refusing what code tools never need;
  - bwrap's options passed through a file descriptor, so the container's /proc/1/cmdline does
    not show how the host built it;
  - limits set before the code runs: CPU time, address space, file size, processes, open
    files; wall time enforced from outside;
  - at most `max_output_bytes` of its stdout+stderr are ever read.
With `isolation: none` the code runs as a plain child process with the same limits and no
isolation at all; `allow_unisolated: true` must say that this is wanted.

Every failure comes back as text starting with "error:"; the tool itself never raises.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import shutil
import signal
import site
import sys
import tempfile
from pathlib import Path

from agent_loops.tools.syscall_filter import FilterUnavailable, filter_bpf
from asyncrl.config.schema import SandboxConfig

logger = logging.getLogger(__name__)

# Runs in the sandbox: limits first, then the code, read from stdin.
_BOOTSTRAP = r"""
import resource, sys
cpu_s, mem, fsize, nproc = (int(x) for x in sys.argv[1:5])
for limit, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
code = sys.stdin.read()
sys.stdin.close()
del resource, cpu_s, mem, fsize, nproc, limit, value
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""
_INSIDE_DIR = "/sandbox"
# Uids of sandboxed code when asyncrl runs as root: far above any real user's and below
# (uid_t)-1, one per run and never used twice on a host (until 2.5e9 runs), so that the process
# limit counts only that run's processes and no kernel state keyed by uid links two runs.
_UID_BASE = 1_500_000_000
_UID_COUNT = 2_500_000_000
# The host-wide counter behind them: in /run (root's, emptied at boot, as is every kernel object a
# uid could have left behind), else the temp dir.
_UID_COUNTER = "asyncrl-sandbox-uid"


class SandboxUnavailable(RuntimeError):
    """The configured isolation cannot run on this host."""


@functools.cache
def _bwrap() -> str | None:
    return shutil.which("bwrap")


def check_sandbox(cfg: SandboxConfig) -> None:
    """Raise SandboxUnavailable with what to do when `cfg` cannot run here; warn when it runs
    without isolation."""
    if cfg.isolation == "none":
        if not cfg.allow_unisolated:
            raise SandboxUnavailable("tools.sandbox.isolation=none runs model-written code without any isolation; "
                                     "set tools.sandbox.allow_unisolated=true to accept that")
        _warn_unisolated()
        return
    if _bwrap() is None:
        raise SandboxUnavailable("the python tool needs bubblewrap (`bwrap`) for its sandbox: install it "
                                 "(Debian/Ubuntu: apt-get install bubblewrap; scripts/setup_venv.sh does this as "
                                 "root), or set tools.sandbox.isolation=none tools.sandbox.allow_unisolated=true "
                                 "to run model code unisolated")
    try:
        filter_bpf()
    except FilterUnavailable as e:
        raise SandboxUnavailable(str(e)) from None
    probe = _probe_bwrap()
    if probe:
        raise SandboxUnavailable(f"bubblewrap cannot create the sandbox on this host: {probe} (it needs bubblewrap "
                                 ">= 0.8 and user namespaces or root: see docs/security.md)")


@functools.cache
def _warn_unisolated() -> None:
    logger.warning("tools.sandbox.isolation=none: model-written code runs WITHOUT isolation (it can read and "
                   "write your files, reach the network and signal your processes)")


@functools.cache
def _probe_bwrap() -> str:
    """Empty when a trivial sandbox runs, else bwrap's complaint."""
    import subprocess

    argv, fds = _bwrap_argv([*_interpreter_argv(), "-c", "pass"], SandboxConfig().disk_mb)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL, pass_fds=fds)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    finally:
        for fd in fds:
            os.close(fd)
    return "" if done.returncode == 0 else (done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}")


async def run_python(code: str, cfg: SandboxConfig | None = None) -> str:
    """Run `code`; return its stdout and stderr (cut at the output cap), or "error: ...".

    Raises SandboxUnavailable when the configured isolation cannot run here (a setup problem,
    not the model's)."""
    cfg = cfg or SandboxConfig()
    check_sandbox(cfg)
    limits = [str(cfg.cpu_s), str(cfg.memory_mb * 2**20), str(cfg.max_file_mb * 2**20), str(cfg.max_processes)]
    command = [*_interpreter_argv(), "-c", _BOOTSTRAP, *limits]
    if cfg.isolation == "bwrap":
        argv, fds = _bwrap_argv(command, cfg.disk_mb)
        workdir = None
        env = {"PATH": "/usr/bin:/bin"}
    else:
        fds, argv = [], command
        workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
    try:
        return await _run(argv, fds, workdir, env, code, cfg)
    finally:
        for fd in fds:
            os.close(fd)
        if workdir is not None:
            await _remove_tree(workdir)


async def _run(argv: list[str], fds: list[int], cwd: str | None, env: dict[str, str], code: str,
               cfg: SandboxConfig) -> str:
    # The code comes from a file and the output goes to a pipe of our own: asyncio's pipes
    # would make wait() wait for every writer of the output, and we stop reading at the cap.
    with tempfile.TemporaryFile() as code_file:
        code_file.write(code.encode())
        code_file.seek(0)
        read_end, write_end = os.pipe()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=code_file, stdout=write_end, stderr=write_end, cwd=cwd, start_new_session=True,
                env=env, pass_fds=fds)
        except OSError as e:
            os.close(read_end)
            return f"error: could not start the sandbox: {e}"
        finally:
            os.close(write_end)
    output = _Output(read_end)

    async def finish() -> tuple[bytes, bool]:
        data, truncated = await output.read(cfg.max_output_bytes)
        if not truncated:  # at the cap the run is killed, below
            await proc.wait()
        return data, truncated

    try:
        data, truncated = await asyncio.wait_for(finish(), timeout=cfg.wall_s)
    except asyncio.TimeoutError:
        return f"error: wall-time limit of {cfg.wall_s:g}s exceeded"
    finally:  # whatever happened (a timeout, the cap, the caller cancelling): nothing is left running
        _kill(proc)
        output.close()
        await proc.wait()
    text = data.decode(errors="replace")
    if truncated:
        text += f"\n... [output truncated at {cfg.max_output_bytes} bytes]"
    status = _exit_status(proc.returncode, cfg.isolation)
    if status in (-signal.SIGXCPU, -signal.SIGKILL) and not truncated:
        return f"error: CPU-time limit of {cfg.cpu_s}s exceeded\n" + text
    if status != 0 and not truncated:
        last = text.strip().splitlines()[-1] if text.strip() else f"exit status {status}"
        return f"error: {last}\n" + text
    return text


class _Output:
    """The read end of the run's stdout+stderr pipe."""

    def __init__(self, fd: int):
        self.fd = fd
        os.set_blocking(fd, False)
        self.readable = asyncio.Event()
        asyncio.get_running_loop().add_reader(fd, self.readable.set)

    async def read(self, cap: int) -> tuple[bytes, bool]:
        """At most `cap` bytes, and whether there was more; ends at end of output (every process
        of the run has exited or closed it)."""
        data = b""
        while len(data) <= cap:
            await self.readable.wait()
            self.readable.clear()
            try:
                chunk = os.read(self.fd, cap + 1 - len(data))
            except BlockingIOError:
                continue
            if not chunk:
                return data, False
            data += chunk
        return data[:cap], True

    def close(self) -> None:
        asyncio.get_running_loop().remove_reader(self.fd)
        os.close(self.fd)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """Kill the run: its process group (unisolated), bwrap itself (its PID namespace then dies)."""
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def _exit_status(returncode: int | None, isolation: str) -> int:
    """The code's exit status as Popen reports it (-N: killed by signal N); bwrap reports a
    child killed by signal N as exit status 128+N."""
    code = returncode if returncode is not None else -signal.SIGKILL
    if isolation == "bwrap" and code > 128:
        return -(code - 128)
    return code


@functools.cache
def _interpreter_argv() -> list[str]:
    """The base interpreter (not a venv's wrapper: model code gets the standard library only),
    isolated mode, no bytecode writes."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix) / "bin" / version
    exe = base if base.exists() else Path(os.path.realpath(sys.executable))
    return [str(exe), "-I", "-B"]


def _bwrap_argv(command: list[str], disk_mb: int) -> tuple[list[str], list[int]]:
    """bwrap's command line for one run, and the file descriptors it reads (to pass to it and
    close after): its options, so that they stay off the container's /proc/1/cmdline, and the
    compiled system-call filter."""
    options = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
               "--die-with-parent", "--new-session", "--clearenv",
               "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _INSIDE_DIR, "--setenv", "TMPDIR", _INSIDE_DIR,
               "--ro-bind", "/usr", "/usr", "--dev", "/dev", "--proc", "/proc"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            options += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            options += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        # bwrap copies the modes of the host's parent directories (/root is 0700): make them traversable
        for parent in reversed(Path(prefix).parents[:-1]):
            options += ["--perms", "0755", "--dir", str(parent)]
        options += ["--ro-bind", prefix, prefix]
    for packages in _site_packages():  # the docs promise the standard library, nothing installed beside it
        options += ["--tmpfs", packages, "--remount-ro", packages]
    # The writable directory lives and dies with the container: nothing to clean up on the host, whatever
    # the code wrote (depth, count, size), and its size is bounded.
    options += ["--size", str(disk_mb * 2**20), "--perms", "0777", "--tmpfs", _INSIDE_DIR, "--chdir", _INSIDE_DIR]
    if os.geteuid() == 0:
        uid = _next_uid()
        drop = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}",
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    else:
        options.append("--unshare-user")
        drop = []
    options_fd = _memfd("bwrap-args", b"".join(o.encode() + b"\0" for o in options))
    filter_fd = _memfd("bwrap-seccomp", filter_bpf())
    argv = [_bwrap() or "bwrap", "--args", str(options_fd), "--seccomp", str(filter_fd), "--", *drop, *command]
    return argv, [options_fd, filter_fd]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def _site_packages() -> tuple[str, ...]:
    """The base interpreter's directories of installed packages that the sandbox would see."""
    found = site.getsitepackages([sys.base_prefix]) + ["/usr/lib/python3/dist-packages"]
    return tuple(sorted({os.path.realpath(d) for d in found if os.path.isdir(d)}))


def _next_uid() -> int:
    """A uid no earlier run on this host had (the counter is shared by every process of the host)."""
    base = "/run" if os.access("/run", os.W_OK) else tempfile.gettempdir()
    fd = os.open(os.path.join(base, _UID_COUNTER), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_uid != os.geteuid():  # someone else's file could hand out used uids
            raise SandboxUnavailable(f"{base}/{_UID_COUNTER} is not owned by this user: remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a write: microseconds
        text = os.read(fd, 32).decode(errors="replace").strip()
        n = int(text) if text.isdigit() else 0
        os.lseek(fd, 0, os.SEEK_SET)
        os.ftruncate(fd, 0)
        os.write(fd, str(n + 1).encode())
    finally:
        os.close(fd)
    return _UID_BASE + n % _UID_COUNT


async def _remove_tree(path: str) -> None:
    """Remove an unisolated run's directory off the event loop, whatever its depth or file count
    (shutil.rmtree recurses, and stops at Python's recursion limit)."""
    proc = await asyncio.create_subprocess_exec("rm", "-rf", "--one-file-system", "--", path,
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    _, err = await proc.communicate()
    if proc.returncode != 0:
        logger.warning("python tool: could not remove %s: %s", path, err.decode(errors="replace").strip())

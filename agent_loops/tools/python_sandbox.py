"""python: runs model-written code in an OS sandbox (docs/security.md).

With `isolation: bwrap` (the default) each run is one bubblewrap container:
  - its own PID, network, mount, IPC and UTS namespaces: it sees no other process, has no
    network (not even loopback), and the whole container dies with its first process or
    when the tool kills it (a detached or daemonized child cannot outlive the run);
  - a read-only view of /usr and of the Python installation, nothing else of the host's
    files; a private writable directory (the working directory, also TMPDIR and HOME);
  - an unprivileged user: a fresh uid of its own when asyncrl runs as root (capabilities
    dropped, no-new-privs), the caller's own uid in a user namespace otherwise;
  - limits set before the code runs: CPU time, address space, file size, processes, open
    files; wall time enforced from outside;
  - at most `max_output_bytes` of its stdout+stderr are ever read.
With `isolation: none` the code runs as a plain child process with the same limits and no
isolation at all; `allow_unisolated: true` must say that this is wanted.

Every failure comes back as text starting with "error:"; the tool itself never raises.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

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
# Uids of sandboxed code when asyncrl runs as root: far above any real user's, and one per run,
# so that the process limit counts only that run's processes.
_UID_BASE = 1_500_000_000
_uids = itertools.count()


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
    probe = _probe_bwrap()
    if probe:
        raise SandboxUnavailable(f"bubblewrap cannot create the sandbox on this host: {probe} (unprivileged user "
                                 "namespaces may be disabled: see docs/security.md)")


@functools.cache
def _warn_unisolated() -> None:
    logger.warning("tools.sandbox.isolation=none: model-written code runs WITHOUT isolation (it can read and "
                   "write your files, reach the network and signal your processes)")


@functools.cache
def _probe_bwrap() -> str:
    """Empty when a trivial sandbox runs, else bwrap's complaint."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-probe-") as workdir:
        argv = _bwrap_argv(workdir, [*_interpreter_argv(), "-c", "pass"])
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as e:
            return str(e)
    return "" if done.returncode == 0 else (done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}")


async def run_python(code: str, cfg: SandboxConfig | None = None) -> str:
    """Run `code`; return its stdout and stderr (cut at the output cap), or "error: ...".

    Raises SandboxUnavailable when the configured isolation cannot run here (a setup problem,
    not the model's)."""
    cfg = cfg or SandboxConfig()
    check_sandbox(cfg)
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as workdir:
        limits = [str(cfg.cpu_s), str(cfg.memory_mb * 2**20), str(cfg.max_file_mb * 2**20), str(cfg.max_processes)]
        command = [*_interpreter_argv(), "-c", _BOOTSTRAP, *limits]
        if cfg.isolation == "bwrap":
            argv, cwd = _bwrap_argv(workdir, command), None
        else:
            argv, cwd = command, workdir
        # The code comes from a file and the output goes to a pipe of our own: asyncio's pipes
        # would make wait() wait for every writer of the output, and we stop reading at the cap.
        with tempfile.TemporaryFile() as code_file:
            code_file.write(code.encode())
            code_file.seek(0)
            read_end, write_end = os.pipe()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=code_file, stdout=write_end, stderr=write_end, cwd=cwd, start_new_session=True,
                    env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir},
                )
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


def _bwrap_argv(workdir: str, command: list[str]) -> list[str]:
    """bwrap's command line for one run in `workdir`."""
    argv = [_bwrap() or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", _INSIDE_DIR, "--setenv", "TMPDIR", _INSIDE_DIR,
            "--ro-bind", "/usr", "/usr", "--dev", "/dev", "--proc", "/proc"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        # bwrap copies the modes of the host's parent directories (/root is 0700): make them traversable
        for parent in reversed(Path(prefix).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--bind", workdir, _INSIDE_DIR, "--chdir", _INSIDE_DIR]
    if os.geteuid() == 0:
        uid = _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uids) % 1000
        os.chown(workdir, uid, uid)
        drop = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}",
                "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return [*argv, "--", *drop, *command]
    return [*argv, "--unshare-user", "--", *command]

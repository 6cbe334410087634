"""python: runs model-written code in a separate, limited Python process.

Limits, applied inside the child before the code runs:
  - CPU time (RLIMIT_CPU), address space (RLIMIT_AS), size of written files (RLIMIT_FSIZE);
  - wall time, enforced by the parent, which kills the child's process group;
  - no network, no subprocesses, no writes outside a fresh temporary directory: an
    audit hook (PEP 578; code cannot remove it) refuses socket, process and ctypes
    events and any open-for-writing, removal or rename outside that directory;
  - isolated interpreter (-I: no user site, no PYTHON* variables), empty environment;
  - output truncated.
Every failure comes back as text starting with "error:"; the tool itself never raises.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from dataclasses import dataclass

# Runs in the child. Limits first, then the audit hook, then the user's code from stdin.
_BOOTSTRAP = r"""
import os, resource, sys
cpu_s, mem_bytes, file_bytes = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
code = sys.stdin.read()
root = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def inside(path):
    try:
        path = os.fsdecode(path) if not isinstance(path, int) else None
    except Exception:
        return False
    return path is None or os.path.realpath(path).startswith(root + os.sep) or os.path.realpath(path) == root

def guard(event, args):
    if event.startswith(("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                         "os.system", "os.kill", "pty.", "ctypes.", "os.startfile")) or event == "os.forkpty":
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode and any(c in mode for c in "wax+")) or (flags & WRITE_FLAGS)
        if writes and not inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")
    elif event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"):
        for p in args:
            if isinstance(p, (str, bytes, os.PathLike)) and not inside(p):
                raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

sys.addaudithook(guard)
del guard
exec(compile(code, "<tool>", "exec"), {"__name__": "__main__"})
"""


@dataclass
class SandboxLimits:
    cpu_s: int = 5
    wall_s: float = 10.0
    memory_mb: int = 512
    max_file_mb: int = 16
    max_output_chars: int = 2000


async def run_python(code: str, limits: SandboxLimits | None = None) -> str:
    """Run `code`; return its stdout and stderr (truncated), or "error: ..."."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryDirectory(prefix="asyncrl-sandbox-") as workdir:
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-c", _BOOTSTRAP,
                str(limits.cpu_s), str(limits.memory_mb * 2**20), str(limits.max_file_mb * 2**20),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                cwd=workdir, env={"PATH": "/usr/bin:/bin", "HOME": workdir}, start_new_session=True,
            )
        except OSError as e:
            return f"error: could not start the sandbox: {e}"
        try:
            output, _ = await asyncio.wait_for(proc.communicate(code.encode()), timeout=limits.wall_s)
        except asyncio.TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return f"error: wall-time limit of {limits.wall_s:g}s exceeded"
        except asyncio.CancelledError:  # the caller gave up: leave no process behind
            _kill_group(proc.pid)
            await proc.wait()
            raise
    text = output.decode(errors="replace")
    if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
        text = f"error: CPU-time limit of {limits.cpu_s}s exceeded\n" + text
    elif proc.returncode != 0:
        last = text.strip().splitlines()[-1] if text.strip() else f"exit status {proc.returncode}"
        text = f"error: {last}\n" + text
    return _truncate(text, limits.max_output_chars)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [output truncated: {len(text) - limit} more characters]"

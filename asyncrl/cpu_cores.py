"""Binding a process to CPU cores, for CPU runs that give generation and training their own
cores (what fully asynchronous peers do with GPUs: a rollout pool and a training pool).

A core list is "0", "0-3" or "0,2-3"; "" means unbound. Linux only (sched_setaffinity).
"""

from __future__ import annotations

import os
import re

_CORE_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def parse_cores(spec: str) -> set[int]:
    """The cores a core list names; ValueError for anything else."""
    if not _CORE_LIST.fullmatch(spec):
        raise ValueError('not a core list such as "0", "0-3" or "0,2-3"')
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        lo, hi = int(first), int(last or first)
        if hi < lo:
            raise ValueError(f"the range {part} runs backwards")
        cores.update(range(lo, hi + 1))
    return cores


def bind_this_process(spec: str) -> set[int] | None:
    """Bind every thread of this process (and so the children it starts later) to `spec`'s
    cores; "" leaves it unbound. Returns the cores bound to, or None."""
    if not spec:
        return None
    cores = parse_cores(spec)
    # sched_setaffinity(0, ...) binds only the calling thread: bind each of them (Ray's too) by id.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    return cores

"""Core lists and binding a process to them (real sched_setaffinity, in a child process)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from asyncrl.cpu_cores import parse_cores


@pytest.mark.parametrize("spec, cores", [("0", {0}), ("1-3", {1, 2, 3}), ("0,2-3", {0, 2, 3}), ("5,5", {5})])
def test_core_lists_parse(spec, cores):
    assert parse_cores(spec) == cores


@pytest.mark.parametrize("spec", ["", "a", "1-", "-1", "0;1", " 0", "3-1"])
def test_bad_core_lists_are_refused(spec):
    with pytest.raises(ValueError):
        parse_cores(spec)


BIND_AND_REPORT = """
import os, subprocess, sys, threading
from asyncrl.cpu_cores import bind_this_process

stop = threading.Event()
earlier = threading.Thread(target=stop.wait)  # a thread that exists before the binding
earlier.start()
bound = bind_this_process("{spec}")
threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout
print(sorted(bound) if bound is not None else None, threads, child.strip(), sep="|")
stop.set()
"""


def bind_in_a_child(spec: str) -> tuple:
    out = subprocess.run([sys.executable, "-c", BIND_AND_REPORT.format(spec=spec)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(ast.literal_eval(x) for x in out.stdout.strip().split("|"))


def test_binding_covers_every_thread_and_later_children():
    bound, threads, child = bind_in_a_child("0")
    assert bound == [0]
    assert len(threads) >= 2 and all(t == [0] for t in threads)
    assert child == [0]


def test_an_empty_core_list_leaves_the_process_unbound():
    bound, threads, child = bind_in_a_child("")
    everything = sorted(os.sched_getaffinity(0))
    assert bound is None and all(t == everything for t in threads) and child == everything

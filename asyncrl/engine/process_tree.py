"""What an engine's processes hold: the engine actor's process and its children (vLLM's
EngineCore and workers), for the start report (`EngineStartInfo`)."""

from __future__ import annotations

import os

import psutil


def process_tree() -> list[psutil.Process]:
    """This process and its children (vLLM's EngineCore and workers)."""
    proc = psutil.Process(os.getpid())
    return [proc, *proc.children(recursive=True)]


def tree_rss_gib(tree: list[psutil.Process]) -> float:
    """Their resident memory, in GiB (a process gone meanwhile counts nothing)."""
    total = 0
    for p in tree:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**30


def vllm_processes(tree: list[psutil.Process]) -> list[str]:
    """vLLM's processes under this actor, by title (VLLM::EngineCore, VLLM::Worker...)."""
    names = []
    for p in tree[1:]:
        try:
            names.append(p.name())  # the title vLLM set (also as comm, so no need to parse cmdline)
        except psutil.NoSuchProcess:
            pass
    return sorted(n for n in names if n.startswith("VLLM::"))


def tree_cores(tree: list[psutil.Process]) -> list[int]:
    """The cores these processes may run on (all their threads)."""
    cores: set[int] = set()
    for p in tree:
        try:
            for t in p.threads():
                cores.update(os.sched_getaffinity(t.id))
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return sorted(cores)

"""Count the processes a command starts and the CPU each kind spends, by polling /proc once a second.

    python scripts/process_census.py OUT.json &   # scripts/cpu_time.sh runs it beside its command
    ...; kill -TERM $!                            # writes OUT.json: {kind: {"starts", "cpu_s"}}

Ray's and vLLM's processes are not children of the command (Ray's raylet starts its workers), so
the census reads every process on the machine; run it on an otherwise idle one. A kind is a
process's title (Ray names a worker `ray::<Actor>.<method>`, vLLM its engine core
`VLLM::EngineCore`), or its program for the rest. A process's CPU is its user + system time when
last seen (a process living under a second may be missed; it costs little by definition).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

TICKS = os.sysconf("SC_CLK_TCK")


def kind(cmdline: list[str]) -> str:
    title = cmdline[0] if cmdline else ""
    if title.startswith(("VLLM::", "ray::")):  # titles set by vLLM and Ray
        return title.split(".")[0].split(" ")[0]
    if title.startswith("[pytest-xdist"):  # its workers title themselves by the test they run
        return "pytest-xdist worker"
    joined = " ".join(cmdline)
    for mark, name in (("raylet", "raylet"), ("gcs_server", "gcs_server"), ("-m pytest", "pytest"),
                       ("asyncrl.cli", "asyncrl cli"), ("asyncrl ", "asyncrl cli"), ("ray/", "ray (other)")):
        if mark in joined:
            return name
    program = os.path.basename(title)
    return "python " + os.path.basename(cmdline[1]) if program.startswith("python") and len(cmdline) > 1 else program


def read_processes() -> dict[tuple[int, int], tuple[list[str], float]]:
    """(pid, start tick) -> (command line, user + system CPU seconds so far) of every
    process but kernel threads (a pid may be reused within a run; its start tick tells them apart)."""
    out = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:  # gone between the listing and the read
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after the name, which may hold spaces
        if cmdline:
            out[(int(entry.name), int(fields[19]))] = (cmdline, (int(fields[11]) + int(fields[12])) / TICKS)
    return out


def snapshot() -> dict[tuple[int, int], tuple[str, float]]:
    return {key: (kind(cmdline), cpu) for key, (cmdline, cpu) in read_processes().items()}


def main(out: str) -> None:
    before = set(snapshot())  # processes already running are not the command's
    with open(out, "w") as f:  # ready: the caller waits for this before it starts the command
        f.write("{}")
    processes: dict[tuple[int, int], tuple[str, float]] = {}
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        for key, (name, cpu) in snapshot().items():
            if key in before:
                continue
            old = processes.get(key)
            # a Ray worker is `ray::IDLE` until an actor takes it: keep the actor's name
            processes[key] = (old[0] if old and name == "ray::IDLE" else name, cpu)
        time.sleep(1.0)
    census: dict[str, dict[str, float]] = {}
    for name, cpu in processes.values():
        row = census.setdefault(name, {"starts": 0, "cpu_s": 0.0})
        row["starts"] += 1
        row["cpu_s"] = round(row["cpu_s"] + cpu, 1)
    with open(out, "w") as f:
        json.dump(dict(sorted(census.items(), key=lambda kv: -kv[1]["cpu_s"])), f)


if __name__ == "__main__":
    main(sys.argv[1])

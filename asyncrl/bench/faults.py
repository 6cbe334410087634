"""`asyncrl bench faults`: one real training run that loses an engine's vLLM process, a rollout
worker and a trainer rank (SIGKILL, from outside, as the kernel's OOM killer would), then is
killed whole (the driver and every process it started) and resumed with
`run.resume_from=latest`.

    asyncrl bench faults recipe=arith bench.fault_steps=[3,5,8,11] trainer.total_steps=16

The run is `asyncrl train` in a subprocess with 2 engines, 2 rollout workers and a checkpoint
every `bench.checkpoint_every` steps (unless the overrides say otherwise). The bench watches its
metrics.jsonl: once step `fault_steps[0]` is logged it kills one engine's vLLM engine core, at
`fault_steps[1]` a rollout worker, at `fault_steps[2]` a trainer rank, at each step of
`bench.service_fault_steps` replica 0 of that served model (a judge's engine: its vLLM core; a
reward model: its process; found by the pid the run logs when it starts the replica), and at
`fault_steps[3]` the whole run (the trainer step must come after a checkpoint, the whole-run kill
too: a trainer restart goes back to the newest checkpoint). A rollout worker's, served model's
or trainer's fault is recovered from before the next fault is injected; an engine's replacement
starts while the run goes on, and
the whole-run kill waits for it. The processes are found by an environment tag that every process
of the run inherits. Then the bench resumes the run in the same directory and lets it finish.

Every figure is read from what the run wrote: faults.jsonl (each recovery, with its phases and
seconds), summary.json (the ledger's counts at the end, "lost" being the running prompts that are
neither queued nor in a worker; prompts trained twice, from the ordered list of trained prompts;
accuracies) and metrics.jsonl (staleness per step; generated tokens, to measure the work lost
to the whole-run kill: what the killed run generated after its last checkpoint, generated again
after the resume). Last line: one JSON object.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from asyncrl.bench.config import BenchConfig
from asyncrl.config import Config
from asyncrl.monitoring.run_log import read_metrics
from asyncrl.reward.services import SPECS, served

TAG_ENV = "ASYNCRL_FAULTS_BENCH"
# The processes each fault kills, by what their command line shows.
VICTIMS = {"engine": "VLLM::EngineCore", "rollout_worker": "ray::RolloutWorker", "trainer": "ray::TrainerRank"}
KINDS = ("engine", "rollout_worker", "trainer", "run")


def tagged(tag: str, variable: str = TAG_ENV, roots: tuple[int, ...] = ()) -> list[psutil.Process]:
    """The live processes whose environment carries `variable`=tag (every process a run starts
    inherits its environment), the processes `roots` (pids: the run's own process), and all their
    descendants: /proc may show a process's environment empty (setproctitle can overwrite it, as
    on vLLM's engine core and Ray's agents; and a make test run once read no tag at all), while
    the process tree always holds."""
    found: dict[int, psutil.Process] = {}
    for pid in roots:
        with contextlib.suppress(psutil.Error):
            found[pid] = psutil.Process(pid)
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get(variable) == tag:
                found[p.pid] = p
    stack = list(found.values())
    while stack:  # one child at a time: a process that ends meanwhile must not hide its siblings' subtrees
        with contextlib.suppress(psutil.Error):
            for child in stack.pop().children():
                if child.pid not in found:
                    found[child.pid] = child
                    stack.append(child)
    live = []
    for p in found.values():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
    return live


def kill_all(tag: str, variable: str = TAG_ENV, roots: tuple[int, ...] = ()) -> None:
    for p in tagged(tag, variable, roots):
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 60
    while tagged(tag, variable) and time.monotonic() < deadline:
        time.sleep(0.5)


def kill_one(tag: str, kind: str, wait_s: float = 30.0, variable: str = TAG_ENV, roots: tuple[int, ...] = ()) -> None:
    """SIGKILL one process of this kind among those tagged `variable`=tag; on a busy machine one
    may be unreadable for a moment (or, after an earlier fault, still starting), so look again
    for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        for p in tagged(tag, variable, roots):
            with contextlib.suppress(psutil.Error):
                if VICTIMS[kind] in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGKILL)
                    return
        if time.monotonic() > deadline:
            seen = []
            for p in tagged(tag, variable, roots):
                with contextlib.suppress(psutil.Error):
                    seen.append(" ".join(p.cmdline())[:60])
            raise RuntimeError(f"no {VICTIMS[kind]} process of the run to kill among {seen}")
        time.sleep(0.5)


def logged_pid(logs: Path, actor: str) -> int:
    """The process of the served model's replica `actor` (e.g. "judge-0"), as the run last logged it
    (asyncrl.actors.start_services)."""
    found = re.findall(rf"{re.escape(actor)}: started in .*, pid (\d+)", logs.read_text())
    if not found:
        raise RuntimeError(f"the run logged no start of {actor} in {logs}")
    return int(found[-1])


def kill_engine_core(pid: int) -> None:
    """SIGKILL the vLLM engine core under the engine actor `pid` (the actor itself if it has none)."""
    parent = psutil.Process(pid)
    cores = [c for c in parent.children(recursive=True) if VICTIMS["engine"] in " ".join(c.cmdline())]
    for p in cores or [parent]:
        p.send_signal(signal.SIGKILL)


def _last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_metrics(run_dir) if "train/loss" in r] if (run_dir / "metrics.jsonl").exists() \
        else []
    return max(steps, default=0)


def _check_running(proc: subprocess.Popen, when: str, logs: Path) -> None:
    if proc.poll() is not None:
        raise RuntimeError(f"the run ended (status {proc.returncode}) {when}; see {logs} "
                           "(too few trainer.total_steps for the faults and their recoveries?)")


def _events(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The run's recoveries of this kind so far (faults.jsonl)."""
    path = run_dir / "faults.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if e["kind"] == kind]


def _train_command(overrides: list[str], run_dir: Path, bench: BenchConfig, *extra: str) -> list[str]:
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    defaults = {"engine.num_engines": "2", "rollout.num_workers": "2", "engine.num_cpus_per_engine": "0.5",
                "trainer.checkpoint_every": str(bench.checkpoint_every), "logging.progress_bar": "false"}
    return [sys.executable, "-m", "asyncrl.cli", "train", *overrides,
            *[f"{k}={v}" for k, v in defaults.items() if k not in given], f"run.output_dir={run_dir}", *extra]


def run_faults_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    run_dir = root / "run"
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("run.output_dir=")]
    tag = f"faults-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, TAG_ENV: tag}
    running = {s.name for s in served(cfg)}
    for name in bench.service_fault_steps:
        if name not in running:
            raise ValueError(f"bench.service_fault_steps.{name}: the run serves no {name} "
                             f"({SPECS[name].section}.{SPECS[name].path_key} is empty)")
    # the served models' replicas in step order with the others
    plan = dict(sorted({**dict(zip(KINDS, bench.fault_steps)), **bench.service_fault_steps}.items(),
                       key=lambda kv: kv[1]))
    injected: dict[str, dict[str, Any]] = {}
    logs = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    try:
        with open(logs, "w") as log:
            proc = subprocess.Popen(_train_command(overrides, run_dir, bench), stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
            for kind, step in plan.items():
                while _last_step(run_dir) < step:
                    _check_running(proc, f"before step {step}", logs)
                    time.sleep(0.5)
                if kind == "run":  # the faults before it recovered (an engine starts while the run goes on)
                    for earlier, seen in injected.items():
                        while len(_events(run_dir, earlier)) == seen["recoveries_before"]:
                            _check_running(proc, f"before the {earlier} fault was recovered from", logs)
                            time.sleep(0.5)
                    injected[kind] = {"step": _last_step(run_dir)}
                    kill_all(tag, roots=(proc.pid,))  # the driver and every process under it, at once
                    break
                seen = len(_events(run_dir, kind))
                if kind in running:
                    victim = f"{SPECS[kind].actor}-0"
                    kill_engine_core(logged_pid(logs, victim))
                else:
                    victim = VICTIMS[kind]
                    kill_one(tag, kind, roots=(proc.pid,))
                injected[kind] = {"step": _last_step(run_dir), "recoveries_before": seen}
                print(f"bench faults: killed the {kind} ({victim}) after step {injected[kind]['step']}", flush=True)
                while kind != "engine" and len(_events(run_dir, kind)) == seen:  # the driver waits for these
                    _check_running(proc, f"after the {kind} fault", logs)
                    time.sleep(0.5)
            killed_at = time.monotonic()
            status = proc.wait()
            before_kill = read_metrics(run_dir)
        if "run" not in injected:
            raise RuntimeError(f"the run ended (status {status}) before the whole-run kill; see {logs}")
        print(f"bench faults: killed the whole run after step {injected['run']['step']}; resuming", flush=True)
        with open(logs, "a") as log:
            resumed = subprocess.run(_train_command(overrides, run_dir, bench, "run.resume_from=latest"),
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if resumed.returncode != 0:
            raise RuntimeError(f"the resumed run failed (status {resumed.returncode}); see {logs}")
        resume_s = time.monotonic() - killed_at
    finally:
        kill_all(tag)
    return _figures(cfg, run_dir, injected, before_kill, resume_s)


def _figures(cfg: Config, run_dir: Path, injected: dict[str, dict[str, Any]], before_kill: list[dict[str, Any]],
             resume_s: float) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = [json.loads(x) for x in (run_dir / "faults.jsonl").read_text().splitlines()]
    recovered = {e["kind"] for e in events}
    steps = [r for r in read_metrics(run_dir) if "train/staleness_max" in r]
    eta = cfg.algorithm.max_staleness
    # The killed run's generated tokens after its last checkpoint (the resumed run generates them again).
    resumed_from = next(e["step"] for e in events if e["kind"] == "run")
    totals = [r for r in before_kill if "rollout/generated_tokens" in r]
    at_kill = totals[-1]["rollout/generated_tokens"] if totals else 0
    at_ckpt = max((r["rollout/generated_tokens"] for r in totals if r["step"] == resumed_from), default=at_kill)
    return {
        "bench": "faults", "recipe": cfg.recipe.name,
        "faults_injected": len(injected), "faults_survived": len(recovered & set(injected)),
        "prompts_lost": summary["prompts"]["lost"],
        "prompts_trained_twice": summary["prompts_trained_twice"],
        "staleness_violations": sum(r["train/staleness_max"] > eta for r in steps),
        "recovery_s": {e["kind"]: round(e["recovery_s"], 1) for e in events},
        "resumed_run_s": round(resume_s, 1),  # from the kill to the resumed run's end
        "base_accuracy": summary["base_accuracy"], "final_accuracy": summary["final_accuracy"],
        "tokens_regenerated_after_resume": max(0, at_kill - at_ckpt),
        "loops_resumed": {e["kind"]: e["loops_resumed"] for e in events if e["loops_resumed"]},
        "prompts_restarted": {e["kind"]: e["prompts_restarted"] for e in events},
        # a dead worker's unfinished groups: the tokens its replacement continued with (its last
        # mirror) and those it generated again (its last report's, less those kept)
        "tokens_kept": {e["kind"]: e.get("tokens_kept", 0) for e in events if e["kind"] == "rollout_worker"},
        "tokens_lost": {e["kind"]: e["tokens_lost"] for e in events if e["kind"] == "rollout_worker"},
        "duplicates_dropped": summary["duplicates_dropped"],
        "steps": summary["steps"], "injected_after_step": {k: v["step"] for k, v in injected.items()},
        "run": str(run_dir),
    }

"""`asyncrl bench elastic`: one training run whose engines are grown and shrunk while it runs,
through the user's own command (`asyncrl scale RUN_DIR --engines N`).

    asyncrl bench elastic recipe=sim_math7b_128gpu engine.num_engines=8 "bench.engine_schedule=[[3,16],[7,4]]"
    asyncrl bench elastic recipe=arith engine.num_engines=1 engine.num_cpus_per_engine=0.5   # real: 1 -> 2 -> 1

The run is `asyncrl train` in a subprocess. The bench watches its metrics.jsonl: once step s
of `bench.engine_schedule` ([[s, engines], ...]; default: one engine more after step 2, back
after step 4; on a local cluster a schedule it cannot place is refused) is logged it runs `asyncrl scale`, and waits
until RUN_DIR/scale.jsonl records the change before the next one; `bench.steps_after_scale`
steps after the last change it runs `asyncrl stop` (trainer.total_steps only bounds the run:
an engine's start takes as long as it takes). Every figure is read from
what the run wrote: scale.jsonl (each change and its phase times), summary.json (the ledger's
counts: prompts lost, trained twice) and metrics.jsonl (staleness per step; step time by the
number of live engines). Last line: one JSON object.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.actors import resources_needed
from asyncrl.bench.config import BenchConfig
from asyncrl.bench.faults import kill_all
from asyncrl.config import Config, ConfigError
from asyncrl.monitoring.run_log import read_metrics

TAG_ENV = "ASYNCRL_ELASTIC_BENCH"


def _last_step(run_dir: Path) -> int:
    """The newest step logged (every trainer logs its staleness; the simulated one no loss)."""
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    return max((r["step"] for r in read_metrics(run_dir) if "train/staleness_max" in r), default=0)


def _scale_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "scale.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _wait(proc: subprocess.Popen, logs: Path, done: Any, what: str) -> None:
    while not done():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (status {proc.returncode}) {what}; see {logs} "
                               "(too few trainer.total_steps for bench.engine_schedule?)")
        time.sleep(0.5)


def _control(command: str, run_dir: Path, *args: str) -> None:
    """`asyncrl scale|stop RUN_DIR ...`, as a user types it."""
    done = subprocess.run([sys.executable, "-m", "asyncrl.cli", command, str(run_dir), *args], capture_output=True,
                          text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"asyncrl {command} {' '.join(args)} failed: {done.stderr[-2000:]}")


def engine_schedule(cfg: Config, bench: BenchConfig) -> list[list[int]]:
    """`bench.engine_schedule`, or by default one engine more after step 2 and back after step 4.
    On a local cluster a schedule it cannot place is refused (ConfigError, one line): the run
    would go on with the engines that fit and wait for the rest."""
    n = cfg.engine.num_engines
    schedule = bench.engine_schedule or [[2, n + 1], [4, n]]
    if cfg.cluster.address or os.environ.get("RAY_ADDRESS"):
        return schedule  # a cluster's room is its own (an autoscaler may add nodes)
    cpus = cfg.cluster.num_cpus or os.cpu_count() or 1
    most = max(n for _, n in schedule)
    if resources_needed(cfg, most)["CPU"] > cpus + 1e-9:
        fits = max((k for k in range(1, most) if resources_needed(cfg, k)["CPU"] <= cpus + 1e-9), default=0)
        raise ConfigError([f"bench.engine_schedule={schedule}: {most} engines (at "
                           f"engine.num_cpus_per_engine={cfg.engine.num_cpus_per_engine:g}, with the trainer and the "
                           f"rollout workers) need {resources_needed(cfg, most)['CPU']:g} CPUs; this local cluster "
                           f"has {cpus:g} (cluster.num_cpus): at most {fits} engine(s) fit, or lower "
                           "engine.num_cpus_per_engine"])
    return schedule


def run_elastic_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    schedule = engine_schedule(cfg, bench)
    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    run_dir = root / "run"
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("run.output_dir=")]
    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    defaults = {"trainer.total_steps": "1000", "logging.progress_bar": "false"}
    command = [sys.executable, "-m", "asyncrl.cli", "train", *overrides,
               *[f"{k}={v}" for k, v in defaults.items() if k not in given], f"run.output_dir={run_dir}"]
    tag = f"elastic-{time.monotonic_ns()}"
    logs = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    try:
        with open(logs, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, TAG_ENV: tag})
            for step, engines in schedule:
                _wait(proc, logs, lambda s=step: _last_step(run_dir) >= s, f"before step {step}")
                seen = len(_scale_events(run_dir))
                _control("scale", run_dir, "--engines", str(engines))
                print(f"bench elastic: asked for {engines} engine(s) after step {_last_step(run_dir)}", flush=True)
                _wait(proc, logs, lambda n=seen: len(_scale_events(run_dir)) > n, f"before scaling to {engines}")
            last = _last_step(run_dir) + bench.steps_after_scale
            _wait(proc, logs, lambda: _last_step(run_dir) >= last, f"before step {last}")
            _control("stop", run_dir)
            status = proc.wait()
        if status != 0:
            raise RuntimeError(f"the run failed (status {status}); see {logs}")
    finally:
        kill_all(tag, TAG_ENV)
    return figures(cfg, run_dir)


def figures(cfg: Config, run_dir: Path) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    events = _scale_events(run_dir)
    steps = [r for r in read_metrics(run_dir) if "train/staleness_max" in r]
    by_engines: dict[int, list[float]] = {}
    # the two steps after a change are left out (engines starting, or joining the routing at a sync)
    changing = {e["step"] + k for e in events for k in (1, 2)}
    for r in steps:
        if r["step"] not in changing:
            by_engines.setdefault(int(r["engines/live"]), []).append(r["throughput/step_s"])
    scale_s: dict[str, list[float]] = {}
    for e in events:
        scale_s.setdefault(e["direction"], []).append(round(e["scale_s"], 2))
    return {
        "bench": "elastic", "recipe": cfg.recipe.name, "scale_events": len(events),
        "engines": [events[0]["engines_before"], *(e["engines_after"] for e in events)] if events else [],
        "prompts_lost": summary["prompts"]["lost"], "prompts_trained_twice": summary["prompts_trained_twice"],
        "staleness_violations": sum(r["train/staleness_max"] > cfg.algorithm.max_staleness for r in steps),
        "step_s_by_engines": {n: round(statistics.median(v), 3) for n, v in sorted(by_engines.items())},
        "scale_s": scale_s,
        "phases_s": [{k: round(v, 2) for k, v in e["phases_s"].items()} for e in events],
        "steps": summary["steps"], "run": str(run_dir),
    }

"""How `asyncrl train` ends when it does not end well, how it runs under `ray job submit`,
and that it checkpoints there.

Ctrl-C and a fault the run cannot survive must both leave no Ray or vLLM process behind; a
run submitted with `ray job submit` to a two-node cluster on loopback places its actors by the
nodes' resources, trains and checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from asyncrl.bench import faults
from tests.conftest import ASYNCRL, REPO
from tests.test_env_server import free_port
from tests.test_train_e2e import TINY, check_run

pytestmark = [pytest.mark.slow, pytest.mark.alone]
TAG = "ASYNCRL_TEST_CLUSTER"  # the variable that marks a test's processes

def cluster_tag() -> str:
    """A value for ASYNCRL_TEST_CLUSTER: every process a run starts inherits it, so the test finds
    exactly its own processes (other tests' runs may be going on beside it)."""
    return f"lifecycle-{os.getpid()}-{time.monotonic_ns()}"


def tagged(tag: str) -> list[psutil.Process]:
    """The live processes whose environment carries ASYNCRL_TEST_CLUSTER=tag."""
    return faults.tagged(tag, TAG)


def kill_tagged(tag: str, grace_s: float = 10) -> None:
    """Stop every process of the tagged cluster (TERM, then KILL)."""
    procs = tagged(tag)
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive + tagged(tag):
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def wait_for_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 300,
                  until: Callable[[dict], bool] = lambda record: "train/loss" in record) -> None:
    """Wait for a step's metrics record for which `until` holds (default: any train step's)."""
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and any(until(json.loads(line)) for line in metrics.read_text().splitlines() if line):
            return
        time.sleep(1)
    raise AssertionError("no such step within the timeout")


def communicate(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The run's stdout and stderr once it ended; if it does not end within `timeout`, fail with
    where its driver waits (asyncrl.cli prints every thread's stack on SIGUSR1)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        main = err[err.find("Current thread"):][:4000] if "Current thread" in err else err[-3000:]
        others = err[err.find("Thread 0x"):][:4000] if "Thread 0x" in err else ""
        pytest.fail(f"the run did not end within {timeout:g}s; its driver's main thread:\n{main}\n"
                    f"its other threads:\n{others}\nstdout's end:\n{out[-1500:]}")


def leftovers(tag: str, wait_s: float = 30) -> dict[int, str]:
    """The run's processes (Ray's, vLLM's, the driver's) still alive `wait_s` after it ended."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {}
        for p in tagged(tag):
            with contextlib.suppress(psutil.NoSuchProcess):
                left[p.pid] = " ".join(p.cmdline())[:120]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def start_training(tmp_path: Path, tag: str) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.total_steps=200", "eval.every_steps=0", f"run.output_dir={run_dir}"]
    # Ctrl-C's default action, even where the suite itself was started in the background (a shell
    # starts background jobs with SIGINT ignored, and the ignoring is inherited across exec)
    proc = subprocess.Popen([*ASYNCRL, "train", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, TAG: tag},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, run_dir


def test_ctrl_c_stops_every_process(tmp_path):
    """Engines waiting for a place that never comes included: the run is first asked for more
    engines than this machine holds (`asyncrl scale`); Ctrl-C cancels them, not waits for them."""
    tag = cluster_tag()
    proc, run_dir = start_training(tmp_path, tag)
    try:
        wait_for_step(run_dir, proc)
        scale = subprocess.run([*ASYNCRL, "scale", str(run_dir), "--engines", "6"], capture_output=True, text=True,
                               timeout=120)
        assert scale.returncode == 0, scale.stderr[-2000:]
        wait_for_step(run_dir, proc, until=lambda r: r.get("engines/count") == 6)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole process group
        out, err = communicate(proc, 120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in out
    assert leftovers(tag) == {}


def test_a_trainer_rank_that_dies_without_a_checkpoint_ends_the_run_in_one_line_and_no_leftovers(tmp_path):
    """With a checkpoint the trainer would restart from it (`asyncrl bench faults`, test_bench);
    without one the run cannot go on, and says so."""
    tag = cluster_tag()
    proc, run_dir = start_training(tmp_path, tag)
    try:
        wait_for_step(run_dir, proc)
        faults.kill_one(tag, "trainer", variable=TAG)  # the injected error: trainer rank 0 dies mid-run
        out, err = communicate(proc, 180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "asyncrl train: failed: TrainingError: trainer rank 0 died: " in err
    assert "no checkpoint to restart from (set trainer.checkpoint_every)" in err
    assert leftovers(tag) == {}


def test_a_run_under_ray_job_submit_on_two_nodes_trains_and_checkpoints(tmp_path):
    """Submitted to a two-node Ray cluster on loopback (`ray start --head`, then a second raylet
    joining it), a run places its engine on the node offering `engine_node` and its trainer on the
    one offering `trainer_node`, trains PPO with a critic with weight syncs across them, and
    checkpoints at step 2 (trainer state with the critic's, queue contents, loop snapshots, ledger,
    the driver's state)."""
    # The test stops exactly this cluster's processes by their tag (`ray stop` would stop every Ray
    # cluster on the machine, the test session's own included).
    tag = cluster_tag()
    env = {**os.environ, "RAY_AUTH_MODE": "token", TAG: tag}
    ray_bin = str(Path(sys.executable).parent / "ray")
    # Ports of its own: the defaults are taken by the session's cluster or other tests' clusters.
    dashboard = free_port()
    ports = [f"--{name}-port={free_port()}" for name in ("dashboard-agent-listen", "dashboard-agent-grpc",
                                                          "runtime-env-agent", "metrics-export")]
    gcs = free_port()
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                    "--num-cpus=1", "--resources", json.dumps({"trainer_node": 1}), "--dashboard-host=127.0.0.1",
                    f"--dashboard-port={dashboard}", "--disable-usage-stats", *ports],
                   check=True, capture_output=True, env=env, timeout=120)
    first = tmp_path / "job_run"
    try:
        ports = [f"--{name}-port={free_port()}" for name in ("dashboard-agent-listen", "dashboard-agent-grpc",
                                                              "runtime-env-agent", "metrics-export")]
        subprocess.run([ray_bin, "start", f"--address=127.0.0.1:{gcs}", "--node-ip-address=127.0.0.1",
                        "--num-cpus=1", "--resources", json.dumps({"engine_node": 1}), "--disable-usage-stats",
                        *ports], check=True, capture_output=True, env=env, timeout=120)
        cmd = [ray_bin, "job", "submit", f"--address=http://127.0.0.1:{dashboard}", f"--working-dir={REPO}",
               "--runtime-env-json", json.dumps({"excludes": [".venv", "runs", ".git", "outputs"]}), "--",
               sys.executable, "-m", "asyncrl.cli", "train", *TINY, "trainer.checkpoint_every=2",
               "algorithm.advantage=gae",  # PPO with a critic: its metrics and its checkpoint entries
               "eval.max_concurrent=1",  # its evaluation at step 2 still runs at step 3's sync point
               "cluster.address=auto", f"run.output_dir={first}",
               "+engine.resources.engine_node=1", "+trainer.resources.trainer_node=1"]
        deadline = time.monotonic() + 300
        while True:  # the head's job agent registers a while after `ray start` returns (minutes on a busy machine)
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if "No available agent to submit job" not in out.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "succeeded" in out.stdout and "-> final accuracy" in out.stdout
        check_run(first, eta=1, deferred=True)
        nodes = json.loads(subprocess.run([ray_bin, "list", "nodes", "--format", "json", "--detail",
                                           f"--address=http://127.0.0.1:{dashboard}"], capture_output=True,
                                          text=True, env=env, timeout=60, check=True).stdout)
        offering = {r: n["node_id"] for n in nodes for r in ("engine_node", "trainer_node")
                    if r in n["resources_total"]}
        placement = json.loads((first / "summary.json").read_text())["placement"]
        assert placement["engine-0"] == offering["engine_node"] != offering["trainer_node"]
        assert placement["trainer-rank-0"] == offering["trainer_node"]
    finally:
        kill_tagged(tag)

    ckpt = first / "checkpoints" / "step_000002"  # complete: what `run.resume_from` continues
    for part in ("trainer_state.json", "queue.json", "loops.json", "ledger.json", "run_state.json",
                 "critic/.metadata"):
        assert (ckpt / part).is_file(), part
    steps = [r for r in map(json.loads, (first / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert all(r["critic/value_loss"] >= 0 and r["critic/explained_variance"] <= 1 for r in steps)
    # A run continuing from its newest checkpoint (`run.resume_from=latest`) after it was killed
    # whole: tests/test_bench.py's faults bench.

"""How `asyncrl train` ends when it does not end well, how it runs under `ray job submit`,
and how a run resumes from a checkpoint.

Ctrl-C and an actor that dies mid-run must both leave no Ray or vLLM process behind; a
run submitted with `ray job submit` to a `ray start --head` cluster on loopback trains and
checkpoints, and a new run continues from its checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ASYNCRL, REPO, run_cli
from tests.test_env_server import free_port
from tests.test_train_e2e import TINY, check_run

pytestmark = pytest.mark.slow

MARKERS = ("ray::", "raylet", "gcs_server", "EngineCore", "dashboard", "log_monitor", "runtime_env_agent")


def stack_processes() -> dict[int, str]:
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(m in cmd for m in MARKERS):
            out[p.info["pid"]] = cmd[:120]
    return out


def kill_tagged(tag: str, grace_s: float = 10) -> None:
    """Stop every process whose environment carries ASYNCRL_TEST_CLUSTER=tag (TERM, then KILL)."""
    def tagged() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.environ().get("ASYNCRL_TEST_CLUSTER") == tag:
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    procs = tagged()
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive + tagged():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def wait_for_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists() and any('"train/loss"' in line for line in metrics.read_text().splitlines()):
            return
        time.sleep(1)
    raise AssertionError("no train step within the timeout")


def leftovers(before: dict[int, str], wait_s: float = 30) -> dict[int, str]:
    deadline = time.monotonic() + wait_s
    while True:
        new = {pid: cmd for pid, cmd in stack_processes().items() if pid not in before}
        if not new or time.monotonic() > deadline:
            return new
        time.sleep(1)


def start_training(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.total_steps=200", "eval.every_steps=0", f"run.output_dir={run_dir}"]
    proc = subprocess.Popen([*ASYNCRL, "train", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, run_dir


def test_ctrl_c_stops_every_process(tmp_path):
    before = stack_processes()
    proc, run_dir = start_training(tmp_path)
    try:
        wait_for_step(run_dir, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole process group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in out
    assert leftovers(before) == {}


def test_an_actor_that_dies_ends_the_run_with_its_error_and_no_leftovers(tmp_path):
    before = stack_processes()
    proc, run_dir = start_training(tmp_path)
    try:
        wait_for_step(run_dir, proc)
        victims = [p for p in psutil.process_iter(["pid", "cmdline"])
                   if "ray::TrainerRank" in " ".join(p.info["cmdline"] or [])]
        assert victims, stack_processes()
        victims[0].kill()  # the injected error: trainer rank 0 dies mid-run
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, out[-2000:] + err[-3000:]
    assert "asyncrl train: failed" in err and "TrainerRank" in err
    assert leftovers(before) == {}


def test_a_run_under_ray_job_submit_checkpoints_and_a_new_run_resumes_from_it(tmp_path):
    """Submitted to a `ray start --head` cluster on loopback, a run checkpoints at step 2
    (trainer state, queue contents, ledger); a new run continues from it to step 4 and every
    prompt is still accounted for."""
    # Every process of this cluster inherits the tag, so that the test stops exactly those (`ray
    # stop` would stop every Ray cluster on the machine, the test session's own included).
    tag = f"lifecycle-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "ASYNCRL_TEST_CLUSTER": tag}
    ray_bin = str(Path(sys.executable).parent / "ray")
    port = 6391
    # Ports of its own: the defaults of the node's agents are taken by the session's cluster.
    ports = [f"--{name}-port={free_port()}" for name in ("dashboard-agent-listen", "dashboard-agent-grpc",
                                                          "runtime-env-agent", "metrics-export")]
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                    "--dashboard-host=127.0.0.1", "--dashboard-port=8266", "--disable-usage-stats", *ports],
                   check=True, capture_output=True, env=env, timeout=120)
    first = tmp_path / "job_run"
    try:
        cmd = [ray_bin, "job", "submit", "--address=http://127.0.0.1:8266", f"--working-dir={REPO}",
               "--runtime-env-json", json.dumps({"excludes": [".venv", "runs", ".git", "outputs"]}), "--",
               sys.executable, "-m", "asyncrl.cli", "train", *TINY, "trainer.checkpoint_every=2",
               "cluster.address=auto", f"run.output_dir={first}"]
        deadline = time.monotonic() + 120
        while True:  # the head's job agent registers a while after `ray start` returns
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
            if "No available agent to submit job" not in out.stderr or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "succeeded" in out.stdout and "-> final accuracy" in out.stdout
        check_run(first, eta=1)
    finally:
        kill_tagged(tag)

    ckpt = first / "checkpoints" / "step_000002"
    assert (ckpt / "trainer_state.pt").is_file() and (ckpt / "queue.json").is_file()
    second = tmp_path / "second"
    out = run_cli("train", *TINY, "trainer.total_steps=4", f"run.resume_from={ckpt}", f"run.output_dir={second}",
                  cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    summary = json.loads((second / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["policy_version"] == 4
    p = summary["prompts"]
    assert p["admitted"] == p["running"] + p["trained"] + p["filtered"] + p["failed"]
    assert p["trained"] + p["filtered"] == 4 * 4  # 2 steps before the checkpoint, 2 after
    steps = [json.loads(x)["step"] for x in (second / "metrics.jsonl").read_text().splitlines()]
    assert 3 in steps and 4 in steps and 1 not in steps

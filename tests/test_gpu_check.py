"""scripts/gpu_check.py, what of it runs without a GPU: its verdicts on hand-made results, its
refusal to pass on a machine without CUDA, and its export and broadcast checks run on CPU (gloo)
through the same code the GPU run takes, so that the check is ready whenever a GPU machine is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steps_agree_within_the_tolerance_and_not_beyond(check):
    cpu = {"loss": 0.5, "grad_norm": 20.0}
    close = check.compare_steps(cpu, {"loss": 0.505, "grad_norm": 20.8})  # 1 % and 4 %
    assert close["ok"] and close["loss_rel_diff"] == pytest.approx(0.01) and close["grad_norm_rel_diff"] == \
        pytest.approx(0.04)
    assert not check.compare_steps(cpu, {"loss": 0.53, "grad_norm": 20.0})["ok"]  # loss 6 % off
    assert not check.compare_steps(cpu, {"loss": 0.5, "grad_norm": 22.0})["ok"]  # gradient norm 10 % off
    assert not check.compare_steps(cpu, {"loss": float("nan"), "grad_norm": 20.0})["ok"]
    assert not check.compare_steps(cpu, {"grad_norm": 20.0})["ok"]
    # per token: bf16 rounding (mean 0.03) passes; a token off by 1 nat, or one side without them, fails
    lp = {"loss": 0.5, "grad_norm": 20.0, "logprobs": [-1.0, -2.0, -3.0, -4.0]}
    near = check.compare_steps(lp, {**lp, "logprobs": [-1.03, -1.98, -3.02, -4.04]})
    assert near["ok"] and near["logprob_abs_diff"]["mean"] == pytest.approx(0.0275)
    assert not check.compare_steps(lp, {**lp, "logprobs": [-1.0, -2.0, -3.0, -5.0]})["ok"]
    assert not check.compare_steps(lp, {"loss": 0.5, "grad_norm": 20.0})["ok"]


def test_a_part_that_did_not_run_fails_the_check(check):
    held = {"ok": True}
    assert check.verdict({"step": held, "export": held, "broadcast": held})
    assert not check.verdict({"step": held, "export": held})  # never a skip
    assert not check.verdict({"step": held, "export": held, "broadcast": {"ok": False, "error": "x"}})
    assert not check.verdict({"step": held, "export": held, "broadcast": held, "broadcast_two_gpus": {"ok": False}})


def test_without_cuda_the_check_fails_with_one_json_line():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1 and report["ok"] is False and "no CUDA device" in report["error"]


@pytest.mark.slow
def test_the_step_export_and_broadcast_checks_run_on_cpu():
    done = subprocess.run([sys.executable, str(SCRIPT), "--step", "cpu", "--checks"], capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["dtype"] == "float32" and out["loss"] > 0 and out["grad_norm"] > 0
    assert out["export"]["ok"] and out["export"]["max_abs_diff"] == 0.0 and out["export"]["tensors"] > 0
    assert out["broadcast"]["ok"] and out["broadcast"]["backend"] == "gloo" and not out["broadcast"]["mismatched"]

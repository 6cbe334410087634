"""scripts/gpu_run.sh (the whole run on one GPU), what of it runs here: the scripts parse (and
pass shellcheck where it is installed), each part's JSON line and verdict from hand-made run
output, and the configs it would run composed and validated (`--dry-run`: `--cfg job`, nothing
starts)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPTS = [REPO / "scripts" / "gpu_run.sh", REPO / "scripts" / "gpu_wheels.sh"]


@pytest.fixture(scope="module")
def gr():
    spec = importlib.util.spec_from_file_location("gpu_run", REPO / "scripts" / "gpu_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_scripts_parse():
    for script in SCRIPTS:
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck"):
        done = subprocess.run(["shellcheck", *map(str, SCRIPTS)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout


def write_run(run_dir, summary: dict | None, kl: list[float | None]):
    run_dir.mkdir(parents=True, exist_ok=True)
    records = [{"step": 0, "eval/policy_version": 0, "eval/greedy_accuracy": 0.066}]
    for step, value in enumerate(kl, start=1):
        kl_record = {} if value is None else {"train/mismatch_kl_mean": value}
        records.append({"step": step, "train/loss": 0.1, **kl_record})
    records.append({"step": len(kl), "eval/policy_version": len(kl), "eval/greedy_accuracy": 0.8})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{cut off")
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))


SUMMARY = {"base_accuracy": 0.066, "final_accuracy": 0.8, "prompts": {"lost": 0}, "prompts_trained_twice": 0,
           "steps": 3, "samples": 384, "wall_s": 100.0, "train_s": 20.0}


def test_the_train_line(gr, tmp_path):
    write_run(tmp_path / "a", SUMMARY, [1e-4, 3e-4, 2e-4])
    line = gr.train_line(tmp_path / "a", 0.60)
    assert line["ok"] and line["gain_points"] == 73.4 and line["prompts_lost"] == 0
    assert line["mismatch_kl_per_step"] == [1e-4, 3e-4, 2e-4] and line["mismatch_kl_mean"] == pytest.approx(2e-4)
    assert line["eval_curve"] == [(0, 0.066), (3, 0.8)]
    # each invariant fails the part on its own
    for change, words in (({"final_accuracy": 0.5}, "less than 60 points"),
                          ({"prompts": {"lost": 2}}, "2 prompts lost"),
                          ({"prompts_trained_twice": 1}, "trained twice")):
        write_run(tmp_path / "b", {**SUMMARY, **change}, [1e-4])
        line = gr.train_line(tmp_path / "b", 0.60)
        assert not line["ok"] and any(words in f for f in line["failed"]), line
    write_run(tmp_path / "c", SUMMARY, [None, None])
    assert "no mismatch KL logged" in gr.train_line(tmp_path / "c", 0.60)["failed"]
    write_run(tmp_path / "d", None, [1e-4, 1e-4])  # died before its summary
    line = gr.train_line(tmp_path / "d", 0.60)
    assert not line["ok"] and "did not finish (2 steps logged)" in line["error"]


def test_the_rollout_line(gr, tmp_path):
    log = tmp_path / "rollout.log"
    bench = {"bench": "rollout", "raw_tok_s": 1000.0, "framework_tok_s": 985.0, "ratio": 0.985, "pause_resume_s": 0.1}
    log.write_text("round 0: raw vLLM 1000 tok/s\n" + json.dumps(bench) + "\n")
    line = gr.rollout_line(log, 0.97)
    assert line["ok"] and line["ratio"] == 0.985 and line["bench"] == bench
    assert not gr.rollout_line(log, 0.99)["ok"]
    log.write_text("Traceback ...\n")
    assert gr.rollout_line(log, 0.97) == {"part": "rollout", "ok": False, "error": f"no benchmark line in {log}"}


def test_the_transport_is_found(gr):
    found = gr.transport()
    assert found["key"] == "trainer.weight_sync_transport"
    assert found["same_gpu"] == ("cuda_ipc" in found["shared"])


def test_the_dry_run_validates_each_config():
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", "scripts/gpu_run.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "train: config valid" in done.stdout and "rollout: config valid" in done.stdout
    assert "engine=vllm_gpu trainer=megatron_gpu cluster.device=cuda" in done.stdout
    assert "trainer.weight_sync_transport=shared_memory" in done.stdout
    # a key the config does not have is refused, and the dry run fails
    bad = subprocess.run(["bash", "scripts/gpu_run.sh", "--dry-run", "train"], cwd=REPO, capture_output=True,
                         text=True, timeout=240, env={**env, "GPU_RUN_WEIGHT_SYNC": "trainer.no_such_key=1"})
    assert bad.returncode == 1 and "config REFUSED" in bad.stdout


FAKE_ASYNCRL = r"""#!/usr/bin/env bash
# stands in for `python -m asyncrl.cli train|bench rollout`; anything else goes to the real Python
if [ "$1" = -m ] && [ "$2" = asyncrl.cli ]; then
  echo "args: $*"
  for a in "$@"; do case "$a" in run.output_dir=*) dir=${a#run.output_dir=} ;; esac; done
  if [ "$3" = train ]; then
    mkdir -p "$dir"
    echo '{"step": 1, "train/loss": 0.1, "train/mismatch_kl_mean": 0.0002}' > "$dir/metrics.jsonl"
    echo "{\"base_accuracy\": 0.06, \"final_accuracy\": 0.8, \"prompts\": {\"lost\": $LOST}, \
\"prompts_trained_twice\": 0, \"steps\": 1}" > "$dir/summary.json"
  else
    echo '{"bench": "rollout", "raw_tok_s": 100.0, "framework_tok_s": 99.0, "ratio": 0.99}'
  fi
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


@pytest.mark.parametrize("lost", [0, 3])
def test_the_parts_run_in_turn_and_report(tmp_path, lost):
    fake = tmp_path / "python"
    fake.write_text(FAKE_ASYNCRL)
    fake.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable, "LOST": str(lost), "OUT": str(out),
           "GPU_RUN_DIR": str(tmp_path / "run"), "ASYNCRL_GPU_SITE": str(tmp_path / "no_site")}
    done = subprocess.run(["bash", "scripts/gpu_run.sh"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [line["part"] for line in lines] == ["train", "rollout"], done.stdout + done.stderr
    assert lines[0]["ok"] is (lost == 0) and lines[0]["prompts_lost"] == lost and lines[1]["ok"]
    assert done.returncode == (0 if lost == 0 else 1)
    args = (out / "train.log").read_text()
    assert "trainer.weight_sync_transport=shared_memory" in args and "cluster.num_gpus=2" in args
    assert (out / "rollout.log").is_file()

"""The benchmarks run end to end and end with their JSON line (figures are not asserted);
their own settings are checked by `asyncrl bench` alone."""

import json
import os

import pytest

from asyncrl.bench.config import BenchConfig, parse_bench_config, split_bench_overrides
from asyncrl.bench.raw_broadcast import raw_sizes
from asyncrl.config import ConfigError
from tests.conftest import run_cli
from tests.test_train_e2e import KEEP_MODE, TINY_SETTINGS, check_run


def test_bench_settings_are_split_from_the_training_overrides_and_checked():
    bench, rest = split_bench_overrides(["recipe=arith", "bench.rounds=5", "trainer.lr=1e-5", "bench.settle_s=0"])
    assert rest == ["recipe=arith", "trainer.lr=1e-5"]
    assert parse_bench_config(bench) == BenchConfig(rounds=5, settle_s=0.0)
    with pytest.raises(ConfigError) as err:
        parse_bench_config(["bench.rounds=0", "bench.roundz=3", "bench.train_s=abc"])
    problems = err.value.problems
    assert any(p.startswith("bench.roundz=3:") and "valid keys: bench.num_prompts" in p for p in problems)
    assert any(p.startswith("bench.train_s=abc:") for p in problems)
    with pytest.raises(ConfigError, match=r"bench.rounds=0: must be >= 1"):
        parse_bench_config(["bench.rounds=0"])


def test_raw_sizes_cut_the_bytes_into_buckets():
    assert raw_sizes(10, 4) == [4, 4, 2] and raw_sizes(8, 4) == [4, 4] and raw_sizes(3, 4) == [3]


def test_a_bad_bench_setting_exits_2_before_anything_starts(tmp_path):
    out = run_cli("bench", "rollout", "recipe=arith", "bench.rounds=0", cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and "bench.rounds=0: must be >= 1" in out.stderr


@pytest.mark.slow
@pytest.mark.alone
def test_rollout_bench_prints_its_figures_as_the_last_line(tmp_path, base_model):
    out = run_cli("bench", "rollout", "recipe=arith", "bench.num_prompts=4", "bench.n_samples=2",
                  "bench.max_new_tokens=16", "bench.rounds=1", "bench.warmup_rounds=0",
                  "bench.pause_requests=8", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "rollout" and result["requests_per_round"] == 8
    for key in ("raw_tok_s", "framework_tok_s", "ratio", "pause_resume_s"):
        assert result[key] > 0
    assert result["in_flight_at_pause"] == 8
    assert "Exception ignored" not in out.stderr


def test_unknown_benchmark_is_refused(tmp_path):
    out = run_cli("bench", "nope", cwd=tmp_path)
    assert out.returncode == 2 and "usage: asyncrl bench {rollout,weight-sync,sync-vs-async,faults}" in out.stderr


@pytest.mark.slow
@pytest.mark.alone
def test_weight_sync_bench_prints_its_figures_as_the_last_line(tmp_path, base_model):
    out = run_cli("bench", "weight-sync", "recipe=arith", "bench.rounds=2", "bench.warmup_rounds=1",
                  "bench.trainer_steps=1", "algorithm.prompts_per_step=4", "bench.max_new_tokens=8",
                  "bench.pause_requests=4", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "weight_sync" and result["bytes"] > 4_000_000
    for key in ("sync_s", "paused_s", "raw_broadcast_s", "raw_plan_broadcast_s", "ratio", "stage_s", "load_s",
                "trainer_tokens_s", "sync_in_flight_s", "paused_in_flight_s"):
        assert result[key] > 0
    # The warm-up sync captured the load; the timed ones replay it (then vLLM-CPU repacks).
    assert len(result["rounds_sync_s"]) == 2 and result["load_path"] == "replay+repack"


@pytest.mark.slow
@pytest.mark.alone
def test_sync_vs_async_bench_prints_its_figures_as_the_last_line(tmp_path, base_model):
    out = run_cli("bench", "sync-vs-async", "recipe=chain_sum_cot", "bench.train_s=8", "algorithm.prompts_per_step=4",
                  "algorithm.n_samples_per_prompt=4", "eval.num_problems=16", "eval.n_samples=2", "eval.pass_k=[1,2]",
                  "logging.wandb.enabled=false", "cluster.dashboard=false", f"run.output_dir={tmp_path / 'runs'}",
                  cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sync_vs_async" and result["train_s"] == 8
    for key in ("sync_samples_per_s", "async_samples_per_s", "speedup", "sync_tokens_per_s", "async_tokens_per_s",
                "tokens_speedup"):
        assert result[key] > 0
    for key in ("async_trainer_idle", "async_engine_idle", "sync_accuracy", "async_accuracy", "async_engine_util",
                "sync_engine_util"):
        assert 0 <= result[key] <= 1
    assert result["async_engine_util"] > 0 and result["sync_engine_util"] > 0
    assert result["sync_steps"] >= 1 and result["async_steps"] >= 1
    # Its two runs are the end-to-end runs of two modes (tests/test_train_e2e.py): synchronous
    # on-policy, and fully async with abort-and-resume, generation and training on cores of their own.
    check_run(tmp_path / "runs" / "sync", eta=0, steps=None, plots=False)
    check_run(tmp_path / "runs" / "async", eta=2, steps=None, plots=False)
    # the synchronous side unbound, the asynchronous one on the recipe's cores (every thread of
    # the engine's processes, and the trainer's, whose TrainerSetupInfo is logged at setup)
    assert result["async_cpu_cores"] == {"engine": "0", "rollout": "0", "trainer": "1"}
    log = out.stdout + out.stderr
    starts = [line for line in log.splitlines() if "engine-0: vLLM started" in line]
    every_core = f"on cores {sorted(os.sched_getaffinity(0))}"
    assert len(starts) == 2 and every_core in starts[0] and "on cores [0]," in starts[1], starts
    assert "cpu_cores=[1]" in log


@pytest.mark.slow
@pytest.mark.alone
def test_faults_bench_survives_each_fault_and_accounts_for_every_prompt(tmp_path, base_model):
    """One run loses its engine's vLLM core (its loops wait for the replacement: there is no other
    engine), its rollout worker and its trainer rank (SIGKILL), then is killed whole and resumed
    from its newest checkpoint. One of each actor keeps the suite's time (the bench's default is 2
    engines and 2 workers; tests/test_channel.py moves a worker's requests to a live engine). It
    is also the end-to-end run of the `keep` mode (tests/test_train_e2e.py): eta = 2, requests
    that outlive a weight sync, decoupled PPO."""
    out = run_cli("bench", "faults", "recipe=arith", *TINY_SETTINGS, *KEEP_MODE, "trainer.total_steps=16",
                  "engine.num_engines=1", "rollout.num_workers=1",
                  "eval.every_steps=0", "bench.fault_steps=[2,3,6,10]", "bench.checkpoint_every=4",
                  f"run.output_dir={tmp_path}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:] + (tmp_path / "train.log").read_text()[-6000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "faults" and result["faults_injected"] == result["faults_survived"] == 4
    assert result["prompts_lost"] == result["prompts_trained_twice"] == result["staleness_violations"] == 0
    assert set(result["recovery_s"]) == {"engine", "rollout_worker", "trainer", "run"}
    assert all(0 < s < 300 for s in result["recovery_s"].values())
    # the trainer's restart and the resume continue the checkpoint's loops from their snapshots
    assert result["loops_resumed"]["trainer"] > 0 and result["loops_resumed"]["run"] > 0
    assert result["prompts_restarted"]["run"] == 0
    summary = check_run(tmp_path / "run", eta=2, steps=16, plots=True, faults=True)
    assert [f["kind"] for f in summary["faults"]] == ["run"]  # the resumed process's own recovery
    events = [json.loads(x)["kind"] for x in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert sorted(events) == ["engine", "rollout_worker", "run", "trainer"]

"""The benchmarks run end to end and end with their JSON line (figures are not asserted);
their own settings are checked by `asyncrl bench` alone."""

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from asyncrl.bench.config import BenchConfig, parse_bench_config, split_bench_overrides
from asyncrl.bench.raw_broadcast import raw_sizes
from asyncrl.config import ConfigError
from asyncrl.monitoring.run_log import read_metrics
from tests.conftest import run_cli
from tests.test_train_e2e import KEEP_MODE, TINY_SETTINGS, WORKER_PROCESS, check_run


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


def test_time_to_a_target_accuracy_is_the_first_evaluation_that_reaches_it(tmp_path):
    from asyncrl.bench.sync_vs_async import accuracy_curve, time_to

    records = [{"step": 0, "eval/greedy_accuracy": 0.5},  # the base's, logged at set-up
               {"step": 1, "progress/train_s": 4.0},
               {"step": 2, "progress/train_s": 9.0, "eval/greedy_accuracy": 0.55},
               {"step": 4, "progress/train_s": 20.0, "eval/greedy_accuracy": 0.62},
               {"step": 5, "eval/greedy_accuracy": 0.61}]  # the final one
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curve = accuracy_curve(tmp_path, {"base_accuracy": 0.5, "final_accuracy": 0.61, "train_s": 24.5})
    assert curve == [(0.0, 0.5), (9.0, 0.55), (20.0, 0.62), (24.5, 0.61)]
    assert time_to(curve, 0.6) == 20.0 and time_to(curve, 0.5) == 0.0 and time_to(curve, 0.7) is None


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
    usage = ("usage: asyncrl bench {rollout,chat,weight-sync,sync-vs-async,faults,elastic,staleness,routing-replay,"
             "simulate,calibrate,trainer}")
    assert out.returncode == 2 and usage in out.stderr


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
    # Part two, the same syncs through shared memory (the engine is on the trainer's host).
    assert result["shared_transport"] == "shared_memory" and len(result["rounds_shared_sync_s"]) == 2
    for key in ("shared_sync_s", "shared_paused_s", "shared_vs_broadcast", "shared_sync_in_flight_s"):
        assert result[key] > 0
    assert result["shared_load_path"] == "replay+repack" and result["shared_in_place_bytes"] == result["in_place_bytes"]


@pytest.mark.slow
@pytest.mark.alone
def test_sync_vs_async_bench_prints_its_figures_as_the_last_line(tmp_path, base_model):
    out = run_cli("bench", "sync-vs-async", "recipe=chain_sum_cot", "bench.train_s=6", "bench.curve_every=2",
                  "bench.target_accuracy=0.01", "algorithm.prompts_per_step=4",
                  "algorithm.n_samples_per_prompt=4", "eval.num_problems=16", "eval.n_samples=2", "eval.pass_k=[1,2]",
                  "logging.wandb.enabled=false", "cluster.dashboard=false", f"run.output_dir={tmp_path / 'runs'}",
                  cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sync_vs_async" and result["train_s"] == 6
    for key in ("sync_samples_per_s", "async_samples_per_s", "speedup", "sync_tokens_per_s", "async_tokens_per_s",
                "tokens_speedup"):
        assert result[key] > 0
    for key in ("async_trainer_idle", "async_engine_idle", "sync_accuracy", "async_accuracy", "async_engine_util",
                "sync_engine_util"):
        assert 0 <= result[key] <= 1
    assert result["async_engine_util"] > 0 and result["sync_engine_util"] > 0
    assert result["sync_steps"] >= 1 and result["async_steps"] >= 1
    # accuracy against training seconds: the base at 0, an evaluation after every second step, the final one
    for mode in ("sync", "async"):
        (curve,) = result["curves"][mode]
        times = [t for t, _ in curve]
        assert curve[0] == [0.0, result["base_accuracy"]] and times == sorted(times)
        assert len(curve) == result[f"{mode}_steps"] // 2 + 2
        assert result[f"{mode}_time_to_target_s"] == [next(t for t, acc in curve if acc >= 0.01)]
    # Its two runs are the end-to-end runs of two modes (tests/test_train_e2e.py): synchronous
    # on-policy, and fully async with abort-and-resume, generation and training on cores of their own.
    check_run(tmp_path / "runs" / "sync", eta=0, steps=None, plots=False)
    check_run(tmp_path / "runs" / "async", eta=2, steps=None, plots=False)
    # the synchronous side unbound, the asynchronous one on the recipe's cores (every thread of
    # the engine's processes, and the trainer's, whose TrainerSetupInfo is logged at setup)
    assert result["async_cpu_cores"] == {"engine": "0", "rollout": "0", "trainer": "1"}
    log = out.stdout + out.stderr
    starts = [line for line in log.splitlines() if "engine-0: started" in line]
    every_core = f"on cores {sorted(os.sched_getaffinity(0))}"
    assert len(starts) == 2 and every_core in starts[0] and "on cores [0]," in starts[1], starts
    assert "cpu_cores=[1]" in log


@pytest.mark.slow
@pytest.mark.alone
def test_faults_bench_survives_each_fault_and_accounts_for_every_prompt(tmp_path, base_model, reward_model,
                                                                       process_reward_model):
    """One run loses its engine's vLLM core (its loops wait for the replacement: there is no other
    engine), its rollout worker, its reward model's replica, its judge's engine and its trainer rank
    (SIGKILL), then is killed whole and resumed from its newest checkpoint. It is the end-to-end run
    of the served models that score beside the env's reward (asyncrl/reward/services.py): a reward
    model, a process reward model and a judge (reward.model, reward.prm, reward.judge: their scores
    weighted in every training sample; the judge is the arith model continuing a number).
    One of each actor keeps the suite's time (the bench's default is 2 engines and 2 workers;
    tests/test_channel.py moves a worker's requests to a live engine). It is also the end-to-end
    run of the `keep` mode (tests/test_train_e2e.py): eta = 2, requests that outlive a weight sync,
    decoupled PPO."""
    out = run_cli("bench", "faults", "recipe=arith", *TINY_SETTINGS, *KEEP_MODE, "trainer.total_steps=12",
                  "engine.num_engines=1", "rollout.num_workers=1",
                  "eval.every_steps=0", "bench.fault_steps=[2,3,5,9]", "bench.checkpoint_every=4",
                  f"reward.model.path={reward_model}", "reward.model.weight=0.5",
                  f"reward.prm.path={process_reward_model}", "reward.prm.weight=0.05",
                  f"reward.judge.path={base_model}", "reward.judge.weight=0.1", "reward.judge.parser=number",
                  "reward.judge.min_score=-20", "reward.judge.max_score=20", "reward.judge.max_new_tokens=6",
                  # the judge continues with just a number (its own answer): few tokens a sample
                  "reward.judge.prompt_template='{response} {prompt}Answer: '",
                  "bench.service_fault_steps.reward_model=4", "bench.service_fault_steps.judge=6",
                  "reward.model.num_cpus_per_actor=0.125", "reward.prm.num_cpus_per_actor=0.125",
                  "reward.judge.num_cpus_per_engine=0.25", "trainer.num_cpus_per_rank=0.75",  # 2 CPUs in all
                  f"run.output_dir={tmp_path}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:] + (tmp_path / "train.log").read_text()[-6000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "faults" and result["faults_injected"] == result["faults_survived"] == 6
    assert result["prompts_lost"] == result["prompts_trained_twice"] == result["staleness_violations"] == 0
    assert set(result["recovery_s"]) == {"engine", "rollout_worker", "reward_model", "judge", "trainer", "run"}
    assert all(0 < s < 300 for s in result["recovery_s"].values())
    # the trainer's restart and the resume continue the checkpoint's loops from their snapshots
    assert result["loops_resumed"]["trainer"] > 0 and result["loops_resumed"]["run"] > 0
    assert result["prompts_restarted"]["run"] == 0
    # the dead worker's groups continued from its mirror (keep mode mirrors the finished samples of
    # unfinished groups at each sync; tests/test_rollout_worker_logic.py checks what a mirror holds)
    # (how many tokens depends on timing; here: the worker's event reports both figures)
    assert set(result["tokens_kept"]) == set(result["tokens_lost"]) == {"rollout_worker"}
    summary = check_run(tmp_path / "run", eta=2, steps=12, plots=True, faults=True)
    assert [f["kind"] for f in summary["faults"]] == ["run"]  # the resumed process's own recovery
    events = [json.loads(x)["kind"] for x in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()]
    assert sorted(events) == ["engine", "judge", "reward_model", "rollout_worker", "run", "trainer"]
    # every training sample was scored by the served models too, their scores weighted beside the env's
    for service in ("reward_model", "prm", "judge"):
        scored = [r for r in read_metrics(tmp_path / "run") if r.get(f"{service}/samples")]
        assert len(scored) >= 10 and all(r[f"{service}/latency_s"] > 0 for r in scored)
        assert max(r[f"{service}/samples"] for r in scored) >= 4 * 16  # (totals restart with the resumed process)


def test_the_staleness_grid_holds_each_staleness_exactly_and_shares_the_synchronous_run():
    from asyncrl.bench.staleness import Arm, arm_config, arms
    from asyncrl.run_config import load_config

    cfg = load_config(["recipe=arith"])
    bench = BenchConfig(staleness=[0, 2], losses=["grpo", "tis"], seeds=[1], pause_modes=["keep"])
    grid = arms(cfg, bench)
    assert [a.name for a in grid] == ["sync_s1", "controlled_grpo_k2_s1", "controlled_tis_k2_s1",
                                      "keep_grpo_k2_s1"]
    tis2 = arm_config(cfg, bench, grid[2], Path("/tmp/x"))
    a = tis2.algorithm
    assert (a.max_staleness, a.policy_lag, a.partial_rollout, a.loss.type) == (2, 2, False, "tis")
    assert tis2.trainer.total_steps == bench.steps and tis2.run.seed == tis2.engine.seed == 1
    assert tis2.eval.every_steps == bench.eval_every and tis2.trainer.checkpoint_every == 0
    keep = arm_config(cfg, bench, grid[3], Path("/tmp/x")).algorithm
    assert (keep.max_staleness, keep.policy_lag, keep.partial_rollout, keep.pause_mode) == (2, 0, True, "keep")
    sync = arm_config(cfg, bench, grid[0], Path("/tmp/x")).algorithm
    assert (sync.max_staleness, sync.policy_lag, sync.partial_rollout) == (0, 0, False)
    # several mini-batches a step: the losses differ on-policy too, so k = 0 runs per loss
    multi = replace(cfg, trainer=replace(cfg.trainer, mini_batches_per_step=2))
    assert [x.name for x in arms(multi, replace(bench, pause_modes=[]))] == [
        "controlled_grpo_k0_s1", "controlled_grpo_k2_s1", "controlled_tis_k0_s1", "controlled_tis_k2_s1"]
    assert Arm("keep", "grpo", 2, 1).row == "grpo, free, keep"


def test_staleness_figures_by_hand(tmp_path):
    from asyncrl.bench.staleness import area_under_curve, markdown_table, plot_curves, run_figures

    # trapezoids over versions 0..4: (2 * (0.1 + 0.5) / 2 + 2 * (0.5 + 0.5) / 2) / 4 = 0.4
    assert area_under_curve([(0, 0.1), (2, 0.5), (4, 0.5)]) == pytest.approx(0.4)
    assert area_under_curve([(0, 0.3)]) == 0.3
    records = [
        {"step": 0, "eval/greedy_accuracy": 0.1, "eval/policy_version": 0},
        {"step": 1, "train/loss": 0.1, "train/mismatch_kl_mean": 0.01, "train/clip_fraction_mean": 0.1,
         "train/is_weight_truncated_mean": 0.0, "train/staleness_mean": 1.0,
         "length/trained_hist": {"0": 2, "8": 2}, "length/finished_hist": {"0": 2, "8": 2, "16": 4}},
        {"step": 2, "train/loss": 0.2, "train/mismatch_kl_mean": 0.03, "train/clip_fraction_mean": 0.3,
         "train/is_weight_truncated_mean": 0.5, "train/staleness_mean": 2.0,
         "length/trained_hist": {"8": 4}, "length/finished_hist": {"8": 4}},
        {"step": 2, "eval/greedy_accuracy": 0.5, "eval/policy_version": 2},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    f = run_figures(tmp_path)
    assert f["curve"] == [(0, 0.1), (2, 0.5)] and f["auc"] == pytest.approx(0.3)
    assert f["mismatch_kl"] == pytest.approx(0.02) and f["clip_fraction"] == pytest.approx(0.2)
    assert f["truncated_fraction"] == pytest.approx(0.25) and f["staleness_mean"] == pytest.approx(1.5)
    # bins stand for their middles: trained (2 x 4 + 6 x 12) / 8 = 10, finished (2 x 4 + 6 x 12 + 4 x 20) / 12
    assert f["trained_length"] == pytest.approx(10.0) and f["finished_length"] == pytest.approx(160 / 12)
    runs = [{"mode": "controlled", "loss": "grpo", "staleness": k, "seed": 1, "shared": k == 0, **f,
             "final_accuracy": acc} for k, acc in ((0, 0.5), (2, 0.4))]
    runs.append({**runs[1], "loss": "tis", "final_accuracy": 0.3})
    # the grid's first run alone (the synchronous one) already makes a table and a plot
    assert "| synchronous | 50.0 (30.0) |" in markdown_table(runs[:1], BenchConfig(steps=2))
    assert plot_curves(runs[:1], tmp_path / "a.png").stat().st_size > 5_000
    table = markdown_table(runs, BenchConfig(steps=2))
    # the synchronous run is every loss's k = 0
    assert "| grpo | 50.0 (30.0) | 40.0 (30.0) |" in table and "| tis | 50.0 (30.0) | 30.0 (30.0) |" in table


def test_routing_replay_table_by_hand():
    from asyncrl.bench.routing_replay import markdown_table

    run = {"auc": 0.5, "mismatch_kl": 1e-3, "clip_fraction": 0.01}
    runs = [{**run, "routing_replay": "none", "staleness": 2, "seed": s, "final_accuracy": a, "router_agreement": g}
            for s, a, g in ((1, 0.6, 0.98), (2, 0.8, 0.96))]
    runs.append({**run, "routing_replay": "r3", "staleness": 2, "seed": 1, "final_accuracy": 0.9,
                 "router_agreement": None})
    table = markdown_table(runs, BenchConfig(steps=4))
    # none: the means over its two seeds; r3 without an agreement figure leaves its cell empty
    assert "| none | 2 | 70.0% | 50.0% | 0.9700 | 1.00e-03 | 0.0100 |" in table
    assert "| r3 | 2 | 90.0% | 50.0% |  | 1.00e-03 | 0.0100 |" in table
    assert "3 runs, 2 seed(s), 4 steps each." in table


@pytest.mark.slow
@pytest.mark.alone
def test_staleness_bench_holds_the_staleness_it_is_given(tmp_path, base_model):
    """One controlled run (the engines 2 versions behind the trainer, admission at eta - lag = 0, no
    partial rollout): from step 3 on every trained token is exactly 2 versions old. It is also the
    end-to-end run of the engine's model in a vLLM worker process of its own."""
    # Uniform groups are trained too (zero advantage): a step whose groups all had one reward would
    # otherwise train no token, and its staleness would read 0.
    out = run_cli("bench", "staleness", "recipe=arith", *TINY_SETTINGS, *WORKER_PROCESS, "bench.staleness=[2]",
                  "bench.losses=[grpo]", "bench.seeds=[1]", "bench.steps=3", "bench.eval_every=2",
                  "algorithm.loss.filter_uniform_groups=false", f"run.output_dir={tmp_path}", cwd=tmp_path,
                  timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "staleness" and result["steps"] == 3 and result["samples_per_run"] == 3 * 4 * 4
    assert 0 <= result["final_accuracy"]["grpo"]["2"] <= 1
    run_dir = tmp_path / "controlled_grpo_k2_s1"
    check_run(run_dir, eta=2, plots=False)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["sync/engine_version"] for r in steps] == [0, 0, 1]  # the trainer's version - 2, at least 0
    assert [round(r["train/staleness_mean"], 6) for r in steps] == [0, 1, 2]
    assert steps[2]["train/staleness_share_2_mean"] == 1.0
    # evaluations measure the engines' policy; the final one the trainer's newest
    assert [r["eval/policy_version"] for r in records if "eval/greedy_accuracy" in r] == [0, 0, 3]
    runs = json.loads((tmp_path / "runs.json").read_text())
    assert [v for v, _ in runs[0]["curve"]] == [0, 3] and runs[0]["staleness_mean"] == pytest.approx(1.0)
    assert "| grpo | " in (tmp_path / "table.md").read_text()
    assert (tmp_path / "accuracy.png").stat().st_size > 5_000


def test_the_elastic_bench_fits_its_default_schedule_to_the_run_and_refuses_one_it_cannot_place(monkeypatch):
    from asyncrl.bench.config import BenchConfig
    from asyncrl.bench.elastic import engine_schedule
    from asyncrl.config import ConfigError
    from asyncrl.run_config import load_config

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # engines of half a CPU, a trainer rank of 0.5 and a rollout worker of 0.25 on 2 CPUs: 2 engines fit
    cfg = load_config(["recipe=arith", "cluster.num_cpus=2", "engine.num_engines=1", "engine.num_cpus_per_engine=0.5"])
    assert engine_schedule(cfg, BenchConfig()) == [[2, 2], [4, 1]]
    # the simulated scenario's schedule on the real stack: refused before anything starts, in one line
    with pytest.raises(ConfigError) as refused:
        engine_schedule(cfg, BenchConfig(engine_schedule=[[3, 16], [7, 4]]))
    (line,) = refused.value.problems
    assert line.startswith("bench.engine_schedule=[[3, 16], [7, 4]]: 16 engines") and "at most 2 engine(s) fit" in line


def test_the_trainer_benchs_flop_formula_by_hand():
    """Qwen3-0.6B's shape: its matmul parameters are the model card's 0.44B non-embedding ones
    (norms aside) plus the output layer; causal attention adds PaLM's 12 L H Q T halved (a token
    attends to half the row on average)."""
    from asyncrl.bench.config import SHAPES
    from asyncrl.bench.trainer import flops_per_token, rated_peak

    shape = SHAPES["qwen3_0.6b"]
    attention = 1024 * 128 * (16 * 2 + 8 * 2)  # q and o: 16 heads of 128; k and v: 8
    non_embedding = 28 * (attention + 3 * 1024 * 3072)  # and the MLP's gate, up and down
    assert non_embedding == 440_401_920  # "Number of Parameters (Non-Embedding): 0.44B"
    matmul = non_embedding + 1024 * 151_936  # the output layer: tied to the embedding, a matmul all the same
    assert flops_per_token(shape, 4096) == 6 * matmul + 6 * 28 * 16 * 128 * 4096 == 4_985_192_448
    # MFU against the datasheet's dense bf16 peak too (torch's names; the PCIe H100's before the SXM one's)
    names = ("NVIDIA H200", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB", "NVIDIA RTX 4090")
    assert [rated_peak(n)[0] for n in names] == [989, 989, 756, 312, None]

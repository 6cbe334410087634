"""Simulated backends: the latency and length models by hand, the simulated engine's request
lifecycle (batching, abort / keep, versions, interrupted == uninterrupted) in asyncio, the
simulated trainer's cost and staleness accounting, and the control-plane metrics."""

import asyncio
import copy
import json
import random
import statistics

import pytest

from asyncrl.clock import Clock
from asyncrl.config.schema import EngineConfig, SimEngineConfig
from asyncrl.control.step_metrics import control_plane_metrics
from asyncrl.engine.sim_engine import DecodeModel, LengthModel, SimEngine
from asyncrl.run_config import load_config
from asyncrl.trainer.batch import TrainSample
from asyncrl.trainer.settings import TrainerSettings
from asyncrl.trainer.sim_trainer import SimTrainerRank, staleness_metrics
from asyncrl.types import SamplingSpec

MODEL = "recipes/arith/base_model"


def test_decode_steps_cost_as_the_formula_says():
    m = DecodeModel(SimEngineConfig(decode_base_s=0.01, decode_per_seq_s=0.001, decode_per_kv_token_s=1e-6))
    # 3 steps of 2 requests from 100 context tokens: 3 x (0.01 + 2 x 0.001) + 1e-6 x (100 + 102 + 104)
    assert m.steps_s(3, 2, 100) == pytest.approx(0.036 + 306e-6)
    assert m.steps_s(0, 2, 100) == 0
    assert m.steps_within(m.steps_s(3, 2, 100), 10, 2, 100) == 3
    assert m.steps_within(m.steps_s(3, 2, 100) - 1e-9, 10, 2, 100) == 2
    assert m.steps_within(99.0, 10, 2, 100) == 10  # never more than the steps to the next event
    assert DecodeModel(SimEngineConfig(prefill_per_token_s=2e-4)).prefill_s(500) == pytest.approx(0.1)


def test_lengths_follow_the_configured_median_and_p99():
    rng = random.Random(0)
    draws = sorted(LengthModel(SimEngineConfig(length_median=1000, length_p99=8000)).draw(rng)
                   for _ in range(20000))
    assert statistics.median(draws) == pytest.approx(1000, rel=0.04)
    assert draws[int(0.99 * len(draws))] == pytest.approx(8000, rel=0.1)
    hist = LengthModel(SimEngineConfig(length_hist=[[10, 1], [50, 3]]))
    draws = [hist.draw(rng) for _ in range(4000)]
    assert set(draws) == {10, 50}
    assert draws.count(50) / len(draws) == pytest.approx(0.75, abs=0.03)


def _engine(scale: float = 200.0, max_new_tokens: int = 64, **sim) -> SimEngine:
    cfg = EngineConfig(backend="sim", max_num_seqs=4, sim=SimEngineConfig(**sim))
    return SimEngine(0, MODEL, MODEL, cfg, "cpu", stream_outputs=True, time_scale=scale,
                     max_new_tokens=max_new_tokens)


def _run(coro):
    return asyncio.run(coro)


def test_a_batch_decodes_in_the_model_s_time_and_stamps_its_version():
    async def go():
        engine = _engine(decode_base_s=1.0, length_median=64, length_p99=64)  # every response is cut at 64
        await engine.start()
        engine.version = 3
        t0 = engine.clock.now()
        results = await asyncio.gather(*(engine.generate([1, 2, 3], SamplingSpec(max_new_tokens=64), f"r{i}")
                                         for i in range(4)))
        return engine.clock.now() - t0, results, engine.activity()

    elapsed, results, activity = _run(go())
    # four requests in one batch: 64 steps of 1 simulated second, not 4 x 64 (the bound leaves 0.5 s real)
    assert 64 <= elapsed < 160
    for r in results:
        assert (len(r.token_ids), r.finish_reason, set(r.versions)) == (64, "length", {3})
        assert len(set(r.token_ids)) == 1 and len(r.logprobs) == 64
    assert activity.busy_s == pytest.approx(elapsed, abs=10)  # 50 ms real
    assert activity.request_s == pytest.approx(4 * elapsed, abs=40)


def test_requests_beyond_max_num_seqs_wait_for_room():
    async def go():
        engine = _engine(decode_base_s=1.0, length_median=10, length_p99=10)
        await engine.start()
        t0 = engine.clock.now()
        await asyncio.gather(*(engine.generate([1], SamplingSpec(max_new_tokens=64), f"r{i}") for i in range(8)))
        return engine.clock.now() - t0

    assert 20 <= _run(go()) < 60  # two batches of four, 10 steps each (not 80: one at a time)


def test_abort_returns_the_tokens_so_far_and_the_continuation_ends_where_an_uninterrupted_one_does():
    async def go():
        engine = _engine(scale=10.0, decode_base_s=1.0, length_median=20, length_p99=40)
        await engine.start()
        return await engine.generate([5, 6, 7], SamplingSpec(max_new_tokens=64), "a")

    whole = _run(go())
    assert whole.finish_reason == "stop" and 0 < len(whole.token_ids) < 64

    async def interrupted():  # a fresh engine draws the same response token first, so the same response
        e = _engine(scale=10.0, decode_base_s=1.0, length_median=20, length_p99=40)
        await e.start()
        request = asyncio.ensure_future(e.generate([5, 6, 7], SamplingSpec(max_new_tokens=64), "b"))
        await asyncio.sleep(e.clock.real(3.5))
        await e.pause("abort")
        first = await request
        await e.resume()
        rest = await e.generate([5, 6, 7, *first.token_ids],
                                SamplingSpec(max_new_tokens=64 - len(first.token_ids)), "c")
        return first, rest

    first, rest = _run(interrupted())
    assert first.finish_reason == "abort" and 1 <= len(first.token_ids) < len(whole.token_ids)
    assert first.token_ids + rest.token_ids == whole.token_ids
    assert rest.finish_reason == whole.finish_reason


def test_keep_freezes_requests_and_stamps_later_tokens_with_the_new_version():
    async def go():
        engine = _engine(scale=10.0, decode_base_s=1.0, length_median=12, length_p99=12)
        await engine.start()
        request = asyncio.ensure_future(engine.generate([1], SamplingSpec(max_new_tokens=64), "k"))
        await asyncio.sleep(engine.clock.real(4.5))
        report = await engine.update_weights(1, "keep")
        return await request, report

    result, report = _run(go())
    assert result.finish_reason == "stop" and len(result.token_ids) == 12
    assert result.versions[0] == 0 and result.versions[-1] == 1
    assert result.versions == sorted(result.versions)
    assert report.load_path == "sim" and report.checksums == {}


def test_pause_mode_is_checked():
    with pytest.raises(ValueError, match="pause mode"):
        _run(_engine().pause("later"))


def _sample(versions: list[int], mask: list[int]) -> TrainSample:
    return TrainSample(tokens=[1] * (2 + len(versions)), prompt_len=2, mu=[0.0] * len(versions), mask=mask,
                       versions=versions, advantage=0.0)


def test_staleness_metrics_count_trained_tokens_only():
    samples = [_sample([5, 5, 4], [1, 1, 1]), _sample([3, -1, 4], [1, 0, 1])]
    m = staleness_metrics(samples, policy_version=5, max_staleness=2)
    # ages of the trained tokens: 0, 0, 1, 2, 1
    assert m["train/staleness_mean"] == pytest.approx(4 / 5)
    assert m["train/staleness_max"] == 2
    assert [m[f"train/staleness_share_{s}_mean"] for s in range(3)] == pytest.approx([0.4, 0.4, 0.2])


def test_sim_trainer_cost_and_lagged_versions():
    cfg = load_config(["recipe=arith", "engine=sim", "trainer=sim", "trainer.data_parallel_size=4",
                       "trainer.sim.train_per_token_s=0.01", "trainer.sim.logprob_per_token_s=0.002",
                       "trainer.sim.optimizer_s=0.5", "algorithm.policy_lag=1", "algorithm.max_staleness=1"])
    rank = SimTrainerRank(TrainerSettings.of(cfg), 0, 1)
    assert rank.step_s(tokens=400, updates=2) == pytest.approx(400 * 0.01 / 4 + 2 * 0.5)
    lossy = load_config(["recipe=arith", "engine=sim", "trainer=sim", "algorithm.loss.type=decoupled_ppo",
                         "trainer.mini_batches_per_step=2", "trainer.sim.train_per_token_s=0.01",
                         "trainer.sim.logprob_per_token_s=0.002", "trainer.sim.optimizer_s=0"])
    lossy_rank = SimTrainerRank(TrainerSettings.of(lossy), 0, 1)
    assert lossy_rank.step_s(100, 2) == pytest.approx(100 * 0.012)  # + the proximal pass
    assert lossy_rank.step_s(100, 1) == pytest.approx(100 * 0.01)  # one update: its own pass gives pi_prox
    rank.setup("", 0, "")
    assert [rank.stage_weights(v).version for v in (1, 2, 3)] == [0, 1, 2]  # one version behind
    assert rank.stage_weights(4, newest=True).version == 4


def test_control_plane_metrics_take_the_busiest_process_of_each_role():
    before = {("driver",): 10.0, ("queue",): 1.0, ("worker", 0): 5.0, ("worker", 1): 2.0, ("engine", "e0"): 1.0}
    after = {("driver",): 10.5, ("queue",): 1.1, ("worker", 0): 5.2, ("worker", 1): 2.9, ("engine", "e0"): 1.3,
             ("engine", "e1"): 0.4}  # e1 is new since: left out
    m = control_plane_metrics(after, before, step_s=10.0)
    assert m == pytest.approx({"control/driver_cpu_s": 0.5, "control/queue_cpu_s": 0.1, "control/worker_cpu_s": 0.9,
                               "control/engine_cpu_s": 0.3, "control/busiest_share": 0.09})
    restarted = control_plane_metrics({("queue",): 0.2}, {("queue",): 1.1}, 1.0)  # a new queue process
    assert restarted == {}


def test_sim_backends_come_as_a_pair_and_only_they_scale_time():
    from asyncrl.config.validate import ConfigError

    with pytest.raises(ConfigError, match="engine.backend='sim': must be sim exactly when trainer.backend is"):
        load_config(["recipe=arith", "engine=sim"])
    with pytest.raises(ConfigError, match="cluster.time_scale=10.0: must be 1 unless"):
        load_config(["recipe=arith", "cluster.time_scale=10"])
    with pytest.raises(ConfigError, match="engine.sim.length_p99=5: must be >= engine.sim.length_median=50"):
        load_config(["recipe=arith", "engine=sim", "trainer=sim", "engine.sim.length_median=50",
                     "engine.sim.length_p99=5"])
    with pytest.raises(ConfigError, match="rollout.agent_loop='sim_agent': simulates tool-calling episodes on"):
        load_config(["recipe=arith", "rollout.agent_loop=sim_agent"])
    with pytest.raises(ConfigError, match="tools.sim.latency_p99_s=1.0: must be >= tools.sim.latency_median_s=2.0"):
        load_config(["recipe=arith", "engine=sim", "trainer=sim", "rollout.agent_loop=sim_agent",
                     "tools.sim.latency_median_s=2", "tools.sim.latency_p99_s=1"])


def test_clock_scales_time():
    clock = Clock(100.0)
    assert clock.real(50.0) == 0.5
    with pytest.raises(ValueError):
        Clock(0)


def test_a_token_block_stands_for_its_tokens_in_time_and_length():
    async def go():
        engine = _engine(decode_base_s=1.0, length_median=640, length_p99=640, token_block=64)
        await engine.start()
        t0 = engine.clock.now()
        result = await engine.generate([1, 2], SamplingSpec(max_new_tokens=64), "b")
        return engine.clock.now() - t0, result

    elapsed, result = _run(go())
    assert len(result.token_ids) == 10 and result.finish_reason == "stop"  # 640 tokens in blocks of 64
    assert 640 <= elapsed < 640 * 1.5  # a decode step per token, not per block



def test_a_multi_turn_context_costs_its_blocks_and_the_prefix_cache_spares_their_prefill():
    engine = _engine(token_block=4)
    r = engine.sim_tokens[0]
    context = [1, 2, 3, r, r, 0, 0, 0, r]  # a prompt, a turn of 2 blocks, a result of 3, a turn of 1
    assert engine._context_tokens(context) == (3 + 6 * 4, 3 + 6 * 4)  # no cache: everything prefills
    assert engine._context_tokens([1, 2, 3]) == (3, 3)
    cached = _engine(token_block=4, prefix_cache=True, prompt_tokens=100)
    assert cached._context_tokens(context) == (100 + 6 * 4, 0)  # a continuation: all of it cached
    assert cached._context_tokens(context[:-1]) == (100 + 5 * 4, 3 * 4)  # a next turn: the result prefills
    assert cached._context_tokens([1, 2, 3]) == (100, 100)


def _sim_loop(engine: SimEngine, interrupt: asyncio.Event | None = None, turn_done: asyncio.Event | None = None,
              **tools_sim):
    """A sim_agent loop on `engine`, called in-process as a worker's router calls it over its channel;
    `turn_done` is set when a turn's request returns."""
    from agent_loops import get_agent_loop
    from asyncrl.config.schema import SimToolsConfig, ToolsConfig

    class Inference:
        async def agenerate(self, *args):
            result = await engine.generate(*args)
            if turn_done is not None:
                turn_done.set()
            return result

    tools = ToolsConfig(max_calls=tools_sim.pop("max_calls", 8), sim=SimToolsConfig(**tools_sim))
    return get_agent_loop("sim_agent")(Inference(), None, SamplingSpec(max_new_tokens=engine.max_new_tokens), 1024,
                                       interrupt=interrupt, tools=tools, clock=engine.clock)


def _trajectory():
    from asyncrl.types import Trajectory

    return Trajectory("p", "g", [5, 6, 7])


FIXED_EPISODE = dict(calls_median=3, calls_p99=3, latency_median_s=2.0, latency_p99_s=2.0,
                     result_tokens_median=4, result_tokens_p99=4)


def test_a_sim_agent_episode_takes_its_turns_and_tool_calls_in_simulated_time():
    from asyncrl.types import TrajectoryStatus

    async def go(**tools_sim):
        engine = _engine(scale=20.0, decode_base_s=0.1, length_median=5, length_p99=5)
        await engine.start()
        t0 = engine.clock.now()
        outcome = await _sim_loop(engine, **tools_sim).run(_trajectory())
        return engine.clock.now() - t0, outcome.trajectory

    elapsed, t = _run(go(**FIXED_EPISODE))
    # 3 calls of 2 s between 4 turns of 5 decode steps of 0.1 s: 6 + 2 s, and the control plane's own time
    assert 8 <= elapsed < 12
    assert t.status is TrajectoryStatus.OK and t.info == {"turns": 4, "tool_calls": 3, "tool_s": 6.0,
                                                          "num_interruptions": 0}
    assert t.loss_mask == ([1] * 5 + [0] * 4) * 3 + [1] * 5
    assert t.versions == ([0] * 5 + [-1] * 4) * 3 + [0] * 5
    _, cut = _run(go(**FIXED_EPISODE, max_calls=2))  # at tools.max_calls the episode ends, truncated
    assert cut.status is TrajectoryStatus.TRUNCATED and (cut.info["turns"], cut.info["tool_calls"]) == (3, 2)


def test_a_sim_agent_episode_interrupted_anywhere_ends_as_an_uninterrupted_one():
    """Abort in a turn (the engine's pause) and the worker's interrupt during a tool call: resumed by a
    fresh loop from the snapshot, the episode is the uninterrupted one, token for token."""
    drawn = dict(calls_median=3, calls_p99=8, latency_median_s=3.0, latency_p99_s=9.0,
                 result_tokens_median=4, result_tokens_p99=12)

    def engine():  # turns of ~40 steps of 0.25 s: a pause 2.5 s into the first has 10 s of room
        return _engine(scale=50.0, max_new_tokens=1024, decode_base_s=0.25, length_median=40, length_p99=120)

    async def whole():
        e = engine()
        await e.start()
        return (await _sim_loop(e, **drawn).run(_trajectory())).trajectory

    async def aborted_in_a_turn():
        e = engine()
        await e.start()
        run = asyncio.ensure_future(_sim_loop(e, **drawn).run(_trajectory()))
        await e.clock.asleep(2.5)
        await e.pause("abort")
        await e.resume()  # before awaiting the loop: one that was in a tool call goes on
        snapshot = (await run).snapshot
        return copy.deepcopy(snapshot), (await _sim_loop(e, **drawn).resume(snapshot)).trajectory

    async def interrupted_in_a_call():
        e, interrupt, turn_done = engine(), asyncio.Event(), asyncio.Event()
        await e.start()
        run = asyncio.ensure_future(_sim_loop(e, interrupt, turn_done, **drawn).run(_trajectory()))
        await turn_done.wait()  # the loop went on to its first call without yielding: it is in it
        interrupt.set()
        snapshot = (await run).snapshot
        return copy.deepcopy(snapshot), (await _sim_loop(e, **drawn).resume(snapshot)).trajectory

    t = _run(whole())
    assert t.info["tool_calls"] >= 1 and t.info["turns"] == t.info["tool_calls"] + 1
    in_call, resumed_in_call = _run(interrupted_in_a_call())
    assert in_call.trajectory.loss_mask[-1] == 0 and in_call.loop_state["tool_calls"] == 1  # the call completed first
    for snapshot, resumed in (_run(aborted_in_a_turn()), (in_call, resumed_in_call)):
        assert snapshot.state == "generating" and snapshot.num_interruptions == 1
        assert snapshot.trajectory.num_response_tokens < t.num_response_tokens
        assert resumed.response_token_ids == t.response_token_ids and resumed.loss_mask == t.loss_mask
        assert {k: resumed.info[k] for k in ("turns", "tool_calls", "tool_s")} == \
            {k: t.info[k] for k in ("turns", "tool_calls", "tool_s")}

SMALL_SCENARIO = ["engine.num_engines=2", "engine.sim.replicas=1", "trainer.data_parallel_size=2",
                  "rollout.num_workers=1", "rollout.max_concurrent_loops=32", "algorithm.prompts_per_step=8",
                  "algorithm.n_samples_per_prompt=4", "bench.steps=3", "bench.warmup_steps=1",
                  "engine.sim.length_median=300", "engine.sim.length_p99=2000", "cluster.time_scale=20",
                  "eval.num_problems=1", "logging.wandb.enabled=false", "cluster.dashboard=false"]


@pytest.mark.slow
@pytest.mark.alone
def test_simulate_runs_a_scenario_through_the_real_control_plane(tmp_path, base_model):
    """`asyncrl simulate` on a small cut of the 128-GPU scenario, with a one-arm sweep: every run
    keeps the invariants of a real run (every prompt accounted for, the staleness bound, a sync a
    step), logs simulated seconds as the model says, and reports the control plane's own CPU time."""
    from tests.conftest import run_cli
    from tests.test_train_e2e import check_run

    out = run_cli("simulate", "sim_math7b_128gpu", *SMALL_SCENARIO, "bench.sweep_engine_devices=[1]",
                  f"run.output_dir={tmp_path}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "simulate" and result["devices"] == 4 and result["split"] == "2:2"
    assert result["prompts_lost"] == 0 and (tmp_path / "steps.png").stat().st_size > 10_000
    check_run(tmp_path / "sync", eta=0, steps=3, batch=8, plots=False, weights=False)
    check_run(tmp_path / "async", eta=2, steps=3, batch=8, plots=False, weights=False)
    steps = [r for r in map(json.loads, (tmp_path / "sync" / "metrics.jsonl").read_text().splitlines())
             if "throughput/step_s" in r]
    # The scenario's trainer on the 4 devices of the colocated run: 32 samples of 300 prompt
    # tokens and their responses' blocks of 64 tokens, at 0.88 + 0.29 ms a token (the proximal
    # pass), over 4 ranks, plus 16 optimizer updates of 0.3 s; a step waits for it. (Never less
    # than the model; more by the real time the step's own work took, 20-fold, on a busy machine.)
    for r in steps:
        model_s = (32 * 300 + r["train/tokens"] * 64) * (0.00088 + 0.00029) / 4 + 16 * 0.3
        assert model_s <= r["train/step_s"] < model_s * 2 + 20  # 1 s real
        assert r["throughput/step_s"] > r["train/step_s"]
    assert result["sync_step_s"] > 0 and result["async_step_s"] > 0
    assert result["speedup"] == pytest.approx(result["sync_step_s"] / result["async_step_s"])
    assert 0 <= result["trainer_idle"] <= 1 and 0 <= result["engine_idle"] <= 1
    assert 0 < result["staleness_mean"] <= 2
    assert set(result["control_cpu_s"]) == {"driver", "queue", "worker", "engine"}
    assert 0 < result["control_plane_s_per_step"] and result["control_plane_share"] < 0.1
    # the sweep's one arm: 1 engine device : 3 trainer ranks, its row beside the colocated run's
    assert [(r["engine_devices"], r["max_staleness"]) for r in result["sweep"]] == [(1, 2)]
    check_run(tmp_path / "sweep0", eta=2, steps=3, batch=8, plots=False, weights=False)
    assert "| 1 : 3 | 2 | yes |" in (tmp_path / "sweep.md").read_text() and (tmp_path / "sweep.png").is_file()



@pytest.mark.slow
@pytest.mark.alone
def test_an_agentic_scenario_trains_through_the_real_control_plane(tmp_path, base_model):
    """The 32B agentic scenario, cut small: sim_agent episodes (turns, tool calls, results) run on
    rollout workers against simulated engines, are interrupted at syncs and resumed, and the run
    keeps a real run's invariants."""
    from tests.conftest import run_cli
    from tests.test_train_e2e import check_run

    out = run_cli("train", "recipe=sim_agentic32b_64gpu", "engine.num_engines=2", "trainer.data_parallel_size=8",
                  "rollout.num_workers=2", "rollout.max_concurrent_loops=16", "algorithm.prompts_per_step=8",
                  "algorithm.n_samples_per_prompt=4", "trainer.total_steps=3", "cluster.time_scale=100",
                  "eval.num_problems=1", "logging.wandb.enabled=false", "cluster.dashboard=false",
                  f"run.output_dir={tmp_path}", cwd=tmp_path, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    check_run(tmp_path, eta=2, steps=3, batch=8, weights=False)
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "train/staleness_max" in r]
    # episodes made their calls (12 a median episode) and every call returned its result
    assert steps[-1]["rollout/tool_calls"] > 3 * 32 and steps[-1]["rollout/tool_call_validity"] == 1.0
    assert max(r["train/staleness_max"] for r in steps) >= 1  # episodes spanned syncs

def test_replicas_are_engines_of_their_own_in_one_actor():
    async def go():
        engine = _engine(scale=50.0, decode_base_s=1.0, length_median=10, length_p99=10, replicas=2)
        await engine.start()
        t0 = engine.clock.now()
        await asyncio.gather(*(engine.generate([1], SamplingSpec(max_new_tokens=64), f"r{i}") for i in range(8)))
        return engine.clock.now() - t0, engine.activity()

    elapsed, activity = _run(go())
    assert 10 <= elapsed < 18  # two batches of four at once, not one after the other (20)
    assert activity.busy_s == pytest.approx(elapsed, abs=2)  # both replicas busy all along (40 ms real)


def test_simulate_derives_the_colocated_baseline_and_splits_from_the_scenario_s_devices(base_model):
    from asyncrl.bench.simulate import colocated_sync, devices, split, step_figures

    cfg = load_config(["recipe=sim_math7b_128gpu"])
    assert devices(cfg) == (64, 64)  # 16 engine actors x 4 engines x TP 1 : 64 data-parallel ranks
    sync = colocated_sync(cfg)
    assert devices(sync) == (128, 128) and sync.engine.num_engines == 32
    assert sync.rollout.max_concurrent_loops == 1024  # 512 x 16 samples over 8 workers, all at once
    assert (sync.algorithm.max_staleness, sync.algorithm.partial_rollout) == (0, False)
    assert devices(split(cfg, 32)) == (32, 96)
    from asyncrl.bench.config import BenchConfig
    from asyncrl.bench.simulate import sweep_arms

    assert sweep_arms(cfg, BenchConfig()) == []
    arms = sweep_arms(cfg, BenchConfig(sweep_engine_devices=[32, 64], sweep_max_staleness=[1, 4]))
    assert [(devices(a)[0], a.algorithm.max_staleness) for a in arms] == [(32, 1), (32, 4), (64, 1), (64, 4)]
    with pytest.raises(ValueError, match="multiple of engine TP x engine.sim.replicas = 4"):
        split(cfg, 30)
    records = [{"step": 0}, *({"step": i, "throughput/step_s": s, "idle/trainer": 0.1 * i, "idle/engines": 0.5,
                               "train/staleness_mean": 2.0, "control/driver_cpu_s": 1.0, "control/queue_cpu_s": 3.0,
                               "control/worker_cpu_s": 2.0, "control/engine_cpu_s": 0.0}
                              for i, s in ((1, 900.0), (2, 100.0), (3, 300.0)))]
    f = step_figures(records, warmup=1)  # step 1 (the pipeline filling) left out
    assert (f["step_s"], f["trainer_idle"], f["steps"]) == (200.0, pytest.approx(0.25), 2)
    assert f["control_plane_s_per_step"] == 6.0 and f["control_plane_share"] == 0.03 and f["busiest"] == "queue"


def test_the_colocated_baseline_takes_the_scenario_s_sync_overrides_before_counting_devices(base_model):
    """A CPU scenario: async 1 engine core : 1 trainer core; its baseline runs one engine and one
    trainer rank on both cores (TP 2) with the figures measured so."""
    from asyncrl.bench.simulate import colocated_sync, devices

    cfg = load_config(["recipe=arith", "engine=sim", "trainer=sim",
                       "simulate.sync_overrides=['engine.tensor_parallel_size=2','trainer.tensor_parallel_size=2',"
                       "'engine.sim.decode_base_s=0.5','trainer.sim.train_per_token_s=0.25']"])
    assert devices(cfg) == (1, 1)
    sync = colocated_sync(cfg)
    assert (sync.engine.num_engines, sync.engine.tensor_parallel_size, sync.trainer.data_parallel_size) == (1, 2, 1)
    assert (sync.engine.sim.decode_base_s, sync.trainer.sim.train_per_token_s) == (0.5, 0.25)
    assert cfg.engine.sim.decode_base_s == 0.01  # the async side keeps its own figures
    from asyncrl.config.validate import ConfigError

    with pytest.raises(ConfigError, match="simulate.sync_overrides=.*only a scenario"):
        load_config(["recipe=arith", "simulate.sync_overrides=['engine.num_engines=2']"])
    with pytest.raises(ConfigError, match="each must be key=value on a section other than simulate"):
        load_config(["recipe=arith", "engine=sim", "trainer=sim", "simulate.sync_overrides=[engine.num_engines]"])
    with pytest.raises(ConfigError, match="engine.no_such_key"):
        load_config(["recipe=arith", "engine=sim", "trainer=sim", "simulate.sync_overrides=['engine.no_such_key=1']"])


def test_the_sim_trainer_pays_for_the_trained_share_of_the_tokens():
    cfg = load_config(["recipe=arith", "engine=sim", "trainer=sim", "trainer.sim.train_per_token_s=0.005",
                       "trainer.sim.optimizer_s=0", "trainer.sim.trained_share=0.5", "engine.sim.prompt_tokens=10"])
    rank = SimTrainerRank(TrainerSettings.of(cfg), 0, 1)
    from asyncrl.types import Segment, Trajectory, TrajectoryGroup

    trajs = [Trajectory("p", "g", [1] * 10, [Segment.from_policy([5] * 30, [-1.0] * 30, 0)], reward=float(i % 2))
             for i in range(4)]
    result = rank.train_step([TrajectoryGroup("g", "p", trajs)], 0)
    # 4 samples of 10 prompt + 30 response tokens, half of them paid for, at 5 ms a token: 0.4 s (all: 0.8)
    assert rank.step_s(4 * 40 // 2, 1) == pytest.approx(0.4)
    assert 0.4 <= result.metrics["train/step_s"] < 0.7


def test_calibration_fits_decode_prefill_and_trainer_figures_by_the_formulas():
    from asyncrl.bench.calibrate import decode_steps, fit_line, prefill_per_token

    assert fit_line([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="two distinct x values"):
        fit_line([4, 4], [1, 2])
    # A batch's 8-token requests took 0.1 s, its 72-token ones 0.74 s: (0.74 - 0.1) / 64 = 10 ms a step.
    short, long = {1: 0.1, 16: 0.3, 64: 1.0}, {1: 0.74, 16: 1.58, 64: 4.2}
    steps = decode_steps(short, long, (8, 72))
    assert steps == pytest.approx({1: 0.01, 16: 0.02, 64: 0.05})
    # With 50 more prompt tokens each, batch 16 took 0.46 s instead of 0.3: 0.16 s / 800 tokens = 0.2 ms a
    # token; batch 64 1.96 s instead of 1.0: 0.96 / 3200 = 0.3 ms; the median 0.25 ms (batch 1 left out).
    assert prefill_per_token(short, {1: 5.0, 16: 0.46, 64: 1.96}, 50.0) == pytest.approx(0.00025)


def test_calibration_times_a_batch_again_when_noise_makes_its_decode_step_negative():
    from asyncrl.bench.calibrate import RETIMES, time_decode

    # Batch 1's first long timing caught a hiccup of the machine in its short one: (0.05 - 0.2) / 10 < 0.
    script = {(1, 0): (0.2, 0.05, 0.3), (1, 1): (0.01, 0.11, 0.02), (1, 2): (0.01, 0.13, 0.02),
              (4, 0): (0.02, 0.22, 0.03)}
    (short, long, thrice), retimed = time_decode([1, 4], 1, lambda b, r: script[b, r], (2, 12))
    # batch 1's medians over three timings: short 0.01, long 0.11 -> a step of 10 ms; two retimes, since one
    # more timing leaves the median of (0.2, 0.01) and (0.05, 0.11) at a step of -0.0025 s
    assert retimed == 2 and short[1] == pytest.approx(0.01) and long[1] == pytest.approx(0.11)
    assert (short[4], long[4], thrice[4]) == (0.02, 0.22, 0.03)  # batch 4 timed once
    with pytest.raises(RuntimeError, match=rf"batch\(es\) \[1\] measured <= 0 s after {RETIMES} more timings"):
        time_decode([1], 1, lambda b, r: (0.2, 0.05, 0.3), (2, 12))


def test_calibration_reads_a_run_s_lengths_and_trained_share(tmp_path):
    from asyncrl.bench.calibrate import run_lengths

    for name, rows in (("sync", [({"0": 1, "8": 3}, 3, 4)]), ("async", [({"8": 2, "40": 2}, 2, 4)])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(
            {"step": 1, "length/finished_hist": h, "batch/samples": s, "batch/trajectories": t}) for h, s, t in rows))
    hist, share = run_lengths(tmp_path)
    assert hist == [[4, 1], [12, 5], [44, 2]] and share == 5 / 8  # bins of 8 tokens, named by their centres
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        run_lengths(tmp_path / "sync" / "nothing")


@pytest.mark.slow
@pytest.mark.alone
def test_calibrate_measures_both_layouts_into_a_scenario_that_loads(tmp_path, base_model):
    """`asyncrl calibrate` on real vLLM and megatron-core (a small cut): both layouts measured, the
    scenario written with the async figures in place and the sync layout's as overrides, and it
    composes into a valid config."""
    from omegaconf import OmegaConf

    from tests.conftest import run_cli

    out_file = tmp_path / "sim_cpu_test.yaml"
    out = run_cli("calibrate", "chain_sum_cot", "algorithm.prompts_per_step=8", "algorithm.n_samples_per_prompt=4",
                  "bench.calibrate_batches=[1,64]", "bench.calibrate_tokens=[4,36]", "bench.rounds=1",
                  f"bench.scenario_out={out_file}", f"run.output_dir={tmp_path}", "cluster.dashboard=false",
                  cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "calibrate" and result["scenario"] == str(out_file)
    assert (result["sync_cores_engine"], result["async_cores_engine"], result["async_cores_trainer"]) == (2, 1, 1)
    for mode in ("sync", "async"):  # figures, not their values: this machine runs other tests meanwhile
        (b1, step1), (b64, step64) = result[f"{mode}_decode_points"]
        # Both measured; not their order: one round on a machine running other tests can time a
        # single request's step above 64 requests' (make test at c36762b: 0.0128 s against 0.0075 s).
        assert (b1, b64) == (1, 64) and step1 > 0 and step64 > 0
        assert result[f"{mode}_decode_per_seq_s"] >= 0 and result[f"{mode}_train_per_token_s"] >= 0
        assert result[f"{mode}_weight_bytes"] > 0 and len(result[f"{mode}_train_points"]) == 2
    assert result["trained_share"] == 1.0 and 1 <= result["mean_length"] <= 96  # sampled from the base
    scenario = OmegaConf.load(out_file)
    # the async figures in place (>= 0: on a loaded machine the fitted slope can come out at 0, as above)
    assert scenario.defaults[0] == "chain_sum_cot"
    assert scenario.engine.sim.decode_per_seq_s == pytest.approx(result["async_decode_per_seq_s"], rel=1e-3, abs=1e-12)
    assert "engine.tensor_parallel_size=2" in scenario.simulate.sync_overrides
    flat = [f"{section}.sim.{k}={v}" for section in ("engine", "trainer") for k, v in scenario[section].sim.items()]
    cfg = load_config(["recipe=chain_sum_cot", "engine=sim", "trainer=sim", *flat,
                       f"simulate.sync_overrides=[{','.join(repr(o) for o in scenario.simulate.sync_overrides)}]"])
    assert cfg.trainer.sim.train_per_token_s == pytest.approx(result["async_train_per_token_s"], rel=1e-3)

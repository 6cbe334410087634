"""`asyncrl bench calibrate recipe=RECIPE` (= `asyncrl calibrate RECIPE`): this machine's real
engine, trainer and weight sync, measured in the two layouts `asyncrl bench sync-vs-async` runs
them in, written as a scenario for `asyncrl simulate` (conf/recipe/sim_cpu_RECIPE.yaml).

    asyncrl calibrate chain_sum_cot bench.lengths_from=runs/chain_sum_cot/2026-11-26_01-14-09
    asyncrl simulate sim_cpu_chain_sum_cot

For each layout, sync (one engine and one trainer rank, each on every core, in turns) and async
(the recipe's: each on its own cores, at once), the bench starts the engine, the trainer and
their weight sync as a run does (asyncrl.actors) and measures, in the async layout each side
while the other works (train steps, or rollout.max_concurrent_loops requests at a time: the
two share the machine's memory and the processes that are bound to no core):
  - decode: `bench.calibrate_batches` requests at once, generating bench.calibrate_tokens[0] and
    [1] tokens each (ignore_eos): a decode step at batch B is the difference of the two times over
    the difference of the tokens; decode_base_s and decode_per_seq_s are the least-squares line
    through the steps against B. Context length is not varied (the per-seq figure holds for the
    recipe's contexts; decode_per_kv_token_s stays 0);
  - prefill: the shorter requests again with prompts three times as long (each prompt thrice):
    the extra time over the extra prompt tokens (median over the batches of 16 and more). Both
    differences cancel what a request costs whatever its length (its Ray call from here: a run's
    workers reach the engines over their own channel, which a simulated run has too);
  - the trainer: train steps of the recipe's prompts_per_step x n_samples_per_prompt samples with
    responses of bench.calibrate_tokens[0] and [1] tokens: optimizer_s and train_per_token_s are
    the line through step time against the step's (prompt + response) tokens;
  - a weight sync: the broadcast and the engine's load (medians of bench.rounds syncs).
Response lengths come from a run (bench.lengths_from: a run directory or a bench's, every
metrics.jsonl under it; length/finished_hist summed over its steps), which also gives the share
of its samples the run trained (uniform groups are filtered; simulated rewards carry no signal);
without one, from sampling the base model (n samples of prompts_per_step held-out prompts on
the sync layout's engine; every sample counted as trained).
The async figures go in engine.sim / trainer.sim, the sync layout's in simulate.sync_overrides.
Last line: one JSON object with every figure and the scenario's path.
"""

from __future__ import annotations

import datetime
import logging
import os
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from asyncrl import actors
from asyncrl.bench.config import BenchConfig
from asyncrl.bench.sync_vs_async import mode_config
from asyncrl.bench.weight_sync import synthetic_groups
from asyncrl.config import CONF_DIR, REPO_ROOT, Config
from asyncrl.control.weight_sync import WeightSync
from asyncrl.cpu_cores import parse_cores
from asyncrl.metrics import LENGTH_BIN_TOKENS
from asyncrl.monitoring.run_log import read_metrics
from asyncrl.types import SamplingSpec

logger = logging.getLogger(__name__)
RETIMES = 3  # extra timings of a batch whose decode step came out <= 0 s before calibrate gives up


@dataclass
class LayoutFigures:
    """One layout's measured figures, in the sim backends' terms (seconds)."""

    cores_engine: int
    cores_trainer: int
    decode_base_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float
    train_per_token_s: float
    optimizer_s: float
    weight_bytes: int
    broadcast_bytes_per_s: float
    load_s: float
    decode_points: list[list[float]]  # [batch, seconds a step]
    train_points: list[list[float]]  # [tokens, seconds a step]
    decode_retimed: int  # extra timings of batches whose decode step came out <= 0 s (noise)


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError(f"a line needs two distinct x values, got {list(xs)}")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - b * mx, b


def decode_steps(short: dict[int, float], long: dict[int, float], tokens: tuple[int, int]) -> dict[int, float]:
    """Seconds a decode step at each batch: the longer requests' extra time over their extra tokens."""
    return {b: (long[b] - short[b]) / (tokens[1] - tokens[0]) for b in short}


def time_decode(batches: Sequence[int], rounds: int, time_batch: Callable[[int, int], tuple[float, float, float]],
                tokens: tuple[int, int]) -> tuple[tuple[dict[int, float], dict[int, float], dict[int, float]], int]:
    """Median seconds of the short, long and long-prompt requests at each batch over `rounds`
    timings (`time_batch(batch, round)` gives the three), and how many extra rounds batches took:
    a decode step of <= 0 s is a hiccup of the machine during one timing, not the engine, so
    that batch is timed again, up to RETIMES times, before calibrate gives up with why."""
    times: dict[int, list[tuple[float, float, float]]] = {b: [] for b in batches}
    for r in range(rounds):
        for b in batches:
            times[b].append(time_batch(b, r))

    def medians() -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        short, long, thrice = ({b: statistics.median(t[k] for t in ts) for b, ts in times.items()} for k in range(3))
        return short, long, thrice

    retimed = 0
    while bad := [b for b, s in decode_steps(*medians()[:2], tokens).items() if s <= 0]:
        if retimed == RETIMES:
            raise RuntimeError(f"calibrate: the decode step at batch(es) {bad} measured <= 0 s after {RETIMES} more "
                               f"timings: this machine is too busy to time it; raise bench.rounds or "
                               f"bench.calibrate_tokens[1]={tokens[1]}")
        retimed += 1
        logger.warning("calibrate: the decode step at batch(es) %s measured <= 0 s; timing again (%d of %d)",
                       bad, retimed, RETIMES)
        for b in bad:
            times[b].append(time_batch(b, rounds + retimed - 1))
    return medians(), retimed


def prefill_per_token(short: dict[int, float], long_prompts: dict[int, float], extra_tokens: float) -> float:
    """Seconds a prompt token: what requests with `extra_tokens` more prompt tokens each took
    beyond the same requests' time, over those tokens; the median over batches of 16 and more
    (a lone request's time is mostly noise at this size)."""
    return max(0.0, statistics.median((long_prompts[b] - short[b]) / (b * extra_tokens) for b in short if b >= 16))


def run_lengths(root: Path) -> tuple[list[list[int]], float]:
    """Every metrics.jsonl under `root` (a run or a bench's runs): the finished responses' length
    histogram summed over the steps, as [[bin centre, count], ...], and the share of the
    trajectories the steps trained."""
    files = sorted(root.rglob("metrics.jsonl"))
    if not files:
        raise ValueError(f"bench.lengths_from={str(root)!r}: no metrics.jsonl under it")
    hist: Counter[int] = Counter()
    samples = trajectories = 0
    for f in files:
        for r in read_metrics(f.parent):
            for edge, n in r.get("length/finished_hist", {}).items():
                hist[int(edge) + LENGTH_BIN_TOKENS // 2] += n
            samples += r.get("batch/samples", 0)
            trajectories += r.get("batch/trajectories", 0)
    if not hist or not trajectories:
        raise ValueError(f"bench.lengths_from={str(root)!r}: its steps logged no length/finished_hist")
    return [[t, n] for t, n in sorted(hist.items())], samples / trajectories


def _timed(engine: Any, prompts: list[list[int]], batch: int, tokens: int, tag: str) -> float:
    """Seconds for `batch` requests sent at once to each generate `tokens` tokens."""
    spec = SamplingSpec(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    t0 = time.monotonic()
    ray.get([engine.generate.remote(prompts[i % len(prompts)], spec, f"{tag}-{i}") for i in range(batch)])
    return time.monotonic() - t0


def _sampled_lengths(engine: Any, cfg: Config, prompts: list[list[int]]) -> list[list[int]]:
    """The base model's response lengths over n samples of each prompt, as [[tokens, count], ...]."""
    spec = SamplingSpec(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p)
    refs = [engine.generate.remote(p, spec, f"lengths-{i}-{k}") for i, p in enumerate(prompts)
            for k in range(cfg.algorithm.n_samples_per_prompt)]
    counts = Counter(max(1, len(r.token_ids)) for r in ray.get(refs))
    return [[t, n] for t, n in sorted(counts.items())]


class _Busy:
    """Keeps the other side at work from a thread while one side is timed: `work(i)` over and over
    (None: nothing). An error in the work is raised on leaving, not lost with its thread."""

    def __init__(self, work: Callable[[int], None] | None):
        self.work, self.stop = work, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                self.work(i)
                i += 1
        except BaseException as e:  # handed to the timing thread in __exit__
            self.error = e

    def __enter__(self) -> _Busy:
        if self.work is not None:
            self.thread.start()
            time.sleep(0.5)  # under way before the first timing
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.work is not None:
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"the load kept up while timing failed: {self.error!r}") from self.error


def measure_layout(cfg: Config, bench: BenchConfig, prompts: list[list[int]], concurrent: bool,
                   sample_lengths: bool) -> tuple[LayoutFigures, list[list[int]]]:
    """Start this layout's engine, trainer and weight sync, and measure them (module docstring);
    `concurrent`: each side is timed while the other works, as they run at once in an async run."""
    from transformers import AutoConfig

    # A Ray cluster as a run starts one (its dashboard's processes float onto the trainer's core too)
    actors.start_local_ray(cfg, log_to_driver=False)
    trainer = None
    try:
        engines = actors.create_engines(cfg)
        started = [e.start.remote() for e in engines]
        trainer = actors.create_trainer(cfg)
        info = trainer.setup()
        ray.get(started)
        sync = WeightSync.of(cfg, trainer, engines)
        sync.connect()
        engine = engines[0]
        short_t, long_t = bench.calibrate_tokens
        vocab = AutoConfig.from_pretrained(cfg.model.path).vocab_size

        def train(i: int) -> None:
            trainer.train_step(synthetic_groups(cfg, bench.calibrate_tokens[i % 2], prompts, vocab, i), 0)

        def generate(i: int) -> None:
            _timed(engine, prompts, cfg.rollout.max_concurrent_loops, long_t, f"busy{i}")

        _timed(engine, prompts, max(bench.calibrate_batches), short_t, "warmup")
        thrice = [(p * 3)[: cfg.engine.max_model_len - long_t] for p in prompts]
        extra_prompt = statistics.fmean(len(t) - len(p) for t, p in zip(thrice, prompts))
        if extra_prompt < 1:
            raise ValueError(f"engine.max_model_len={cfg.engine.max_model_len} leaves no room for longer prompts "
                             f"beside bench.calibrate_tokens[1]={long_t} new tokens: lower it")

        def time_batch(b: int, r: int) -> tuple[float, float, float]:
            return (_timed(engine, prompts, b, short_t, f"s{r}-{b}"), _timed(engine, prompts, b, long_t, f"l{r}-{b}"),
                    _timed(engine, thrice, b, short_t, f"p{r}-{b}"))

        with _Busy(train if concurrent else None):
            (short_s, long_s, thrice_s), retimed = time_decode(bench.calibrate_batches, bench.rounds, time_batch,
                                                               (short_t, long_t))
        steps = decode_steps(short_s, long_s, (short_t, long_t))
        base, per_seq = fit_line(list(steps), list(steps.values()))
        lengths = _sampled_lengths(engine, cfg, prompts) if sample_lengths else []

        train_points = []
        with _Busy(generate if concurrent else None):
            for step in range(1 + 2 * bench.rounds):  # the first warms up
                groups = synthetic_groups(cfg, bench.calibrate_tokens[step % 2], prompts, vocab, step)
                tokens = sum(len(t.prompt_token_ids) + t.num_response_tokens for g in groups for t in g.trajectories)
                t0 = time.monotonic()
                trainer.train_step(groups, 0)
                if step:
                    train_points.append([tokens, time.monotonic() - t0])
        optimizer_s, per_token = fit_line([x for x, _ in train_points], [y for _, y in train_points])

        timings = [sync.sync(v, cfg.algorithm.pause_mode) for v in range(1, 2 + bench.rounds)][1:]
        load_s = statistics.median(t.load_s for t in timings)
        broadcast_s = max(1e-4, statistics.median(t.broadcast_load_s for t in timings) - load_s)
    finally:
        if trainer is not None:
            trainer.shutdown()
        ray.shutdown()
    cores = len(os.sched_getaffinity(0))
    figures = LayoutFigures(
        cores_engine=len(parse_cores(cfg.engine.cpu_cores)) if cfg.engine.cpu_cores else cores,
        cores_trainer=len(parse_cores(cfg.trainer.cpu_cores)) if cfg.trainer.cpu_cores else cores,
        decode_base_s=max(0.0, base), decode_per_seq_s=max(0.0, per_seq),
        prefill_per_token_s=prefill_per_token(short_s, thrice_s, extra_prompt),
        train_per_token_s=max(0.0, per_token), optimizer_s=max(0.0, optimizer_s),
        weight_bytes=info.weight_bytes, broadcast_bytes_per_s=info.weight_bytes / broadcast_s, load_s=load_s,
        decode_points=[[b, s] for b, s in steps.items()], train_points=train_points, decode_retimed=retimed)
    return figures, lengths


def _g(x: float) -> str:
    return f"{x:.4g}"


def scenario_yaml(cfg: Config, sync: LayoutFigures, async_: LayoutFigures, lengths: list[list[int]],
                  trained_share: float, source: str, command: str) -> str:
    """The scenario file: the recipe on simulated backends with the async layout's figures, and
    the sync layout's as its simulated baseline's overrides."""
    name = f"sim_cpu_{cfg.recipe.name}"
    sync_overrides = [
        f"engine.tensor_parallel_size={sync.cores_engine}", f"trainer.tensor_parallel_size={sync.cores_trainer}",
        f"engine.sim.decode_base_s={_g(sync.decode_base_s)}",
        f"engine.sim.decode_per_seq_s={_g(sync.decode_per_seq_s)}",
        f"engine.sim.prefill_per_token_s={_g(sync.prefill_per_token_s)}",
        f"trainer.sim.train_per_token_s={_g(sync.train_per_token_s)}",
        f"trainer.sim.optimizer_s={_g(sync.optimizer_s)}"]
    points = "\n".join(
        f"#   {label}: decode step s at batch {', '.join(f'{b:g}: {s:.4f}' for b, s in f.decode_points)}; "
        f"train step s at tokens {', '.join(f'{t:g}: {s:.3f}' for t, s in f.train_points)}"
        for label, f in (("sync", sync), ("async", async_)))
    hist = ", ".join(f"[{t}, {n}]" for t, n in lengths)
    return f"""# @package _global_
# Scenario: recipe {cfg.recipe.name} on this machine ({len(os.sched_getaffinity(0))} cores), simulated with the
# figures of its real engine, trainer and weight sync measured by (docs/scale.md, "Calibration"):
#   {command}
# on {datetime.date.today().isoformat()} at commit {_commit()}. Compare with the real thing:
#   asyncrl simulate {name}
#   asyncrl bench sync-vs-async recipe={cfg.recipe.name}
# Layouts as `asyncrl bench sync-vs-async` runs them: async, engine on {async_.cores_engine} core(s) and trainer on
# {async_.cores_trainer} (the recipe's cpu_cores; a core is a device here); sync, one engine and one trainer rank
# each on all cores in turns (simulate.sync_overrides). Measured points:
{points}
# Response lengths and the trained share: {source}.
defaults:
  - {cfg.recipe.name}
  - override /engine: sim
  - override /trainer: sim
  - _self_

recipe:
  name: {name}
  description: "scenario: {cfg.recipe.name} on this machine's {len(os.sched_getaffinity(0))} cores, calibrated"

cluster:
  time_scale: 1

engine:
  num_engines: 1
  tensor_parallel_size: {async_.cores_engine}
  max_num_seqs: {cfg.engine.max_num_seqs}
  max_model_len: {cfg.engine.max_model_len}
  sim:
    decode_base_s: {_g(async_.decode_base_s)}
    decode_per_seq_s: {_g(async_.decode_per_seq_s)}
    decode_per_kv_token_s: 0.0
    prefill_per_token_s: {_g(async_.prefill_per_token_s)}
    load_s: {_g(async_.load_s)}
    length_hist: [{hist}]

trainer:
  tensor_parallel_size: {async_.cores_trainer}
  data_parallel_size: 1
  sim:
    train_per_token_s: {_g(async_.train_per_token_s)}
    logprob_per_token_s: 0.0
    optimizer_s: {_g(async_.optimizer_s)}
    weight_bytes: {async_.weight_bytes}
    broadcast_bytes_per_s: {_g(async_.broadcast_bytes_per_s)}
    trained_share: {trained_share:.3f}

algorithm:
  loss:
    filter_uniform_groups: false  # simulated rewards carry no signal: trainer.sim.trained_share stands for the filter

eval:
  every_steps: 0
  num_problems: 8
  n_samples: 1
  pass_k: [1]

simulate:
  sync_overrides: [{", ".join(sync_overrides)}]
"""


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_calibrate_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from asyncrl.tasks import TaskSource

    if cfg.engine.backend == "sim":
        raise ValueError(f"recipe={cfg.recipe.name} is a scenario already: calibrate measures a recipe's real "
                         "engine and trainer")
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    prompts = [tok.encode(p.prompt) for p in TaskSource(cfg.data).heldout[: cfg.algorithm.prompts_per_step]]
    runs = Path(cfg.run.output_dir or ".")
    lengths_from = Path(bench.lengths_from) if bench.lengths_from else None
    from_run = run_lengths(lengths_from) if lengths_from is not None else None  # a bad path fails now
    figures: dict[str, LayoutFigures] = {}
    sampled: list[list[int]] = []
    for mode in ("sync", "async"):
        mode_cfg = mode_config(cfg, bench, mode, runs / mode)
        figures[mode], got = measure_layout(mode_cfg, bench, prompts, mode == "async",
                                            lengths_from is None and mode == "sync")
        sampled = sampled or got
    if from_run is not None:
        lengths, trained_share = from_run
        source = f"from the run(s) under {lengths_from} (their finished responses, all steps)"
    else:
        lengths, trained_share = sampled, 1.0
        source = ("sampled from the base model (n samples of prompts_per_step held-out prompts); every sample "
                  "counted as trained")
    out = Path(bench.scenario_out) if bench.scenario_out else CONF_DIR / "recipe" / f"sim_cpu_{cfg.recipe.name}.yaml"
    command = "asyncrl calibrate " + cfg.recipe.name + (f" bench.lengths_from={lengths_from}" if lengths_from else "")
    out.write_text(scenario_yaml(cfg, figures["sync"], figures["async"], lengths, trained_share, source, command))
    mean_length = sum(t * n for t, n in lengths) / sum(n for _, n in lengths)
    return {"bench": "calibrate", "recipe": cfg.recipe.name, "scenario": str(out),
            **{f"{mode}_{k}": v for mode, f in figures.items() for k, v in vars(f).items()},
            "mean_length": mean_length, "trained_share": trained_share}

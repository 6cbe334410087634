"""`asyncrl simulate SCENARIO [key=value ...]` (= `asyncrl bench simulate recipe=SCENARIO`): a
scenario, a recipe on simulated backends (conf/recipe/sim_*.yaml: engine=sim, trainer=sim and
the figures of their latency models), run through the real control plane twice:

(a) sync, the peers' colocated baseline: every device generates, then every device trains.
    All the scenario's devices (engine.num_engines x engine.tensor_parallel_size plus the
    trainer's tensor x pipeline x data parallel ranks) are engines while generating
    (engine.num_engines = devices / engine TP) and trainer ranks while training (data parallel
    = devices / (TP x PP)); max_staleness 0, no partial rollout.
    Where the baseline's engines or trainer differ from the split's beyond their number, the
    scenario says how in simulate.sync_overrides (applied first).
(b) async: the scenario's engine : trainer split, staleness bound and partial rollout.

Each runs bench.steps train steps of the same samples. Figures are means over the steps after
the first bench.warmup_steps (the asynchronous pipeline fills in its first steps), in simulated
seconds: step time, the trainer's and the engines' idle ratios, the mean staleness of trained
tokens; and the control plane's own cost, in real CPU seconds per step: the driver's, the
queue's and the busiest rollout worker's and engine actor's (`control/*` metrics), beside their
sum over the simulated step (`control_plane_share`; the goal is < 2 %).

With any of bench.sweep_engine_devices / sweep_max_staleness / sweep_partial_rollout set, the
async run is repeated for every combination (the devices stay the scenario's: engine devices
are taken from the trainer's data parallel ranks) and the bench writes sweep.md and sweep.png.
Both runs' step times and idle ratios are drawn in steps.png. The last line is one JSON object.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from asyncrl.bench.config import BenchConfig
from asyncrl.config import Config
from asyncrl.config.validate import with_overrides
from asyncrl.monitoring.run_log import read_metrics

CONTROL_ROLES = ("driver", "queue", "worker", "engine")


def devices(cfg: Config) -> tuple[int, int]:
    """(engine devices, trainer devices) of a config."""
    t = cfg.trainer
    return (cfg.engine.num_engines * _engine_devices(cfg),
            t.tensor_parallel_size * t.pipeline_parallel_size * t.data_parallel_size)


def _engine_devices(cfg: Config) -> int:
    """Devices per engine actor: its simulated engines' tensor-parallel devices."""
    return cfg.engine.sim.replicas * cfg.engine.tensor_parallel_size


def split(cfg: Config, engine_devices: int) -> Config:
    """The same devices, `engine_devices` of them engines and the rest the trainer's data parallel ranks."""
    total = sum(devices(cfg))
    e, t = cfg.engine, cfg.trainer
    model_parallel, per_actor = t.tensor_parallel_size * t.pipeline_parallel_size, _engine_devices(cfg)
    if engine_devices % per_actor or (total - engine_devices) % model_parallel or not 0 < engine_devices < total:
        raise ValueError(f"{engine_devices} of {total} devices as engines: must be a multiple of engine TP x "
                         f"engine.sim.replicas = {per_actor}, leaving a multiple of trainer TP x PP {model_parallel}")
    return replace(cfg, engine=replace(e, num_engines=engine_devices // per_actor),
                   trainer=replace(t, data_parallel_size=(total - engine_devices) // model_parallel))


def whole_batch_loops(cfg: Config) -> int:
    """Loops per rollout worker for a step's whole batch to generate at once (a synchronous baseline)."""
    a, r = cfg.algorithm, cfg.rollout
    return max(r.max_concurrent_loops, -(-a.prompts_per_step * a.n_samples_per_prompt // r.num_workers))


def colocated_sync(cfg: Config) -> Config:
    """Every device an engine while generating and a trainer rank while training, in turns; the
    step's whole batch generates at once (the rollout workers run a loop for every sample). The
    scenario's simulate.sync_overrides apply first (e.g. engines that span more devices)."""
    total = sum(devices(cfg))
    if cfg.simulate.sync_overrides:
        cfg = with_overrides(cfg, cfg.simulate.sync_overrides)
    e, t, r = cfg.engine, cfg.trainer, cfg.rollout
    return replace(cfg, engine=replace(e, num_engines=total // _engine_devices(cfg)),
                   rollout=replace(r, max_concurrent_loops=whole_batch_loops(cfg)),
                   trainer=replace(t, data_parallel_size=total // (t.tensor_parallel_size * t.pipeline_parallel_size)),
                   algorithm=replace(cfg.algorithm, max_staleness=0, policy_lag=0, partial_rollout=False))


def sweep_arms(cfg: Config, bench: BenchConfig) -> list[Config]:
    """The async runs of a sweep: every combination of the bench.sweep_* lists (an empty one: the
    scenario's value); none without a sweep."""
    if not (bench.sweep_engine_devices or bench.sweep_max_staleness or bench.sweep_partial_rollout):
        return []
    arms = []
    for engine_devices, eta, partial in itertools.product(
            bench.sweep_engine_devices or [devices(cfg)[0]], bench.sweep_max_staleness or [cfg.algorithm.max_staleness],
            bench.sweep_partial_rollout or [cfg.algorithm.partial_rollout]):
        arm = split(cfg, engine_devices) if engine_devices != devices(cfg)[0] else cfg
        arms.append(replace(arm, algorithm=replace(arm.algorithm, max_staleness=eta, partial_rollout=partial,
                                                   policy_lag=min(arm.algorithm.policy_lag, eta))))
    return arms


def _run_config(cfg: Config, bench: BenchConfig, run_dir: Path) -> Config:
    return replace(cfg, run=replace(cfg.run, output_dir=str(run_dir), resume_from="", max_train_s=0.0),
                   trainer=replace(cfg.trainer, total_steps=bench.steps, checkpoint_every=0),
                   eval=replace(cfg.eval, every_steps=0), logging=replace(cfg.logging, progress_bar=False))


def step_figures(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Means over the steps after `warmup` of a run's step records (metrics.jsonl)."""
    steps = [r for r in records if "throughput/step_s" in r][warmup:]
    if not steps:
        raise ValueError(f"no steps after the first {warmup} (bench.warmup_steps): run more bench.steps")

    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in steps)

    control = {role: mean(f"control/{role}_cpu_s") for role in CONTROL_ROLES}
    step_s = mean("throughput/step_s")
    return {"step_s": step_s, "trainer_idle": mean("idle/trainer"), "engine_idle": mean("idle/engines"),
            "staleness_mean": mean("train/staleness_mean"), "steps": len(steps),
            "control_cpu_s": control, "control_plane_s_per_step": sum(control.values()),
            "control_plane_share": sum(control.values()) / step_s,
            "busiest": max(control, key=control.get)}


def _run(cfg: Config, run_dir: Path, bench: BenchConfig) -> dict[str, Any]:
    from asyncrl.driver import run_training

    t0 = time.monotonic()
    summary = run_training(_run_config(cfg, bench, run_dir), run_dir)
    figures = step_figures(read_metrics(run_dir), bench.warmup_steps)
    engine_devices, trainer_devices = devices(cfg)
    return {**figures, "engine_devices": engine_devices, "trainer_devices": trainer_devices,
            "max_staleness": cfg.algorithm.max_staleness, "partial_rollout": cfg.algorithm.partial_rollout,
            "samples": summary["samples"], "lost": summary["prompts"]["lost"], "real_s": time.monotonic() - t0}


def sweep_table(sync: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """One row per async run: its split, bound, partial rollout, step time, speedup and idle ratios."""
    lines = ["| engine : trainer devices | max staleness | partial rollout | step s | speedup | trainer idle "
             "| engine idle | staleness mean |", "|---|---|---|---|---|---|---|---|",
             f"| {sync['engine_devices']} (all, in turns) | 0 | no | {sync['step_s']:.1f} | 1.00 "
             f"| {sync['trainer_idle']:.2f} | {sync['engine_idle']:.2f} | 0 |"]
    for r in runs:
        lines.append(f"| {r['engine_devices']} : {r['trainer_devices']} | {r['max_staleness']} "
                     f"| {'yes' if r['partial_rollout'] else 'no'} | {r['step_s']:.1f} "
                     f"| {sync['step_s'] / r['step_s']:.2f} | {r['trainer_idle']:.2f} | {r['engine_idle']:.2f} "
                     f"| {r['staleness_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def _sweep_plot(sync: dict[str, Any], runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    keys = sorted({(r["max_staleness"], r["partial_rollout"]) for r in runs})
    for eta, partial in keys:
        rows = sorted((r for r in runs if (r["max_staleness"], r["partial_rollout"]) == (eta, partial)),
                      key=lambda r: r["engine_devices"])
        ax.plot([r["engine_devices"] for r in rows], [sync["step_s"] / r["step_s"] for r in rows], marker="o",
                label=f"max staleness {eta}{', partial rollout' if partial else ''}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel(f"engine devices (of {sync['engine_devices']})")
    ax.set_ylabel("speedup over colocated sync")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def steps_plot(root: Path, path: Path) -> None:
    """Per step of the sync and async runs under `root`: simulated step time, and the trainer's and
    the engines' idle ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, color in (("sync", "tab:blue"), ("async", "tab:orange")):
        steps = [r for r in read_metrics(root / mode) if "throughput/step_s" in r]
        x = [r["step"] for r in steps]
        ax_t.plot(x, [r["throughput/step_s"] for r in steps], marker="o", color=color, label=mode)
        ax_i.plot(x, [r["idle/trainer"] for r in steps], marker="o", color=color, label=f"{mode}: trainer")
        ax_i.plot(x, [r["idle/engines"] for r in steps], marker="s", ls="--", color=color, label=f"{mode}: engines")
    ax_t.set(xlabel="step", ylabel="simulated seconds", title="step time", ylim=(0, None))
    ax_i.set(xlabel="step", ylabel="idle share", title="idle ratios", ylim=(0, 1))
    for ax in (ax_t, ax_i):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_simulate_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    if cfg.engine.backend != "sim":
        raise ValueError(f"recipe={cfg.recipe.name} runs real engines: asyncrl simulate takes a scenario "
                         "(a recipe with engine=sim trainer=sim, conf/recipe/sim_*.yaml)")
    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    arms = sweep_arms(cfg, bench)  # before any run: a split the devices do not allow fails now, not in an hour
    sync = _run(colocated_sync(cfg), root / "sync", bench)
    async_ = _run(cfg, root / "async", bench)
    steps_plot(root, root / "steps.png")
    result = {
        "bench": "simulate", "scenario": cfg.recipe.name, "devices": sum(devices(cfg)),
        "split": f"{async_['engine_devices']}:{async_['trainer_devices']}", "time_scale": cfg.cluster.time_scale,
        "sync_step_s": sync["step_s"], "async_step_s": async_["step_s"], "speedup": sync["step_s"] / async_["step_s"],
        "trainer_idle": async_["trainer_idle"], "engine_idle": async_["engine_idle"],
        "sync_trainer_idle": sync["trainer_idle"], "sync_engine_idle": sync["engine_idle"],
        "staleness_mean": async_["staleness_mean"],
        "control_plane_s_per_step": async_["control_plane_s_per_step"],
        "control_plane_share": async_["control_plane_share"], "control_cpu_s": async_["control_cpu_s"],
        "busiest": async_["busiest"], "prompts_lost": sync["lost"] + async_["lost"],
        "real_s": sync["real_s"] + async_["real_s"], "runs": str(root)}
    if arms:
        runs = []
        for i, arm in enumerate(arms):
            runs.append(_run(arm, root / f"sweep{i}", bench))
            (root / "sweep.md").write_text(sweep_table(sync, runs))
            (root / "sweep.json").write_text(json.dumps({"sync": sync, "runs": runs}, indent=1))
        _sweep_plot(sync, runs, root / "sweep.png")
        result["sweep"] = [{k: r[k] for k in ("engine_devices", "max_staleness", "partial_rollout", "step_s")}
                           | {"speedup": sync["step_s"] / r["step_s"]} for r in runs]
    return result

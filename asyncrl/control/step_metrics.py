"""A step's metrics from the actors' typed reports: pure functions, no actor calls.

The driver takes `Clocks` at both ends of a step (engine activity totals, rollout totals,
control-plane CPU seconds) and `step_metrics` turns the two into rates and shares.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Any

from asyncrl.evaluation import EvalResult
from asyncrl.messages import EngineActivity, QueueStats, WorkerStats
from asyncrl.metrics import length_histogram, reward_metrics
from asyncrl.types import TrajectoryGroup


@dataclass
class Clocks:
    """Totals at one instant: time, each live engine's activity (by handle), the rollout
    counters (`rollout_metrics`) and each control-plane process's CPU seconds."""

    time: float
    activity: dict[Any, EngineActivity]
    rollout: dict[str, Any]
    cpu: dict[tuple, float]


def batch_metrics(groups: list[TrajectoryGroup], stale: list[TrajectoryGroup], trained: list[TrajectoryGroup],
                  multi_task: bool) -> dict[str, Any]:
    """What a step's batch held: the lengths of everything taken from the queue and of what was
    trained (a staleness rule or a filter shows as their difference), a verl reward function's
    extra keys over the step's samples, and with several agents the groups of each env."""
    out: dict[str, Any] = {"length/finished_hist": length_histogram([*groups, *stale]),
                           "length/trained_hist": length_histogram(trained), **reward_metrics(groups)}
    if multi_task:
        out.update({f"batch/groups/{env}": n for env, n in collections.Counter(g.env_id for g in groups).items()})
    return out


def rollout_metrics(stats: list[WorkerStats]) -> dict[str, Any]:
    """The workers' counters summed (`rollout/...`): totals since the run started."""
    keys = ("generated_tokens", "interruptions", "resumes", "trajectories_finished", "running_loops", "snapshots",
            "engine_failovers")
    out: dict[str, Any] = {f"rollout/{k}": sum(getattr(s, k) for s in stats) for k in keys}
    failures: collections.Counter[str] = collections.Counter()
    tool_errors: collections.Counter[str] = collections.Counter()
    for s in stats:
        failures.update(s.failures)
        tool_errors.update(s.tool_errors)
    out["rollout/failures"] = dict(failures)
    out["rollout/tool_calls"] = sum(s.tool_calls for s in stats)
    for name in sorted({n for s in stats for n in s.services}):  # the served models
        calls = sum(s.services.get(name, (0, 0.0))[0] for s in stats)
        out[f"{name}/samples"] = calls
        if calls:
            out[f"{name}/latency_s"] = sum(s.services.get(name, (0, 0.0))[1] for s in stats) / calls
    out.update({f"rollout/tool_errors/{reason}": n for reason, n in tool_errors.items()})
    return out


def cpu_totals(activity: dict[Any, EngineActivity], queue: QueueStats, workers: dict[int, WorkerStats]
               ) -> dict[tuple, float]:
    """CPU seconds so far of the control plane's processes: this driver, the queue, each live
    rollout worker (its latest report) and each engine actor."""
    return {("driver",): time.process_time(), ("queue",): queue.cpu_s,
            **{("worker", i): s.cpu_s for i, s in workers.items()},
            **{("engine", e): a.cpu_s for e, a in activity.items()}}


def step_metrics(before: Clocks, now: Clocks, waited_s: float, engine_concurrency: int) -> dict[str, float]:
    """Rates and shares over one step: samples aside, what the two clocks give (engines live at
    both ends only: a replacement's totals start at 0)."""
    elapsed = now.time - before.time
    both = [e for e in now.activity if e in before.activity]
    busy = sum(now.activity[e].busy_s - before.activity[e].busy_s for e in both)
    request_s = sum(now.activity[e].request_s - before.activity[e].request_s for e in both)
    engine_s = elapsed * max(1, len(both))
    return {"throughput/step_s": elapsed, "idle/trainer": waited_s / elapsed,
            "idle/engines": 1 - min(1.0, busy / engine_s),
            "util/engines": min(1.0, request_s / (engine_s * engine_concurrency)),
            **tool_call_validity(now.rollout, before.rollout), **control_plane_metrics(now.cpu, before.cpu, elapsed)}


def tool_call_validity(rollout: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """The share of the tool calls finished since `before` (both `rollout_metrics`, whose tool
    counts are totals) that had no error; nothing when no call finished."""
    def errors(m: dict[str, Any]) -> int:
        return sum(v for k, v in m.items() if k.startswith("rollout/tool_errors/"))

    calls = rollout["rollout/tool_calls"] - before.get("rollout/tool_calls", 0)
    if calls <= 0:
        return {}
    return {"rollout/tool_call_validity": 1 - (errors(rollout) - errors(before)) / calls}


def control_plane_metrics(cpu: dict[tuple, float], before: dict[tuple, float], step_s: float) -> dict[str, float]:
    """The CPU seconds each control-plane process spent in one step (`cpu_totals` at its two
    ends; a process that is new since, e.g. a replacement, is left out), and the busiest one's
    share of the step: what saturates first as a run grows."""
    spent = {k: v - before[k] for k, v in cpu.items() if k in before and v >= before[k]}
    roles = {role: [v for k, v in spent.items() if k[0] == role] for role in ("driver", "queue", "worker", "engine")}
    out = {f"control/{role}_cpu_s": max(vs) for role, vs in roles.items() if vs}
    if out:
        out["control/busiest_share"] = max(out.values()) / step_s
    return out


def eval_metrics(result: EvalResult, policy_version: int) -> dict[str, float]:
    """`eval/...` of one evaluation of the policy the engines held (`policy_version`)."""
    out = {"eval/greedy_accuracy": result.greedy_accuracy, "eval/seconds": result.seconds,
           "eval/policy_version": policy_version, "eval/num_problems": result.num_problems,
           # the versions its samples carry: [policy_version] for an evaluation of that policy
           "eval/sample_versions": list(result.versions), "eval/versions_spanned": len(result.versions)}
    out.update({f"eval/pass@{k}": v for k, v in result.pass_at_k.items()})
    if len(result.per_env) > 1:
        out.update({f"eval/{env}/{k}": v for env, m in result.per_env.items() for k, v in m.items()})
    return out


def gauges(m: dict[str, Any]) -> dict[str, float]:
    """The run's gauges on the Ray dashboard (asyncrl/monitoring/ray_metrics.py) from a step's metrics."""
    return {"asyncrl_policy_version": m.get("policy/version"), "asyncrl_staleness_max": m.get("train/staleness_max"),
            "asyncrl_samples_per_s": m.get("throughput/samples_per_s"),
            "asyncrl_trainer_idle_ratio": m.get("idle/trainer"), "asyncrl_engine_idle_ratio": m.get("idle/engines"),
            "asyncrl_engine_utilization": m.get("util/engines"),
            "asyncrl_reward_mean": m.get("batch/reward_mean")}

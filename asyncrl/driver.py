"""The driver: the one module that knows every actor. It reads like DESIGN.md's picture.

    prompts --admit--> RolloutWorkers --generate--> EngineActors
                           | finished groups
                           v
                      MessageQueue --get(B)--> Trainer ranks --broadcast--> EngineActors

setup():   Ray (embedded, or the running cluster under `ray job submit`), a placement
           group, the engines, the queue, the rollout workers, the trainer ranks, the
           weight-sync group; the base policy's held-out accuracy.
train():   admit prompts (staleness control) -> take B groups -> train step -> every k
           steps a weight sync (interrupt -> pause -> broadcast -> load -> resume ->
           resume interrupted loops) -> evaluate / checkpoint / log.
cleanup(): final evaluation, HF export, summary.json, every actor stopped (also on
           errors and Ctrl-C), the prompt ledger checked.

Faults (invariant 6): each step starts with a health check of the engines and rollout
workers. A dead engine is replaced in its placement-group bundle (its loops have already
moved to the live engines); it joins a new weight-broadcast group and is routed to once the
next sync gave it the policy. A dead rollout worker is replaced and every prompt it held
starts again from its prompt. A dead trainer rank restarts the trainer from the newest
checkpoint, and the whole run goes back to that checkpoint (see `_restart_trainer`). Each
fault is a `FaultEvent` (logged, counted in the metrics, listed in summary.json); past
`run.max_*_restarts` the run stops with one line saying why.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from asyncrl import actors
from asyncrl.agents.registry import build_agents
from asyncrl.clock import Clock
from asyncrl.config.schema import Config
from asyncrl.config.validate import latest_checkpoint
from asyncrl.evaluation import EvalResult, evaluate_with_workers
from asyncrl.messages import (
    EngineActivity,
    FaultEvent,
    PendingGroupState,
    QueueState,
    QueueStats,
    WorkerStats,
    error_line,
)
from asyncrl.metrics import length_histogram, reward_metrics
from asyncrl.monitoring.run_log import RunLog
from asyncrl.rollout.admission import PromptLedger, StalenessController
from asyncrl.sync.weight_sync import EnginesFailed, WeightSync
from asyncrl.trainer.batch import group_filter_reason
from asyncrl.trainer.safe_checkpoint import CheckpointRefused
from asyncrl.trainer.trainer_group import TrainerGroup, TrainerRankDied

logger = logging.getLogger(__name__)

# While the trainer waits for groups, the engines' and workers' health is checked this often.
WAIT_SLICE_S = 10.0


class TrainingError(RuntimeError):
    """A run that cannot go on (an actor died, an invariant broke); the message says why."""


@dataclass
class RunState:
    """The driver's own part of a checkpoint (run_state.json; the trainer saves its state, the
    queue its contents, the ledger its prompts beside it)."""

    step: int
    version: int
    samples: int
    admitted: int
    problem_stream: dict[str, Any]  # WeightedMultiTask.state()
    base_eval: EvalResult
    trained_prompts: list[str] = field(default_factory=list)  # in order (a prompt trained twice would show)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        d = json.loads(text)
        base = d.pop("base_eval")
        base["pass_at_k"] = {int(k): v for k, v in base["pass_at_k"].items()}  # JSON keys are strings
        return cls(**d, base_eval=EvalResult(**base))


class Driver:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.clock = Clock(cfg.cluster.time_scale)  # what the run reports: simulated seconds with sim backends
        self.version = 0  # policy version: weight syncs so far
        self.engine_version = 0  # the policy the engines hold (older with algorithm.policy_lag)
        self.step = 0
        self.samples = 0
        self.train_s = 0.0  # seconds in the training loop so far, periodic evaluations left out
        self.eval_s = 0.0  # seconds of periodic evaluations so far
        self._started = 0.0  # when the training loop started
        self.engines: list = []  # one per engine slot: the live engine, or its replacement while it starts
        self.routed: list = []  # the engine handles the workers route to (a replacement once it has weights)
        self._starting: dict[int, tuple[ray.ObjectRef, FaultEvent, float]] = {}  # slot -> replacement's start
        self.workers: list = []
        self.queue = None
        self.trainer: TrainerGroup | None = None
        self.sync: WeightSync | None = None
        self.placement = actors.Placement()
        self.base_eval: EvalResult | None = None
        self.final_eval: EvalResult | None = None
        self.log: RunLog | None = None
        self._started_ray = False
        a = cfg.algorithm
        self.staleness = StalenessController(a.max_staleness, a.prompts_per_step, a.sync_every_steps,
                                             policy_lag=a.policy_lag)
        self.ledger = PromptLedger()
        self.trained_prompts: list[str] = []
        self.faults: list[FaultEvent] = []
        self.restarts = collections.Counter()  # engine / rollout_worker / trainer -> replacements so far
        self.duplicates_dropped = 0  # groups of prompts already finished (a dead worker's late put)
        self._last_stats: dict[int, WorkerStats] = {}  # each worker's latest report
        self._retired_stats: list[WorkerStats] = []  # the last reports of replaced workers (their counts go on)
        # The previous step's clocks: time, each live engine's activity totals, rollout totals, and
        # each control-plane process's CPU seconds.
        self._last: tuple[float, dict[Any, EngineActivity], dict[str, Any], dict[tuple, float]] | None = None

    # == setup =========================================================================

    def setup(self) -> None:
        t0 = time.monotonic()
        cfg = self.cfg
        self.log = RunLog(cfg, self.run_dir)
        self._start_ray()
        self.placement = actors.place(cfg)
        nodes = self.placement.nodes()
        if len(set(nodes.values())) > 1:
            logger.info("placed on %d Ray nodes: %s", len(set(nodes.values())), nodes)
        logger.info("starting %d engine(s), %d rollout worker(s), %d trainer rank(s)", cfg.engine.num_engines,
                    cfg.rollout.num_workers, actors.trainer_world_size(cfg))
        self.engines = actors.create_engines(cfg, self.placement.engine)
        self.routed = list(self.engines)
        engine_start = [e.start.remote() for e in self.engines]
        self.trainer = actors.create_trainer(cfg, self.placement.trainer)
        trainer_info = self.trainer.setup()  # the trainer loads while the engines start
        for i, info in enumerate(ray.get(engine_start)):
            logger.info("engine-%d: started in %.0fs, %.2f GiB resident, on cores %s, processes %s", i,
                        info.start_s, info.rss_gib, info.cpu_cores, info.vllm_processes)
        self.queue = actors.create_queue(cfg)
        self.workers = actors.create_rollout_workers(cfg, self.routed, self.queue, self.placement.worker)
        self.sync = actors.create_weight_sync(cfg, self.trainer, self.engines)
        self.sync.connect()

        self.agents = build_agents(cfg)  # the environments: problems (mixed by weight) and evaluation
        self.heldout = self.agents.heldout(cfg.eval.num_problems)
        if cfg.run.resume_from:
            path = Path(cfg.run.resume_from)
            if cfg.run.resume_from == "latest":
                path = latest_checkpoint(self.run_dir)
                if path is None:
                    raise TrainingError(f"run.resume_from=latest: no checkpoint in {self.run_dir / 'checkpoints'}")
            t1 = time.monotonic()
            event = FaultEvent("run", "driver", 0, f"resumed from {path}")
            event.loops_resumed, event.prompts_restarted, kept = self._load_checkpoint(path)
            event.step = self.step
            event.phases_s = {"setup_s": t1 - t0, "load_checkpoint_s": time.monotonic() - t1}
            logger.info("resumed in %.0fs; %d loops continue holding %d tokens", event.recovery_s,
                        event.loops_resumed, kept)
            self._record(event)
            return
        logger.info("ready in %.0fs (trainer: %s); evaluating the base policy", time.monotonic() - t0, trainer_info)
        self.base_eval = self._evaluate(with_pass_k=True)
        logger.info("base policy: %s", self.base_eval.summary())
        self.log.log(0, {**self._eval_metrics(self.base_eval), "setup_s": time.monotonic() - t0})

    def _start_ray(self) -> None:
        address = self.cfg.cluster.address or os.environ.get("RAY_ADDRESS", "")
        if ray.is_initialized():
            return
        if address:  # `ray job submit` or an explicit cluster: join it
            ray.init(address=address, log_to_driver=True)
        else:  # "local": a cluster of our own, even where `ray start` left one running
            ray.init(address="local", num_cpus=self.cfg.cluster.num_cpus, num_gpus=self.cfg.cluster.num_gpus or None,
                     include_dashboard=self.cfg.cluster.dashboard, log_to_driver=True)
            self._started_ray = True

    # == train =========================================================================

    def train(self) -> None:
        cfg = self.cfg
        self._admit()
        self._started = self.clock.now()
        activity = self._engine_activity()
        self._last = (self._started, activity, {}, self._cpu_totals(activity, ray.get(self.queue.stats.remote())))
        while self.step < cfg.trainer.total_steps:
            if cfg.run.max_train_s and self.train_s >= cfg.run.max_train_s:
                logger.info("run.max_train_s=%g reached after %d steps", cfg.run.max_train_s, self.step)
                break
            try:
                self._check_health()
                self._train_step()
            except TrainerRankDied as e:
                self._restart_trainer(str(e))
            self.train_s = self.clock.now() - self._started - self.eval_s

    def _train_step(self) -> None:
        """One step: B groups -> train -> (sync) -> admit -> metrics, evaluation, checkpoint."""
        cfg, t = self.cfg, self.cfg.trainer
        self.step += 1
        step = self.step
        t_wait = self.clock.now()
        groups, stale = self._next_batch()
        waited = self.clock.now() - t_wait
        result = self.trainer.train_step(groups, self.version)
        self._check_staleness(result.staleness_max)
        metrics: dict[str, Any] = dict(result.metrics)
        trained = []
        for g in groups:
            reason = group_filter_reason(g, cfg.algorithm.loss)
            self.ledger.finish(g.prompt_id, "filtered" if reason else "trained", reason or "")
            if not reason:
                self.trained_prompts.append(g.prompt_id)
                trained.append(g)
        # What a staleness rule or a filter leaves out shows as a difference between the two.
        metrics["length/finished_hist"] = length_histogram([*groups, *stale])
        metrics["length/trained_hist"] = length_histogram(trained)
        metrics.update(reward_metrics(groups))  # a verl reward function's extra keys, over the step's samples
        step_samples = sum(len(g.trajectories) for g in groups)
        if len(self.agents.weights) > 1:  # the multi-task mix as trained
            metrics.update({f"batch/groups/{env}": n for env, n in
                            collections.Counter(g.env_id for g in groups).items()})
        self.samples += step_samples
        if step % cfg.algorithm.sync_every_steps == 0:
            metrics.update(self._sync())
        self._admit()
        last_time, last_activity, last_rollout, last_cpu = self._last
        now, activity, rollout = self.clock.now(), self._engine_activity(), self._rollout_metrics()
        queue_stats = ray.get(self.queue.stats.remote())
        cpu = self._cpu_totals(activity, queue_stats)
        elapsed = now - last_time
        # Over the engines live at both ends of the step (a replacement's totals start at 0).
        both = [e for e in activity if e in last_activity]
        busy = sum(activity[e].busy_s - last_activity[e].busy_s for e in both)
        request_s = sum(activity[e].request_s - last_activity[e].request_s for e in both)
        engine_s = elapsed * max(1, len(both))
        metrics.update({
            "policy/version": self.version, "batch/dropped_stale": len(stale),
            "batch/duplicates_dropped": self.duplicates_dropped,
            "throughput/samples_per_s": step_samples / elapsed,
            "throughput/step_s": elapsed, "idle/trainer": waited / elapsed,
            "idle/engines": 1 - min(1.0, busy / engine_s),
            "util/engines": min(1.0, request_s / (engine_s * actors.engine_concurrency(cfg))),
            "progress/samples": self.samples, "progress/admitted": self.staleness.admitted,
            **rollout, **tool_call_validity(rollout, last_rollout), **queue_stats.metrics(),
            **self._fault_metrics(), **control_plane_metrics(cpu, last_cpu, elapsed),
            "progress/train_s": now - self._started - self.eval_s,  # the clock of run.max_train_s
        })
        self._last = (now, activity, rollout, cpu)
        if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < t.total_steps:
            metrics.update(self._eval_metrics(self._evaluate(with_pass_k=cfg.eval.periodic_pass_k)))
            self.eval_s += self.clock.now() - now
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
            self.save_checkpoint()
        self.log.log(step, metrics)
        self.queue.report.remote(_gauges(metrics))

    def _next_batch(self) -> tuple[list, list]:
        """B groups from the queue, and those it dropped as stale: groups staler than eta are dropped
        so that no trained token ever exceeds the bound, and so is a group whose prompt is no
        longer running (a dead worker's group that reached the queue after its prompt was
        restarted; counted in duplicates_dropped)."""
        b = self.cfg.algorithm.prompts_per_step
        timeout = self.cfg.trainer.dist_timeout_s
        deadline = time.monotonic() + timeout
        while True:  # a health check every WAIT_SLICE_S: the prompts of a dead worker would never come
            try:
                groups = ray.get(self.queue.get.remote(b, self.version, min(WAIT_SLICE_S, timeout)))
                break
            except (TimeoutError, ray.exceptions.RayTaskError) as e:
                if not isinstance(e, TimeoutError) and not isinstance(getattr(e, "cause", None), TimeoutError):
                    raise
            if time.monotonic() >= deadline:
                raise TrainingError(f"waited {timeout:g}s (trainer.dist_timeout_s) for {b} trajectory groups; "
                                    f"rollout: {self._rollout_metrics()}")
            self._check_health()
        fresh, stale = [], []
        for g in groups:
            if self.ledger.states.get(g.prompt_id) != "running":
                self.duplicates_dropped += 1
                logger.warning("dropped group %s: its prompt is %s already", g.group_id,
                               self.ledger.states.get(g.prompt_id))
            elif self.staleness.is_fresh(g, self.version):
                fresh.append(g)
            else:
                stale.append(g)
                self.ledger.finish(g.prompt_id, "filtered", "stale")
        return fresh, stale

    def _check_staleness(self, staleness_max: int) -> None:
        eta = self.cfg.algorithm.max_staleness
        if staleness_max > eta:
            raise TrainingError(f"invariant broken: a trained token is {staleness_max} versions old, "
                                f"algorithm.max_staleness={eta}")

    def _admit(self) -> None:
        """Start as many new prompts as staleness control allows, spread over the workers."""
        room = self.staleness.admissible(self.version)
        all_rejected = 0
        while room > 0:
            problems = [self.agents.next_problem() for _ in range(room)]
            accepted = sum(self._spread("submit", problems))
            rejected = self._rejected_prompts()
            for p in problems:
                self.ledger.admit(p.prompt_id)
                if p.prompt_id in rejected:
                    self.ledger.finish(p.prompt_id, "failed", rejected[p.prompt_id].code)
            self.staleness.on_admitted(accepted, self.version)
            room = self.staleness.admissible(self.version)
            all_rejected = all_rejected + 1 if accepted == 0 else 0
            if all_rejected == 3:  # the data (or the config) cannot produce a single usable prompt
                reasons = collections.Counter(f.code for f in rejected.values())
                raise TrainingError(f"the rollout workers rejected every prompt of 3 admissions in a row "
                                    f"({dict(reasons)}); e.g. {next(iter(rejected.values()), '')}")

    def _worker_stats(self) -> list[WorkerStats]:
        """Every live worker's report, then the last reports of the workers they replaced."""
        stats = self._on_workers("get_stats")
        self._last_stats = dict(enumerate(stats))
        return stats + self._retired_stats

    def _rejected_prompts(self) -> dict[str, Any]:
        """prompt id -> Failure, for every row a live worker refused."""
        return {pid: f for stats in self._on_workers("get_stats") for pid, f in stats.failed_prompts.items()}

    def _sync(self) -> dict[str, float]:
        """interrupt loops -> pause engines -> broadcast -> load -> resume -> resume loops. An
        engine that dies meanwhile is replaced and the sync done again, with its replacement."""
        a = self.cfg.algorithm
        self._check_health()  # a dead member would stall the broadcast
        if not a.partial_rollout:  # finish what is generating under the old weights first
            self._on_workers("drain")
        if a.pause_mode == "abort":
            self._on_workers("interrupt")
        try:
            timings = self.sync.sync(self.version + 1, a.pause_mode)
        except EnginesFailed as e:
            self.trainer.check_alive()  # a dead trainer rank fails every engine's receive: that is the fault then
            waiting = "left waiting in a broadcast that cannot complete"
            slots = {self._slot_of(self.sync.engines[k]): why for k, why in
                     [*e.failed.items(), *((k, waiting) for k in e.stuck)]}
            for i, why in slots.items():
                self._replace_engine(i, why)
            self._reform_weight_group()
            if not self.live_engines():
                self._poll_starting(block=True)
            logger.warning("%s; syncing again without engine(s) %s", e, sorted(slots))
            timings = self.sync.sync(self.version + 1, a.pause_mode)
        self.version += 1
        self.engine_version = timings.engine_version
        self._route_joined_engines()
        metrics = timings.metrics()
        if a.pause_mode == "abort":
            metrics["sync/resumed_loops"] = sum(self._on_workers("resume_interrupted"))
        return metrics

    def _newest_policy_to_engines(self) -> None:
        """With algorithm.policy_lag the engines hold an older policy than the trainer: the final
        evaluation is of the trainer's (the policy the run trained)."""
        if self.engine_version == self.version:
            return
        abort = self.cfg.algorithm.pause_mode == "abort"
        if abort:
            self._on_workers("interrupt")
        self.engine_version = self.sync.sync(self.version, self.cfg.algorithm.pause_mode, newest=True).engine_version
        if abort:
            self._on_workers("resume_interrupted")

    def _slot_of(self, engine: Any) -> int:
        return next(i for i, e in enumerate(self.engines) if e is engine)

    def live_engines(self) -> list:
        """The engines serving now (replacements still starting left out)."""
        return [e for i, e in enumerate(self.engines) if i not in self._starting]

    def _engine_activity(self) -> dict[Any, EngineActivity]:
        """Each live engine's activity totals, by its handle."""
        try:
            engines = self.live_engines()
            each = ray.get([e.activity.remote() for e in engines])
        except ray.exceptions.RayActorError:
            self._check_health()
            engines = self.live_engines()
            each = ray.get([e.activity.remote() for e in engines])
        return dict(zip(engines, each))

    def _cpu_totals(self, activity: dict[Any, EngineActivity], queue: QueueStats) -> dict[tuple, float]:
        """CPU seconds so far of the control plane's processes: this driver, the queue, each live
        rollout worker (as of the latest `_worker_stats`) and each engine actor."""
        return {("driver",): time.process_time(), ("queue",): queue.cpu_s,
                **{("worker", i): s.cpu_s for i, s in self._last_stats.items()},
                **{("engine", e): a.cpu_s for e, a in activity.items()}}

    def _rollout_metrics(self) -> dict[str, Any]:
        stats = self._worker_stats()
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
        out.update({f"rollout/tool_errors/{reason}": n for reason, n in tool_errors.items()})
        return out

    def _evaluate(self, with_pass_k: bool) -> EvalResult:
        return evaluate_with_workers(self.cfg, self.workers, self.agents, self.heldout, with_pass_k=with_pass_k)

    def _eval_metrics(self, result: EvalResult) -> dict[str, float]:
        out = {"eval/greedy_accuracy": result.greedy_accuracy, "eval/seconds": result.seconds,
               "eval/policy_version": self.engine_version}
        out.update({f"eval/pass@{k}": v for k, v in result.pass_at_k.items()})
        if len(result.per_env) > 1:
            out.update({f"eval/{env}/{k}": v for env, m in result.per_env.items() for k, v in m.items()})
        return out

    # == faults ==========================================================================

    def _on_workers(self, method: str, per_worker: list[tuple] | None = None) -> list:
        """`method` on every rollout worker (with `per_worker[i]` as worker i's arguments); a worker
        found dead is replaced (`_check_health`) and the call made on its replacement."""
        calls = per_worker or [()] * len(self.workers)
        refs = [getattr(w, method).remote(*args) for w, args in zip(self.workers, calls)]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                self._check_health()
                out.append(ray.get(getattr(self.workers[i], method).remote(*calls[i])))
        return out

    def _spread(self, method: str, items: list, *also: list) -> list:
        """`method` on every worker with its share of `items` (and the same share of each list in
        `also`), dealt round-robin."""
        n = len(self.workers)
        return self._on_workers(method, per_worker=[(items[k::n], *(x[k::n] for x in also)) for k in range(n)])

    def _held_prompts(self) -> tuple[set[str], set[str]]:
        """The prompts whose groups the workers hold, and those queued. Workers first, then the
        queue: a group moving from one to the other meanwhile is seen twice rather than missed
        (it leaves a worker only once it is queued)."""
        in_workers = {p for ps in self._on_workers("pending_prompts") for p in ps}
        return in_workers, set(ray.get(self.queue.prompt_ids.remote()))

    def _check_health(self) -> bool:
        """Ask every engine and rollout worker whether it is alive (a hung one does not answer
        within run.health_timeout_s); replace the dead. Returns whether any was replaced."""
        timeout = self.cfg.run.health_timeout_s
        self._poll_starting()
        probes = [("engine", i, e.health.remote()) for i, e in enumerate(self.engines) if i not in self._starting]
        probes += [("rollout_worker", i, w.get_stats.remote()) for i, w in enumerate(self.workers)]
        ready, _ = ray.wait([ref for *_, ref in probes], num_returns=len(probes), timeout=timeout)
        dead = []
        for kind, i, ref in probes:
            if ref not in ready:
                dead.append((kind, i, f"no answer to a health check within {timeout:g}s (run.health_timeout_s)"))
                continue
            try:
                answer = ray.get(ref)
            except Exception as e:
                dead.append((kind, i, error_line(e)))
                continue
            if kind == "rollout_worker":
                self._last_stats[i] = answer
        engines = [i for kind, i, _ in dead if kind == "engine"]
        for kind, i, why in dead:
            if kind == "engine":
                self._replace_engine(i, why)
        if engines:
            self._reform_weight_group()  # the old group counts the dead engines' workers: a broadcast would hang
            if not self.live_engines():  # nothing can generate: wait for a replacement
                self._poll_starting(block=True)
        for kind, i, why in dead:
            if kind == "rollout_worker":
                self._replace_worker(i, why)
        return bool(dead)

    def _count_restart(self, kind: str, limit: int, why: str) -> None:
        if self.restarts[kind] >= limit:
            raise TrainingError(f"{kind.replace('_', ' ')} failed ({why}) after {self.restarts[kind]} "
                                f"replacement(s): run.max_{'worker' if kind == 'rollout_worker' else kind}_restarts"
                                f"={limit} reached")
        self.restarts[kind] += 1

    def _replace_engine(self, i: int, why: str) -> None:
        """Start a new engine in the dead one's bundle. The run goes on meanwhile (the dead one's
        loops already moved to the live engines); `_poll_starting` takes it in once started."""
        self._count_restart("engine", self.cfg.run.max_engine_restarts, why)
        logger.warning("engine-%d failed: %s; starting a replacement", i, why)
        t0 = time.monotonic()
        try:  # what is left of its vLLM processes stops with it
            ray.get(self.engines[i].shutdown.remote(), timeout=10)
        except Exception:  # dead, or hung
            pass
        _kill(self.engines[i])
        self.engines[i] = actors.create_engine(self.cfg, i, actors.slot(self.placement.engine, i),
                                               restart=self.restarts["engine"])
        self._starting[i] = (self.engines[i].start.remote(), FaultEvent("engine", f"engine-{i}", self.step, why), t0)

    def _poll_starting(self, block: bool = False) -> None:
        """Take in the replacement engines that have started (with `block`, wait for one): a new
        weight-broadcast group with them; the workers route to them once a sync gave them the policy."""
        if not self._starting:
            return
        refs = {ref: i for i, (ref, _, _) in self._starting.items()}
        ready, _ = ray.wait(list(refs), num_returns=1 if block else len(refs), timeout=None if block else 0)
        for ref in ready:
            i = refs[ref]
            _, event, t0 = self._starting.pop(i)
            try:
                ray.get(ref)
            except Exception as e:
                raise TrainingError(f"engine-{i}'s replacement failed to start: {error_line(e)}") from None
            event.phases_s["start_engine_s"] = time.monotonic() - t0
            t1 = time.monotonic()
            self._reform_weight_group()
            event.phases_s["weight_group_s"] = time.monotonic() - t1
            self._record(event)

    def _reform_weight_group(self) -> None:
        """A new broadcast group of the trainer and the live engines."""
        self.sync.engines = self.live_engines()
        self.sync.connect()

    def _route_joined_engines(self) -> None:
        """After a sync every engine holds the policy: replacements join the workers' routing."""
        for i, engine in enumerate(self.engines):
            if self.routed[i] is not engine and i not in self._starting:
                self.routed[i] = engine
                self._on_workers("replace_engine", per_worker=[(i, engine)] * len(self.workers))
                logger.info("engine-%d's replacement holds version %d: routed to", i, self.version)

    def _replace_worker(self, i: int, why: str) -> None:
        """A new worker in the dead one's bundle; every prompt the dead one held starts again."""
        self._count_restart("rollout_worker", self.cfg.run.max_worker_restarts, why)
        event = FaultEvent("rollout_worker", f"rollout-worker-{i}", self.step, why)
        logger.warning("rollout-worker-%d failed: %s; starting a replacement", i, why)
        t0 = time.monotonic()
        _kill(self.workers[i])
        last = self._last_stats.pop(i, None)
        if last is not None:
            self._retired_stats.append(last)
            event.tokens_lost = last.pending_tokens
        self.workers[i] = actors.create_rollout_worker(self.cfg, i, self.routed, self.queue,
                                                       actors.slot(self.placement.worker, i),
                                                       restart=self.restarts["rollout_worker"])
        ray.get(self.workers[i].get_stats.remote())  # constructed
        t1 = time.monotonic()
        held, queued = self._held_prompts()
        lost = sorted(self.ledger.running() - held - queued)
        self._spread("submit", [self.agents.problem_by_id(p) for p in lost])
        event.prompts_restarted = len(lost)
        event.phases_s = {"start_worker_s": t1 - t0, "restart_prompts_s": time.monotonic() - t1}
        self._record(event)

    def _restart_trainer(self, why: str) -> None:
        """A trainer rank died: new ranks in the same bundles load the newest checkpoint, and the
        whole run goes back to it. The stated rule: what was generated or trained after that
        checkpoint is thrown away (rollout workers and queue are restarted too), and the
        checkpoint's queue, ledger, problem stream and loop snapshots take over; the engines get the
        checkpoint's weights. So no token is newer than the restored policy, the staleness
        bound holds, and no prompt is lost or trained twice in the final policy."""
        self._count_restart("trainer", self.cfg.run.max_trainer_restarts, why)
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise TrainingError(f"{why}; this run has no checkpoint to restart from "
                                "(set trainer.checkpoint_every)")
        event = FaultEvent("trainer", "trainer", self.step, why)
        logger.warning("%s; restarting the trainer from %s", why, path)
        n = self.restarts["trainer"]
        t0 = time.monotonic()
        for actor in [*self.trainer.ranks, *self.workers, self.queue]:  # live ranks may wait on the dead one
            _kill(actor)
        self._retired_stats += list(self._last_stats.values())
        self.trainer = actors.create_trainer(self.cfg, self.placement.trainer, restart=n)
        self.trainer.setup()
        t1 = time.monotonic()
        self.queue = actors.create_queue(self.cfg, restart=n)
        self.workers = actors.create_rollout_workers(self.cfg, self.routed, self.queue, self.placement.worker,
                                                     restart=self.restarts["rollout_worker"] + n)
        self._last_stats.clear()
        self.sync = actors.create_weight_sync(self.cfg, self.trainer, self.live_engines())
        self.sync.connect()
        t2 = time.monotonic()
        failed_at = self.step
        event.loops_resumed, event.prompts_restarted, _ = self._load_checkpoint(path)
        event.phases_s = {"start_trainer_s": t1 - t0, "workers_and_weight_group_s": t2 - t1,
                          "load_checkpoint_s": time.monotonic() - t2}
        logger.warning("trainer restarted: back at step %d from step %d", self.step, failed_at)
        self._record(event)

    def _record(self, event: FaultEvent) -> None:
        """Log the event, count it, and append it to RUN_DIR/faults.jsonl (kept across resumes)."""
        self.faults.append(event)
        with open(self.run_dir / "faults.jsonl", "a") as f:
            f.write(json.dumps(event.to_dict()) + "\n")
        logger.warning("recovered from a %s fault (%s) in %.1fs: %s", event.kind, event.actor, event.recovery_s,
                       {k: round(v, 2) for k, v in event.phases_s.items()})

    def _fault_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {f"faults/{kind}": n for kind, n in self.restarts.items()}
        if self.faults:
            out["faults/last_recovery_s"] = self.faults[-1].recovery_s
        return out

    # == checkpoints and the end ===========================================================

    def _take_snapshots(self) -> tuple[list[PendingGroupState], QueueState]:
        """Every running loop's snapshot and the queue's contents, at one instant: the workers
        stop their loops, the engines pause (abort: requests return what they generated), the
        workers hand over their unfinished groups, the queue its groups; then all go on."""
        self._on_workers("interrupt")
        paused = []
        for engine, ref in [(e, e.pause.remote("abort")) for e in self.live_engines()]:
            try:
                ray.get(ref)
                paused.append(engine)
            except Exception as e:  # died since the last health check: replaced below; its loops went on
                logger.warning("an engine failed while pausing for a checkpoint: %s", error_line(e))
        pending = [g for groups in self._on_workers("checkpoint") for g in groups]
        queue_state: QueueState = ray.get(self.queue.state.remote())
        ray.get([e.resume.remote() for e in paused])
        self._on_workers("resume_interrupted")
        if len(paused) < len(self.live_engines()):
            self._check_health()
        return pending, queue_state

    def save_checkpoint(self) -> str:
        """Trainer state (megatron dist checkpoint), queue contents, loop snapshots, prompt ledger,
        the driver's state (run_state.json, written last: it marks the checkpoint complete)."""
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        pending, queue_state = self._take_snapshots()
        state = RunState(step=self.step, version=self.version, samples=self.samples,
                         admitted=self.staleness.admitted, problem_stream=self.agents.state(), base_eval=self.base_eval,
                         trained_prompts=list(self.trained_prompts))
        self.trainer.save_checkpoint(str(path))
        self.trainer.export_hf(str(path / "hf"))  # `asyncrl eval CHECKPOINT` reads this
        (path / "queue.json").write_text(json.dumps(queue_state.to_dict()))
        (path / "loops.json").write_text(json.dumps([g.to_dict() for g in pending]))
        (path / "ledger.json").write_text(json.dumps({"states": self.ledger.states,
                                                      "reasons": dict(self.ledger.reasons)}))
        (path / "run_state.json").write_text(json.dumps(asdict(state)))
        logger.info("checkpoint: %s (%d groups queued, %d unfinished with %d loop snapshots)", path,
                    len(queue_state.groups), len(pending), sum(len(g.snapshots) for g in pending))
        return str(path)

    def _load_checkpoint(self, path: Path) -> tuple[int, int, int]:
        """Continue from `save_checkpoint`'s directory (`run.resume_from`, or a trainer restart):
        every loop it holds goes on from its snapshot; a prompt that was running but is in
        neither the queue nor a snapshot (a remote agent's group) starts again from its prompt.
        Returns the loops resumed, the prompts restarted and the generated tokens kept."""
        state = RunState.from_json((path / "run_state.json").read_text())
        try:
            trainer_step = self.trainer.load_checkpoint(str(path))
        except CheckpointRefused as e:  # Ray's wrapper adds the rank's traceback: keep the one line
            raise CheckpointRefused(str(getattr(e, "cause", e))) from None
        if trainer_step != state.step:
            raise TrainingError(f"{path}: the trainer's state is of step {trainer_step}, the run's of {state.step}")
        self.step, self.version, self.samples = state.step, state.version, state.samples
        self.staleness.admitted = state.admitted
        self.agents.restore(state.problem_stream)
        self.base_eval = state.base_eval
        self.trained_prompts = list(state.trained_prompts)
        queue_state = QueueState.from_dict(json.loads((path / "queue.json").read_text()))
        ray.get(self.queue.restore.remote(queue_state))
        ledger = json.loads((path / "ledger.json").read_text())
        self.ledger = PromptLedger(ledger["states"], collections.Counter(ledger["reasons"]))
        # The engines get the restored weights (a policy lag starts again from them).
        self.engine_version = self.sync.sync(self.version, self.cfg.algorithm.pause_mode, newest=True).engine_version
        self._route_joined_engines()
        loops_file = path / "loops.json"
        pending = [PendingGroupState.from_dict(g) for g in json.loads(loops_file.read_text())] \
            if loops_file.is_file() else []
        self._spread("restore", pending, [self.agents.problem_by_id(g.prompt_id) for g in pending])
        queued = {g.prompt_id for g in queue_state.groups}
        restart = [self.agents.problem_by_id(p)
                   for p in sorted(self.ledger.running() - queued - {g.prompt_id for g in pending})]
        if restart:
            self._spread("submit", restart)
        for prompt_id, failure in self._rejected_prompts().items():  # refused now (e.g. a smaller context)
            if self.ledger.states.get(prompt_id) == "running":
                self.ledger.finish(prompt_id, "failed", failure.code)
        loops, kept = sum(len(g.snapshots) for g in pending), sum(g.generated_tokens() for g in pending)
        logger.info("resumed from %s: step %d, version %d, %d groups queued, %d loops continue from their "
                    "snapshots (%d tokens kept), %d prompts restarted", path, self.step, self.version, len(queued),
                    loops, kept, len(restart))
        return loops, len(restart), kept

    def finish(self, wall_start: float) -> dict[str, Any]:
        """Final evaluation (with pass@k), HF export, summary.json."""
        while self._starting:  # a replacement engine still starting: the run ends with it in
            self._poll_starting(block=True)
        self._newest_policy_to_engines()
        self.final_eval = self._evaluate(with_pass_k=True)
        self.log.log(self.step, self._eval_metrics(self.final_eval))
        export = self.trainer.export_hf(str(self.run_dir / "final_policy"))
        if self.cfg.trainer.checkpoint_every:
            self.save_checkpoint()
        summary = {
            "recipe": self.cfg.recipe.name, "base_accuracy": self.base_eval.greedy_accuracy,
            "final_accuracy": self.final_eval.greedy_accuracy,
            "base_pass_at_k": self.base_eval.pass_at_k, "final_pass_at_k": self.final_eval.pass_at_k,
            "wall_s": time.monotonic() - wall_start, "train_s": self.train_s, "steps": self.step,
            "samples": self.samples,
            "policy_version": self.version, "final_policy": export, "metrics": str(self.log.path),
            "prompts": self.ledger_counts(), "max_staleness": self.cfg.algorithm.max_staleness,
            "prompts_trained_twice": len(self.trained_prompts) - len(set(self.trained_prompts)),
            "duplicates_dropped": self.duplicates_dropped,
            "faults": [f.to_dict() for f in self.faults],
            "placement": self.placement.nodes(),  # actor -> the Ray node its bundle is on
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if summary["prompts"]["lost"]:
            raise TrainingError(f"invariant broken: {summary['prompts']['lost']} prompts lost (summary.json)")
        return summary

    def ledger_counts(self) -> dict[str, int]:
        """Every admitted prompt in exactly one state; running ones are where the workers and queue say."""
        counts = self.ledger.counts()
        running = self.ledger.running()
        in_workers, in_queue = self._held_prompts()
        unaccounted = running - in_queue - in_workers
        if unaccounted:
            logger.error("invariant broken: %d running prompts are neither queued nor in a worker, e.g. %s",
                         len(unaccounted), sorted(unaccounted)[:3])
        counts.update({"queued": len(running & in_queue), "in_workers": len(running - in_queue - unaccounted),
                       "lost": len(unaccounted), "admitted": len(self.ledger.states)})
        return counts

    def cleanup(self) -> None:
        """Stop every actor we started (rollout workers, then engines: their vLLM processes), then
        Ray if embedded."""
        if self.log is not None:
            self.log.close()
        if not ray.is_initialized():
            return
        # The run is over: loops still generating would only fail, one traceback each, as their engine goes.
        for w in self.workers:
            _kill(w)
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception as err:  # a dead engine cannot shut down; it is killed below
                logger.warning("engine shutdown: %s", error_line(err))
        if self.trainer is not None:
            self.trainer.shutdown()
        for actor in [*self.engines, *([self.queue] if self.queue else [])]:
            _kill(actor)
        actors.remove_placement(self.placement)
        if self._started_ray:
            ray.shutdown()


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # already gone
        pass



def tool_call_validity(rollout: dict[str, Any], before: dict[str, Any]) -> dict[str, float]:
    """The share of the tool calls finished since `before` (both `_rollout_metrics`, whose tool
    counts are totals) that had no error; nothing when no call finished."""
    def errors(m: dict[str, Any]) -> int:
        return sum(v for k, v in m.items() if k.startswith("rollout/tool_errors/"))

    calls = rollout["rollout/tool_calls"] - before.get("rollout/tool_calls", 0)
    if calls <= 0:
        return {}
    return {"rollout/tool_call_validity": 1 - (errors(rollout) - errors(before)) / calls}


def control_plane_metrics(cpu: dict[tuple, float], before: dict[tuple, float], step_s: float) -> dict[str, float]:
    """The CPU seconds each control-plane process spent in one step (`_cpu_totals` at its two
    ends; a process that is new since, e.g. a replacement, is left out), and the busiest one's
    share of the step: what saturates first as a run grows."""
    spent = {k: v - before[k] for k, v in cpu.items() if k in before and v >= before[k]}
    roles = {role: [v for k, v in spent.items() if k[0] == role] for role in ("driver", "queue", "worker", "engine")}
    out = {f"control/{role}_cpu_s": max(vs) for role, vs in roles.items() if vs}
    if out:
        out["control/busiest_share"] = max(out.values()) / step_s
    return out


def _gauges(m: dict[str, Any]) -> dict[str, float]:
    return {"asyncrl_policy_version": m.get("policy/version"), "asyncrl_staleness_max": m.get("train/staleness_max"),
            "asyncrl_samples_per_s": m.get("throughput/samples_per_s"),
            "asyncrl_trainer_idle_ratio": m.get("idle/trainer"), "asyncrl_engine_idle_ratio": m.get("idle/engines"),
            "asyncrl_engine_utilization": m.get("util/engines"),
            "asyncrl_reward_mean": m.get("batch/reward_mean")}


def run_training(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """setup -> train -> finish, with cleanup on success, on errors and on Ctrl-C."""
    wall_start = time.monotonic()
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        driver.train()
        return driver.finish(wall_start)
    except Exception as e:  # said before the cleanup, which may take a while (engines shut down)
        logger.error("the run stops: %s; stopping its actors", error_line(e))
        raise
    finally:
        driver.cleanup()

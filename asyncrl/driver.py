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

The control plane is in asyncrl/control/: the engine and worker pools, the `Supervisor` that
replaces their dead (invariant 6; a dead trainer rank is `_restart_trainer`'s), `Prompts`
(admission and the ledger), `Elastic` (growing and shrinking the engines).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import ray

from asyncrl import actors
from asyncrl.agents.registry import build_agents
from asyncrl.clock import Clock
from asyncrl.config.schema import Config
from asyncrl.config.validate import latest_checkpoint
from asyncrl.control import TrainingError, kill
from asyncrl.control.elastic import Elastic
from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.periodic_eval import PeriodicEvaluation
from asyncrl.control.prompts import Prompts
from asyncrl.control.run_checkpoint import RunCheckpoint, RunState, drop_untrainable, take_snapshots
from asyncrl.control.service_pool import ServicePool
from asyncrl.control.step_metrics import (
    Clocks,
    batch_metrics,
    cpu_totals,
    eval_metrics,
    gauges,
    rollout_metrics,
    step_metrics,
)
from asyncrl.control.supervisor import Supervisor
from asyncrl.control.weight_sync import EnginesFailed
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.evaluation import EvalResult, evaluate_with_workers
from asyncrl.interfaces import QueueHandle
from asyncrl.messages import ControlRequest, FaultEvent, QueueStats, error_line
from asyncrl.monitoring.run_log import RunLog, eval_overlap
from asyncrl.rollout.trust import model_limits
from asyncrl.trainer.safe_checkpoint import CheckpointRefused
from asyncrl.trainer.trainer_group import TrainerGroup, TrainerRankDied

__all__ = ["Driver", "TrainingError", "run_training"]

logger = logging.getLogger(__name__)


class Driver:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.clock = Clock(cfg.cluster.time_scale)  # what the run reports: simulated seconds with sim backends
        self.version = 0  # policy version: weight syncs so far
        self.engine_version = 0  # the policy the engines hold (older with algorithm.policy_lag)
        self.step, self.samples = 0, 0
        self.train_s = 0.0  # seconds in the training loop so far, the waits for periodic evaluations left out
        self.eval_s = 0.0  # seconds training waited for periodic evaluations
        self._started = 0.0  # when the training loop started
        self.engines: EnginePool | None = None
        self.services: ServicePool | None = None
        self.workers: WorkerPool | None = None
        self.supervisor: Supervisor | None = None
        self.elastic: Elastic | None = None
        self.control: actors.RunControlHandle | None = None
        self.stop_requested = False  # `asyncrl stop`: the run ends after this step
        self.queue: QueueHandle | None = None
        self.trainer: TrainerGroup | None = None
        self.placement = actors.Placement()
        self.base_eval: EvalResult | None = None
        self.log: RunLog | None = None
        self._started_ray = False
        self.prompts: Prompts | None = None
        self.evals: PeriodicEvaluation | None = None
        self._last: Clocks | None = None  # the previous step's clocks

    # == setup =========================================================================

    def setup(self) -> None:
        t0 = time.monotonic()
        cfg = self.cfg
        self.log = RunLog(cfg, self.run_dir)
        self._started_ray = actors.start_ray(cfg)
        self.placement = actors.place(cfg)
        nodes = self.placement.nodes()
        if len(set(nodes.values())) > 1:
            logger.info("placed on %d Ray nodes: %s", len(set(nodes.values())), nodes)
        logger.info("starting %d engine(s), %d rollout worker(s), %d trainer rank(s)", cfg.engine.num_engines,
                    cfg.rollout.num_workers, actors.trainer_world_size(cfg))
        self.engines = EnginePool(cfg, self.placement.engine)
        engine_start = self.engines.start()
        self.trainer = actors.create_trainer(cfg, self.placement.trainer)
        trainer_info = self.trainer.setup()  # the trainer loads while the engines start
        for i, info in enumerate(ray.get(engine_start)):
            logger.info("engine-%d: started in %.0fs, %.2f GiB resident, on cores %s, processes %s", i,
                        info.start_s, info.rss_gib, info.cpu_cores, info.vllm_processes)
        self.queue = actors.create_queue(cfg)
        self.services = ServicePool(cfg, self.placement.services)  # reward models, judges, a teacher
        self.workers = WorkerPool(cfg, self.queue, self.engines.routed, self.placement.worker, self.services)
        self.engines.connect(self.trainer)
        self.agents = build_agents(cfg)  # the environments: problems (mixed by weight) and evaluation
        self.heldout = self.agents.heldout(cfg.eval.num_problems)
        self.evals = PeriodicEvaluation(cfg.eval, cfg.trainer.total_steps, self.agents, self.agents.heldout(
            min(cfg.eval.periodic_num_problems or cfg.eval.num_problems, cfg.eval.num_problems)))
        self.prompts = Prompts(cfg.algorithm, cfg.trainer.dist_timeout_s, self.agents, self.workers, self.queue)
        self.supervisor = Supervisor(cfg.run, self.run_dir, self.engines, self.workers, self.services,
                                     lambda: self.step, self.prompts.restart_lost)
        self.elastic = Elastic(cfg.engine.autoscale, self.engines, self.workers, self.supervisor)
        self.control = actors.create_run_control(self.run_dir)  # `asyncrl scale`, `asyncrl stop`
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
            self.supervisor.record(event)
            return
        logger.info("ready in %.0fs (trainer: %s); evaluating the base policy", time.monotonic() - t0, trainer_info)
        self.base_eval = evaluate_with_workers(cfg.eval, self.workers.handles, self.agents, self.heldout)
        logger.info("base policy: %s", self.base_eval.summary())
        self.log.log(0, {**eval_metrics(self.base_eval, self.engine_version), "setup_s": time.monotonic() - t0})

    # == train =========================================================================

    def train(self) -> None:
        cfg = self.cfg
        self.prompts.admit(self.admission_version)
        self._last, _ = self._clocks()
        self._started = self._last.time
        while self.step < cfg.trainer.total_steps and not self.stop_requested:
            if cfg.run.max_train_s and self.train_s >= cfg.run.max_train_s:
                logger.info("run.max_train_s=%g reached after %d steps", cfg.run.max_train_s, self.step)
                break
            try:
                self.supervisor.check_health()
                self.prompts.check(self.admission_version)  # after the health check: the dead hold nothing
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
        groups, stale = self.prompts.batch(self.version, self._check_health)
        waited = self.clock.now() - t_wait
        result = self.trainer.train_step(groups, self.version)
        if result.staleness_max > cfg.algorithm.max_staleness:
            raise TrainingError(f"invariant broken: a trained token is {result.staleness_max} versions old, "
                                f"algorithm.max_staleness={cfg.algorithm.max_staleness}")
        trained = self.prompts.finish(groups, result.filtered)
        metrics: dict[str, Any] = {**result.metrics,
                                   **batch_metrics(groups, stale, trained, multi_task=len(self.agents.weights) > 1)}
        step_samples = sum(len(g.trajectories) for g in groups)
        self.samples += step_samples
        if step % cfg.algorithm.sync_every_steps == 0:  # unless an evaluation holds the engines' policy
            t0 = self.clock.now()
            held, evaluated = self.evals.before_sync(self.workers.handles, self.engine_version)
            if "eval/waited_s" in evaluated:  # training waited for it
                self.eval_s += self.clock.now() - t0
            metrics.update({**evaluated, **({} if held else self._sync())})
        self.prompts.admit(self.admission_version)
        now, queue_stats = self._clocks()
        metrics.update({
            "policy/version": self.version, "batch/dropped_stale": len(stale), **self.prompts.metrics(),
            "throughput/samples_per_s": step_samples / (now.time - self._last.time), "progress/samples": self.samples,
            **step_metrics(self._last, now, waited, actors.engine_concurrency(cfg, len(self.engines.live()))),
            **now.rollout, **queue_stats.metrics(), **self.supervisor.metrics(),
            "progress/train_s": now.time - self._started - self.eval_s,  # the clock of run.max_train_s
            "policy/syncs_deferred": self.evals.syncs_deferred,
        })
        self._last = now
        metrics.update(self.evals.after_step(step, self.workers.handles, self.engine_version))
        self.eval_s += self.clock.now() - now.time  # training waits only for evaluations not beside it
        if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
            self.save_checkpoint()
        self.log.log(step, metrics)
        self.queue.report.remote(gauges(metrics))
        asked: ControlRequest = ray.get(self.control.take_request.remote())
        if asked.stop and not self.stop_requested:
            logger.info("asyncrl stop: the run ends after step %d", step)
        self.stop_requested |= asked.stop
        self.elastic.after_step(step, metrics, asked.engines)

    def _clocks(self) -> tuple[Clocks, QueueStats]:
        """The totals a step's metrics are the differences of (worker stats fetched here, once a step)."""
        now, activity = self.clock.now(), self.engines.activity()
        rollout = rollout_metrics(self.workers.stats())
        queue_stats: QueueStats = ray.get(self.queue.stats.remote())
        return Clocks(now, activity, rollout, cpu_totals(activity, queue_stats, self.workers.last_stats)), queue_stats

    @property
    def admission_version(self) -> int:
        """The version admission counts with: syncs held back for evaluations count as done, so that
        an evaluation costs the pipeline none of its look-ahead (docs/evaluation.md)."""
        return self.version + self.evals.syncs_deferred

    def _sync(self) -> dict[str, float]:
        """interrupt loops -> pause engines -> broadcast -> load -> resume -> resume loops. An
        engine that dies meanwhile is replaced and the sync done again, with its replacement."""
        a = self.cfg.algorithm
        self.supervisor.check_health()  # a dead member would stall the broadcast
        if not a.partial_rollout:  # finish what is generating under the old weights first
            self.workers.drain()
        if a.pause_mode == "abort":
            self.workers.interrupt()
        try:
            timings = self.engines.sync.sync(self.version + 1, a.pause_mode)
        except EnginesFailed as e:
            self.trainer.check_alive()  # a dead trainer rank fails every engine's receive: that is the fault then
            waiting = "left waiting in a broadcast that cannot complete"
            members = self.engines.sync.engines
            slots = {self.engines.slot_of(members[k]): why for k, why in
                     [*e.failed.items(), *((k, waiting) for k in e.stuck)]}
            self.supervisor.replace_engines(slots)
            logger.warning("%s; syncing again without engine(s) %s", e, sorted(slots))
            timings = self.engines.sync.sync(self.version + 1, a.pause_mode)
        self.version += 1
        self.engine_version = timings.engine_version
        self.engines.route_joined(self.workers, self.version)
        metrics = timings.metrics()
        if self.cfg.rollout.mirror_loops:  # in abort mode every loop has left its snapshot by now
            self.workers.mirror()
        if a.pause_mode == "abort":
            metrics["sync/resumed_loops"] = self.workers.resume_interrupted()
        return metrics

    def _check_health(self) -> None:
        """The supervisor's health check while the step waits for groups; then, if the engines the
        workers route to all died and only their replacements live (replaced between syncs, e.g. at
        a checkpoint), the replacements get the policy and the routing now: no group would come
        before a sync, and no sync before a step."""
        self.supervisor.check_health()
        if self.engines.only_unrouted():
            logger.warning("no engine the workers route to is alive: the replacements get policy version %d now",
                           self.version)
            self._policy_to_engines()
            self.engines.route_joined(self.workers, self.version)

    def _policy_to_engines(self) -> None:
        """The trainer's current weights to every engine now, whatever algorithm.policy_lag."""
        mode = self.cfg.algorithm.pause_mode
        if mode == "abort":
            self.workers.interrupt()
        self.engine_version = self.engines.sync.sync(self.version, mode, newest=True).engine_version
        if mode == "abort":
            self.workers.resume_interrupted()

    def _newest_policy_to_engines(self) -> None:
        """With algorithm.policy_lag the engines hold an older policy than the trainer: the final
        evaluation is of the trainer's (the policy the run trained)."""
        if self.engine_version != self.version:
            self._policy_to_engines()

    def _restart_trainer(self, why: str) -> None:
        """A trainer rank died: new ranks in the same bundles load the newest checkpoint, and the whole
        run goes back to it: what was generated or trained since is thrown away (new workers and
        queue), the checkpoint's queue, ledger, problem stream, loop snapshots and weights take
        over. So no token is newer than the restored policy, and no prompt is lost or trained twice."""
        self.supervisor.count_restart("trainer", "max_trainer_restarts", why)
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise TrainingError(f"{why}; this run has no checkpoint to restart from "
                                "(set trainer.checkpoint_every)")
        event = FaultEvent("trainer", "trainer", self.step, why)
        logger.warning("%s; restarting the trainer from %s", why, path)
        n = self.supervisor.restarts["trainer"]
        t0 = time.monotonic()
        for actor in [*self.trainer.ranks, self.queue]:  # live ranks may wait on the dead one
            kill(actor)
        self.workers.kill()
        self.trainer = actors.create_trainer(self.cfg, self.placement.trainer, restart=n)
        self.trainer.setup()
        t1 = time.monotonic()
        self.queue = actors.create_queue(self.cfg, restart=n)
        self.prompts.use_queue(self.queue)
        self.workers.restart_all(self.queue, self.engines.routed, self.supervisor.restarts["rollout_worker"] + n)
        self.engines.connect(self.trainer)
        t2 = time.monotonic()
        failed_at = self.step
        event.loops_resumed, event.prompts_restarted, _ = self._load_checkpoint(path)
        event.phases_s = {"start_trainer_s": t1 - t0, "workers_and_weight_group_s": t2 - t1,
                          "load_checkpoint_s": time.monotonic() - t2}
        logger.warning("trainer restarted: back at step %d from step %d", self.step, failed_at)
        self.supervisor.record(event)

    # == checkpoints and the end ===========================================================

    def save_checkpoint(self) -> str:
        """Trainer state (megatron dist checkpoint) and the run's own (asyncrl/control/run_checkpoint.py)."""
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        pending, queue_state = take_snapshots(self.workers, self.engines, self.queue, self.supervisor.check_health)
        state = RunState(step=self.step, version=self.version, samples=self.samples,
                         problem_stream=self.agents.state(), base_eval=self.base_eval,
                         syncs_deferred=self.evals.syncs_deferred)
        self.trainer.save_checkpoint(str(path))
        self.trainer.export_hf(str(path / "hf"))  # `asyncrl eval CHECKPOINT` reads this
        RunCheckpoint(state, queue_state, pending, self.prompts.state()).write(path)
        logger.info("checkpoint: %s (%d groups queued, %d unfinished with %d loop snapshots)", path,
                    len(queue_state.groups), len(pending), sum(len(g.snapshots) for g in pending))
        return str(path)

    def _load_checkpoint(self, path: Path) -> tuple[int, int, int]:
        """Continue from `save_checkpoint`'s directory (`run.resume_from`, or a trainer restart):
        every loop it holds goes on from its snapshot; a prompt that was running but is in
        neither the queue nor a snapshot (a remote agent's group) starts again from its prompt.
        Returns the loops resumed, the prompts restarted and the generated tokens kept."""
        saved = RunCheckpoint.read(path)
        state = saved.state
        try:
            trainer_step = self.trainer.load_checkpoint(str(path))
        except CheckpointRefused as e:  # Ray's wrapper adds the rank's traceback: keep the one line
            raise CheckpointRefused(str(getattr(e, "cause", e))) from None
        if trainer_step != state.step:
            raise TrainingError(f"{path}: the trainer's state is of step {trainer_step}, the run's of {state.step}")
        self.step, self.version, self.samples = state.step, state.version, state.samples
        self.evals.restore(state.syncs_deferred)
        self.agents.restore(state.problem_stream)
        self.base_eval = state.base_eval
        if self.cfg.trainer.backend == "megatron":  # (a simulated run's tokens are no model's)
            drop_untrainable(saved.queue, model_limits(self.cfg.model.path, self.cfg.engine.max_model_len,
                                                       self.cfg.reward.max_abs))
        ray.get(self.queue.restore.remote(saved.queue))
        # The engines get the restored weights (a policy lag starts again from them).
        self.engine_version = self.engines.sync.sync(self.version, self.cfg.algorithm.pause_mode,
                                                     newest=True).engine_version
        self.engines.route_joined(self.workers, self.version)
        pending, queued = saved.loops, {g.prompt_id for g in saved.queue.groups}
        restarted = self.prompts.resume(saved.prompts, self.admission_version, queued, pending)
        loops, kept = sum(len(g.snapshots) for g in pending), sum(g.generated_tokens() for g in pending)
        logger.info("resumed from %s: step %d, version %d, %d groups queued, %d loops continue from their "
                    "snapshots (%d tokens kept), %d prompts restarted", path, self.step, self.version, len(queued),
                    loops, kept, restarted)
        return loops, restarted, kept

    def finish(self, wall_start: float) -> dict[str, Any]:
        """Final evaluation (with pass@k), HF export, summary.json."""
        self.supervisor.end_starting()  # the run ends with the engines starting in, unless unplaceable
        if last := self.evals.after_step(self.step, self.workers.handles, self.engine_version, block=True):
            self.log.log(self.step, last)  # the one still running
        if self.evals.release_held():  # the last steps' weights, held back for that evaluation
            self.log.log(self.step, self._sync())
        self._newest_policy_to_engines()
        final_eval = evaluate_with_workers(self.cfg.eval, self.workers.handles, self.agents, self.heldout)
        self.log.log(self.step, eval_metrics(final_eval, self.engine_version))
        export = self.trainer.export_hf(str(self.run_dir / "final_policy"))
        if self.cfg.trainer.checkpoint_every:
            self.save_checkpoint()
        summary = {
            "recipe": self.cfg.recipe.name, "base_accuracy": self.base_eval.greedy_accuracy,
            "final_accuracy": final_eval.greedy_accuracy,
            "base_pass_at_k": self.base_eval.pass_at_k, "final_pass_at_k": final_eval.pass_at_k,
            "wall_s": time.monotonic() - wall_start, "train_s": self.train_s, "steps": self.step,
            "samples": self.samples, "policy_version": self.version, "final_policy": export,
            "metrics": str(self.log.path), **self.prompts.summary(),
            "max_staleness": self.cfg.algorithm.max_staleness, "eval_overlap": eval_overlap(self.log.records()),
            "faults": [f.to_dict() for f in self.supervisor.faults],
            "scale_events": [e.to_dict() for e in self.supervisor.scale_events],
            "placement": self.placement.nodes(),  # actor -> the Ray node its bundle is on
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if summary["prompts"]["lost"]:
            raise TrainingError(f"invariant broken: {summary['prompts']['lost']} prompts lost (summary.json)")
        return summary

    def cleanup(self) -> None:
        """Stop every actor we started (rollout workers, then engines: their vLLM processes), then
        Ray if embedded."""
        if self.log is not None:
            self.log.close()
        if not ray.is_initialized():
            return
        # The run is over: loops still generating would only fail, one traceback each, as their engine goes.
        if self.control is not None:
            kill(self.control)
        if self.workers is not None:
            self.workers.shutdown()
        if self.services is not None:
            self.services.shutdown()
        if self.engines is not None:
            self.engines.shutdown()
        if self.trainer is not None:
            self.trainer.shutdown()
        if self.queue is not None:
            kill(self.queue)
        actors.remove_placement(self.placement)
        if self._started_ray:
            ray.shutdown()


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

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
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ray

from asyncrl.agents.registry import build_agents
from asyncrl.config.schema import Config
from asyncrl.engine.engine_actor import EngineActor, engine_options, engines_stream
from asyncrl.evaluate import EvalResult, evaluate_with_workers
from asyncrl.monitoring.run_log import RunLog
from asyncrl.queue.message_queue import MessageQueue, message_queue_options
from asyncrl.rollout.admission import PromptLedger, StalenessController
from asyncrl.rollout.worker import RolloutWorker, rollout_worker_options
from asyncrl.sync.weight_sync import WeightSync
from asyncrl.trainer.batch import group_filter_reason
from asyncrl.trainer.trainer_group import TrainerGroup

logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """A run that cannot go on (an actor died, an invariant broke); the message says why."""


class Driver:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.version = 0  # policy version: weight syncs so far
        self.step = 0
        self.samples = 0
        self.train_s = 0.0  # seconds in the training loop so far
        self.engines: list = []
        self.workers: list = []
        self.queue = None
        self.trainer: TrainerGroup | None = None
        self.placement_group = None
        self.base_eval: EvalResult | None = None
        self.final_eval: EvalResult | None = None
        self.log: RunLog | None = None
        self._started_ray = False
        a = cfg.algorithm
        self.staleness = StalenessController(a.max_staleness, a.prompts_per_step, a.sync_every_steps)
        self.ledger = PromptLedger()

    # == setup =========================================================================

    def setup(self) -> None:
        t0 = time.monotonic()
        cfg = self.cfg
        self.log = RunLog(cfg, self.run_dir)
        self._start_ray()
        self.placement_group, slots = self._place()
        logger.info("starting %d engine(s), %d rollout worker(s), %d trainer rank(s)", cfg.engine.num_engines,
                    cfg.rollout.num_workers, len(slots["trainer"]))
        stream = engines_stream(cfg.algorithm.pause_mode)
        self.engines = [ray.remote(EngineActor).options(**engine_options(cfg.engine, i), **slots["engine"][i])
                        .remote(i, cfg.model.path, cfg.model.tokenizer_path, cfg.engine, cfg.cluster.device, stream)
                        for i in range(cfg.engine.num_engines)]
        engine_start = [e.start.remote() for e in self.engines]
        self.trainer = TrainerGroup(cfg, slots["trainer"])  # the trainer loads while the engines start
        trainer_info = self.trainer.setup()
        for i, info in enumerate(ray.get(engine_start)):
            logger.info("engine-%d: vLLM started in %.0fs, %.2f GiB resident, on cores %s, processes %s", i,
                        info["start_s"], info["rss_gib"], info["cpu_cores"], info["vllm_processes"])
        a = cfg.algorithm
        capacity = (a.max_staleness + 1) * a.sync_every_steps * a.prompts_per_step + a.prompts_per_step
        self.queue = ray.remote(MessageQueue).options(**message_queue_options()).remote(capacity)
        self.workers = [ray.remote(RolloutWorker).options(**rollout_worker_options(cfg, i), **slots["worker"][i])
                        .remote(i, cfg, self.engines, self.queue) for i in range(cfg.rollout.num_workers)]
        self.sync = WeightSync(self.trainer, self.engines, "gloo" if cfg.cluster.device == "cpu" else "nccl",
                               cfg.trainer.dist_timeout_s)
        self.sync.connect()

        self.agents = build_agents(cfg)  # the environments: problems (mixed by weight) and evaluation
        self.heldout = self.agents.heldout(cfg.eval.num_problems)
        if cfg.run.resume_from:
            self._resume(Path(cfg.run.resume_from))
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
        else:
            ray.init(num_cpus=self.cfg.cluster.num_cpus, num_gpus=self.cfg.cluster.num_gpus or None,
                     include_dashboard=self.cfg.cluster.dashboard, log_to_driver=True)
            self._started_ray = True

    def _place(self) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
        """One placement group: a bundle per engine, trainer rank and rollout worker."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cfg = self.cfg
        gpu = cfg.cluster.device == "cuda"
        t = cfg.trainer
        ranks = t.tensor_parallel_size * t.pipeline_parallel_size * t.data_parallel_size
        roles = ([("engine", {"CPU": cfg.engine.num_cpus_per_engine,
                              **({"GPU": cfg.engine.tensor_parallel_size} if gpu else {})})] * cfg.engine.num_engines
                 + [("trainer", {"CPU": t.num_cpus_per_rank, **({"GPU": 1} if gpu else {})})] * ranks
                 + [("worker", {"CPU": cfg.rollout.num_cpus_per_worker})] * cfg.rollout.num_workers)
        need: dict[str, float] = {}
        for _, bundle in roles:
            for k, v in bundle.items():
                need[k] = need.get(k, 0) + v
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0)) for k, v in need.items() if v > have.get(k, 0) + 1e-9}
        if short:
            raise TrainingError("not enough cluster resources for this config: " + ", ".join(
                f"{k} needs {v:g}, cluster has {h:g}" for k, (v, h) in short.items())
                + " (lower engine.num_cpus_per_engine, trainer.num_cpus_per_rank, rollout.num_cpus_per_worker, "
                  "or the number of engines / workers / ranks)")
        pg = placement_group([b for _, b in roles], strategy="PACK", name="asyncrl")
        ray.get(pg.ready(), timeout=120)
        slots: dict[str, list[dict[str, Any]]] = {"engine": [], "trainer": [], "worker": []}
        for i, (role, _) in enumerate(roles):
            slots[role].append({"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)})
        return pg, slots

    # == train =========================================================================

    def train(self) -> None:
        cfg = self.cfg
        t = cfg.trainer
        self._admit()
        last = {"time": time.monotonic(), "busy": self._engine_busy()}
        started = last["time"]
        for step in range(self.step + 1, t.total_steps + 1):
            if cfg.run.max_train_s and time.monotonic() - started >= cfg.run.max_train_s:
                logger.info("run.max_train_s=%g reached after %d steps", cfg.run.max_train_s, self.step)
                break
            self.step = step
            t_wait = time.monotonic()
            groups, dropped = self._next_batch()
            waited = time.monotonic() - t_wait
            metrics = self.trainer.call("train_step", groups, self.version)
            self._check_staleness(metrics)
            for g in groups:
                reason = group_filter_reason(g, cfg.algorithm.loss)
                self.ledger.finish(g.prompt_id, "filtered" if reason else "trained", reason or "")
            step_samples = sum(len(g.trajectories) for g in groups)
            if len(self.agents.weights) > 1:  # the multi-task mix as trained
                metrics.update({f"batch/groups/{env}": n for env, n in
                                collections.Counter(g.env_id for g in groups).items()})
            self.samples += step_samples
            if step % cfg.algorithm.sync_every_steps == 0:
                metrics.update(self._sync())
            self._admit()
            now, busy = time.monotonic(), self._engine_busy()
            elapsed = now - last["time"]
            metrics.update({
                "policy/version": self.version, "batch/dropped_stale": dropped,
                "throughput/samples_per_s": step_samples / elapsed,
                "throughput/step_s": elapsed, "idle/trainer": waited / elapsed,
                "idle/engines": 1 - min(1.0, (busy - last["busy"]) / (elapsed * len(self.engines))),
                "progress/samples": self.samples, "progress/admitted": self.staleness.admitted,
                **self._rollout_metrics(), **ray.get(self.queue.metrics.remote()),
            })
            last = {"time": now, "busy": busy}
            self.train_s = time.monotonic() - started
            if cfg.eval.every_steps and step % cfg.eval.every_steps == 0 and step < t.total_steps:
                metrics.update(self._eval_metrics(self._evaluate(with_pass_k=cfg.eval.periodic_pass_k)))
            if t.checkpoint_every and step % t.checkpoint_every == 0 and step < t.total_steps:
                self.save_checkpoint()
            self.log.log(step, metrics)
            self.queue.report.remote(_gauges(metrics))

    def _next_batch(self) -> tuple[list, int]:
        """B groups from the queue; groups staler than eta are dropped (counted) so that no
        trained token ever exceeds the bound."""
        b = self.cfg.algorithm.prompts_per_step
        timeout = self.cfg.trainer.dist_timeout_s
        try:
            groups = ray.get(self.queue.get.remote(b, self.version, timeout))
        except (TimeoutError, ray.exceptions.RayTaskError) as e:
            if not isinstance(e, TimeoutError) and not isinstance(getattr(e, "cause", None), TimeoutError):
                raise
            raise TrainingError(f"waited {timeout:g}s (trainer.dist_timeout_s) for {b} trajectory groups; "
                                f"rollout: {self._rollout_metrics()}") from None
        fresh = []
        for g in groups:
            if self.staleness.is_fresh(g, self.version):
                fresh.append(g)
            else:
                self.ledger.finish(g.prompt_id, "filtered", "stale")
        return fresh, len(groups) - len(fresh)

    def _check_staleness(self, metrics: dict[str, float]) -> None:
        eta = self.cfg.algorithm.max_staleness
        if metrics.get("train/staleness_max", 0) > eta:
            raise TrainingError(f"invariant broken: a trained token is {metrics['train/staleness_max']:.0f} "
                                f"versions old, algorithm.max_staleness={eta}")

    def _admit(self) -> None:
        """Start as many new prompts as staleness control allows, spread over the workers."""
        room = self.staleness.admissible(self.version)
        all_rejected = 0
        while room > 0:
            problems = [self.agents.next_problem() for _ in range(room)]
            shares = [problems[i::len(self.workers)] for i in range(len(self.workers))]
            accepted = sum(ray.get([w.submit.remote(s) for w, s in zip(self.workers, shares) if s]))
            rejected = self._rejected_prompts()
            for p in problems:
                self.ledger.admit(p.prompt_id)
                if p.prompt_id in rejected:
                    self.ledger.finish(p.prompt_id, "failed", rejected[p.prompt_id].split(" ")[0])
            self.staleness.on_admitted(accepted, self.version)
            room = self.staleness.admissible(self.version)
            all_rejected = all_rejected + 1 if accepted == 0 else 0
            if all_rejected == 3:  # the data (or the config) cannot produce a single usable prompt
                reasons = collections.Counter(r.split(" ")[0] for r in rejected.values())
                raise TrainingError(f"the rollout workers rejected every prompt of 3 admissions in a row "
                                    f"({dict(reasons)}); e.g. {next(iter(rejected.values()), '')}")

    def _rejected_prompts(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for stats in ray.get([w.get_stats.remote() for w in self.workers]):
            out.update(stats["failed_prompts"])
        return out

    def _sync(self) -> dict[str, float]:
        """interrupt loops -> pause engines -> broadcast -> load -> resume -> resume loops."""
        a = self.cfg.algorithm
        if not a.partial_rollout:  # finish what is generating under the old weights first
            ray.get([w.drain.remote() for w in self.workers])
        if a.pause_mode == "abort":
            ray.get([w.interrupt.remote() for w in self.workers])
        timings = self.sync.sync(self.version + 1, a.pause_mode)
        self.version += 1
        if a.pause_mode == "abort":
            resumed = sum(ray.get([w.resume_interrupted.remote() for w in self.workers]))
            timings["sync/resumed_loops"] = resumed
        return timings

    def _engine_busy(self) -> float:
        return sum(ray.get([e.busy_seconds.remote() for e in self.engines]))

    def _rollout_metrics(self) -> dict[str, Any]:
        stats = ray.get([w.get_stats.remote() for w in self.workers])
        keys = ("generated_tokens", "interruptions", "resumes", "trajectories_finished", "running_loops", "snapshots")
        out = {f"rollout/{k}": sum(s[k] for s in stats) for k in keys}
        reasons: dict[str, int] = {}
        for s in stats:
            for r, n in s["failure_reasons"].items():
                reasons[r] = reasons.get(r, 0) + n
        out["rollout/failures"] = reasons
        return out

    def _evaluate(self, with_pass_k: bool) -> EvalResult:
        return evaluate_with_workers(self.cfg, self.workers, self.agents, self.heldout, with_pass_k=with_pass_k)

    @staticmethod
    def _eval_metrics(result: EvalResult) -> dict[str, float]:
        out = {"eval/greedy_accuracy": result.greedy_accuracy, "eval/seconds": result.seconds}
        out.update({f"eval/pass@{k}": v for k, v in result.pass_at_k.items()})
        if len(result.per_env) > 1:
            out.update({f"eval/{env}/{k}": v for env, m in result.per_env.items() for k, v in m.items()})
        return out

    # == checkpoints and the end ===========================================================

    def save_checkpoint(self) -> str:
        """Trainer state (megatron dist checkpoint), queue contents, prompt ledger, counters."""
        path = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        queue_state = ray.get(self.queue.state.remote())
        extra = {"step": self.step, "version": self.version, "samples": self.samples,
                 "admitted": self.staleness.admitted, "problem_stream": self.agents.state(),
                 "base_eval": asdict(self.base_eval)}
        self.trainer.call("save_checkpoint", str(path), extra)
        self.trainer.call("export_hf", str(path / "hf"))  # `asyncrl eval CHECKPOINT` reads this
        (path / "queue.json").write_text(json.dumps(queue_state))
        (path / "ledger.json").write_text(json.dumps({"states": self.ledger.states,
                                                      "reasons": dict(self.ledger.reasons)}))
        logger.info("checkpoint: %s", path)
        return str(path)

    def _resume(self, path: Path) -> None:
        """Continue a run from `save_checkpoint`'s directory. Prompts that were generating when
        it was saved (neither queued nor finished) start again from their prompt."""
        extra = self.trainer.call("load_checkpoint", str(path))
        self.step, self.version, self.samples = extra["step"], extra["version"], extra["samples"]
        self.staleness.admitted = extra["admitted"]
        self.agents.restore(extra["problem_stream"])
        self.base_eval = EvalResult(**extra["base_eval"])
        queue_state = json.loads((path / "queue.json").read_text())
        ray.get(self.queue.restore.remote(queue_state))
        ledger = json.loads((path / "ledger.json").read_text())
        self.ledger = PromptLedger(ledger["states"], collections.Counter(ledger["reasons"]))
        self.sync.sync(self.version, self.cfg.algorithm.pause_mode)  # the engines get the restored weights
        queued = {g["prompt_id"] for g in queue_state["groups"]}
        restart = [self.agents.problem_by_id(p) for p in sorted(self.ledger.running() - queued)]
        if restart:
            ray.get([w.submit.remote(restart[i::len(self.workers)]) for i, w in enumerate(self.workers)])
        logger.info("resumed from %s: step %d, version %d, %d groups queued, %d prompts restarted",
                    path, self.step, self.version, len(queued), len(restart))



    def finish(self, wall_start: float) -> dict[str, Any]:
        """Final evaluation (with pass@k), HF export, summary.json."""
        self.final_eval = self._evaluate(with_pass_k=True)
        self.log.log(self.step, self._eval_metrics(self.final_eval))
        export = self.trainer.call("export_hf", str(self.run_dir / "final_policy"))
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
        }
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

    def ledger_counts(self) -> dict[str, int]:
        """Every admitted prompt in exactly one state; running ones are where the workers and queue say."""
        counts = self.ledger.counts()
        running = self.ledger.running()
        # Workers first, then the queue: a group moving from one to the other meanwhile is
        # then seen twice rather than missed (it leaves a worker only once it is queued).
        in_workers = {p for ps in ray.get([w.pending_prompts.remote() for w in self.workers]) for p in ps}
        in_queue = {g["prompt_id"] for g in ray.get(self.queue.state.remote())["groups"]}
        unaccounted = running - in_queue - in_workers
        if unaccounted:
            raise TrainingError(f"invariant broken: {len(unaccounted)} running prompts are neither queued nor in "
                                f"a worker, e.g. {sorted(unaccounted)[:3]}")
        counts.update({"queued": len(running & in_queue), "in_workers": len(running - in_queue),
                       "admitted": len(self.ledger.states)})
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
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        for e in self.engines:
            try:
                ray.get(e.shutdown.remote(), timeout=60)
            except Exception as err:  # a dead engine cannot shut down; it is killed below
                logger.warning("engine shutdown: %s", err)
        if self.trainer is not None:
            self.trainer.shutdown()
        for actor in [*self.engines, *([self.queue] if self.queue else [])]:
            try:
                ray.kill(actor)
            except Exception:  # already gone
                pass
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        if self._started_ray:
            ray.shutdown()


def _gauges(m: dict[str, Any]) -> dict[str, float]:
    return {"asyncrl_policy_version": m.get("policy/version"), "asyncrl_staleness_max": m.get("train/staleness_max"),
            "asyncrl_samples_per_s": m.get("throughput/samples_per_s"),
            "asyncrl_trainer_idle_ratio": m.get("idle/trainer"), "asyncrl_engine_idle_ratio": m.get("idle/engines"),
            "asyncrl_reward_mean": m.get("batch/reward_mean")}


def run_training(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """setup -> train -> finish, with cleanup on success, on errors and on Ctrl-C."""
    wall_start = time.monotonic()
    driver = Driver(cfg, run_dir)
    try:
        driver.setup()
        driver.train()
        return driver.finish(wall_start)
    finally:
        driver.cleanup()

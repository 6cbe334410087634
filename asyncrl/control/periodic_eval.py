"""Held-out evaluation every `eval.every_steps` steps, beside training or in its place.

Beside training (`eval.beside_training`, the default) an evaluation runs on the engines next to
the rollouts, each worker sending at most `eval.max_concurrent` of its requests at once, while the
trainer goes on with what is queued. It measures one policy, the one the engines held when it
started: until it ends the driver defers the engines' weight syncs (`before_sync`; the trainer
trains on, as with `algorithm.sync_every_steps` > 1), at most `eval.max_deferred_syncs` in a row,
after which training waits for it there. Its result is logged at the step it arrives, with the
versions its samples carry (`eval/sample_versions`: the one it is labelled with). It takes the
first `eval.periodic_num_problems` held-out problems of each env, and samples the first
`eval.periodic_pass_k_problems` of them for pass@k (the others greedily only), so that it ends
within a few steps and takes little of the rollouts' share of the engines; the final evaluation
takes all `eval.num_problems`, each sampled. An evaluation due while another runs
is skipped and counted (`eval/skipped`). Otherwise (`beside_training=false`) training waits for
each evaluation.
"""

from __future__ import annotations

import logging
import time

import ray

from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.config.schema import EvalConfig
from asyncrl.control.step_metrics import eval_metrics
from asyncrl.evaluation import PendingEvaluation
from asyncrl.messages import error_line
from asyncrl.tasks import Problem

logger = logging.getLogger(__name__)


class PeriodicEvaluation:
    def __init__(self, e: EvalConfig, total_steps: int, agents: WeightedMultiTask, problems: list[Problem]):
        self.eval, self.total_steps, self.agents = e, total_steps, agents
        # pass@k on the first eval.periodic_pass_k_problems of each env's, the others greedily only
        first = {p.prompt_id for p in agents.heldout(e.periodic_pass_k_problems)} if e.periodic_pass_k_problems \
            else {p.prompt_id for p in problems}
        self.sampled = [p for p in problems if p.prompt_id in first]
        self.greedy_only = [p for p in problems if p.prompt_id not in first]
        self.running: tuple[PendingEvaluation, int, int] | None = None  # with the version and step it started at
        self.skipped = 0  # evaluations due while another ran
        self.syncs_deferred = 0  # weight syncs held back so far for evaluations to end (a checkpoint keeps it)
        self.holding = 0  # syncs held back for the running one

    def before_sync(self, workers: list, version: int) -> tuple[bool, dict[str, float]]:
        """At a weight sync point: (whether to hold the sync back, metrics). An evaluation beside
        training runs: its samples must all be of the policy it evaluates, so the engines keep that
        policy while the trainer trains on, at most eval.max_deferred_syncs syncs in a row; at the
        next, training waits for it here (`eval/waited_s`)."""
        if self.running is None or not self.eval.beside_training:
            self.holding = 0
            return False, {}
        if self.holding < self.eval.max_deferred_syncs:
            if not self.holding:  # the rollouts' share of the engines is bounded by admission from now on
                self.unbound(workers)
            self.holding += 1
            self.syncs_deferred += 1
            return True, {"eval/sync_deferred": 1}
        t0 = time.monotonic()
        metrics = self._collect(workers, version, block=True)
        self.holding = 0
        return False, {**metrics, "eval/waited_s": time.monotonic() - t0}

    def after_step(self, step: int, workers: list, version: int, block: bool = False) -> dict[str, float]:
        """Start the evaluation due at `step`, if any, and return the metrics of one that finished
        (`block`: wait for a running one)."""
        e = self.eval
        due = bool(e.every_steps) and step % e.every_steps == 0 and step < self.total_steps
        skipped = {}
        if due and self.running is not None:
            self.skipped += 1
            skipped = {"eval/skipped": self.skipped}
            logger.warning("step %d: the evaluation of step %d still runs; this one is skipped (%d so far)", step,
                           self.running[2], self.skipped)
        elif due:
            self.running = (PendingEvaluation(e, workers, self.sampled, e.periodic_pass_k,
                                              beside_training=e.beside_training, greedy_only=self.greedy_only),
                            version, step)
        return {**skipped, **self._collect(workers, version, block or not e.beside_training)}

    def release_held(self) -> bool:
        """At the run's end: whether syncs were held back for the last evaluation (the driver does
        the sync now); no longer held."""
        held, self.holding = bool(self.holding), 0
        return held

    def restore(self, syncs_deferred: int) -> None:
        """From a checkpoint (admission counts the syncs deferred so far as done)."""
        self.syncs_deferred = syncs_deferred

    def unbound(self, workers: list) -> None:
        """The running evaluation may send all its requests at once."""
        try:
            ray.get([w.unbound_evaluations.remote() for w in workers])
        except ray.exceptions.RayError as err:
            logger.warning("could not lift the evaluation's bound: %s", error_line(err))

    def _collect(self, workers: list, version: int, block: bool) -> dict[str, float]:
        if self.running is None:
            return {}
        e = self.eval
        pending, started_version, started_step = self.running
        if block and e.beside_training:  # nothing else needs the engines now: the evaluation takes them all
            self.unbound(workers)
        try:
            result = pending.result(self.agents, block=block)
        except ray.exceptions.RayError as err:  # a worker died (a trainer restart replaces them all)
            logger.warning("the evaluation of step %d is lost: %s", started_step, error_line(err))
            self.running = None
            return {}
        if result is None:
            return {}
        self.running = None
        metrics = eval_metrics(result, started_version)
        if e.beside_training:
            metrics.update({"eval/policy_version_end": version, "eval/started_step": started_step})
        return metrics

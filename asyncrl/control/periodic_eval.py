"""Held-out evaluation every `eval.every_steps` steps, beside training or in its place.

Beside training (`eval.beside_training`, the default) an evaluation runs on the engines next
to the rollouts, each worker sending at most `eval.max_concurrent` of its requests at once,
while the trainer goes on with what is queued; its result is logged at the step it arrives,
tagged with the policy versions the engines held when it started and when it ended (weight
syncs happen meanwhile: a response may span two versions). One runs at a time: one due while
another runs is skipped (logged). Otherwise training waits for each evaluation, as before.
"""

from __future__ import annotations

import logging

import ray

from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.config.schema import Config
from asyncrl.control.step_metrics import eval_metrics
from asyncrl.evaluation import PendingEvaluation
from asyncrl.messages import error_line
from asyncrl.tasks import Problem

logger = logging.getLogger(__name__)


class PeriodicEvaluation:
    def __init__(self, cfg: Config, agents: WeightedMultiTask, problems: list[Problem]):
        self.cfg, self.agents, self.problems = cfg, agents, problems
        self.running: tuple[PendingEvaluation, int, int] | None = None  # with the version and step it started at

    def after_step(self, step: int, workers: list, version: int, block: bool = False) -> dict[str, float]:
        """Start the evaluation due at `step`, if any, and return the metrics of one that finished
        (`block`: wait for a running one)."""
        e = self.cfg.eval
        due = bool(e.every_steps) and step % e.every_steps == 0 and step < self.cfg.trainer.total_steps
        if due and self.running is not None:
            logger.warning("step %d: the evaluation of step %d still runs; this one is skipped", step, self.running[2])
        elif due:
            self.running = (PendingEvaluation(self.cfg, workers, self.problems, e.periodic_pass_k,
                                              beside_training=e.beside_training), version, step)
        if self.running is None:
            return {}
        pending, started_version, started_step = self.running
        if block and e.beside_training:  # training is over: the evaluation may take the whole engines
            try:
                ray.get([w.unbound_evaluations.remote() for w in workers])
            except ray.exceptions.RayError as err:
                logger.warning("could not lift the evaluation's bound: %s", error_line(err))
        try:
            result = pending.result(self.agents, block=block or not e.beside_training)
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

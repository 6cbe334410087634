"""The prompts of a run: admission under the staleness bound, the ledger of where each admitted
prompt is (invariant: none lost, none trained twice), and the batches the trainer takes.

A prompt is admitted (`admit`: dealt to the rollout workers), runs (in a worker, then
queued), and ends trained, filtered (by the loss's group filter, or stale) or failed (its
row refused). `batch` takes B groups from the queue and drops the stale and the duplicates;
`finish` records what the trainer did with them.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.config.schema import Config
from asyncrl.control import TrainingError
from asyncrl.control.step_metrics import rollout_metrics
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.messages import Admitted, PendingGroupState
from asyncrl.rollout.admission import PromptLedger, StalenessController
from asyncrl.trainer.batch import group_filter_reason
from asyncrl.types import TrajectoryGroup

logger = logging.getLogger(__name__)

# While the trainer waits for groups, the engines' and workers' health is checked this often.
WAIT_SLICE_S = 10.0


class Prompts:
    def __init__(self, cfg: Config, agents: WeightedMultiTask, workers: WorkerPool, queue: Any):
        self.cfg, self.agents, self.workers, self.queue = cfg, agents, workers, queue
        a = cfg.algorithm
        self.staleness = StalenessController(a.max_staleness, a.prompts_per_step, a.sync_every_steps,
                                             policy_lag=a.policy_lag)
        self.ledger = PromptLedger()
        self.trained: list[str] = []  # in order (a prompt trained twice would show)
        self.duplicates_dropped = 0  # groups of prompts already finished (a dead worker's late put)

    def admit(self, version: int) -> None:
        """Start as many new prompts as staleness control allows, spread over the workers."""
        room = self.staleness.admissible(version)
        all_rejected = 0
        while room > 0:
            problems = [self.agents.next_problem() for _ in range(room)]
            answer = self.workers.submit(problems)
            for p in problems:
                self.ledger.admit(p.prompt_id)
                if p.prompt_id in answer.rejected:
                    self.ledger.finish(p.prompt_id, "failed", answer.rejected[p.prompt_id].code)
            self.staleness.on_admitted(answer.accepted, version)
            room = self.staleness.admissible(version)
            all_rejected = all_rejected + 1 if answer.accepted == 0 else 0
            if all_rejected == 3:  # the data (or the config) cannot produce a single usable prompt
                reasons = collections.Counter(f.code for f in answer.rejected.values())
                raise TrainingError(f"the rollout workers rejected every prompt of 3 admissions in a row "
                                    f"({dict(reasons)}); e.g. {next(iter(answer.rejected.values()), '')}")

    def batch(self, version: int, check_health: Callable[[], object]) -> tuple[list, list]:
        """B groups from the queue, and those it dropped as stale: groups staler than eta are dropped
        so that no trained token ever exceeds the bound, and so is a group whose prompt is no
        longer running (a dead worker's group that reached the queue after its prompt was
        restarted; counted in duplicates_dropped)."""
        b = self.cfg.algorithm.prompts_per_step
        timeout = self.cfg.trainer.dist_timeout_s
        deadline = time.monotonic() + timeout
        while True:  # a health check every WAIT_SLICE_S: the prompts of a dead worker would never come
            try:
                groups = ray.get(self.queue.get.remote(b, version, min(WAIT_SLICE_S, timeout)))
                break
            except (TimeoutError, ray.exceptions.RayTaskError) as e:
                if not isinstance(e, TimeoutError) and not isinstance(getattr(e, "cause", None), TimeoutError):
                    raise
            if time.monotonic() >= deadline:
                raise TrainingError(f"waited {timeout:g}s (trainer.dist_timeout_s) for {b} trajectory groups; "
                                    f"rollout: {rollout_metrics(self.workers.stats())}")
            check_health()
        fresh, stale = [], []
        for g in groups:
            if self.ledger.states.get(g.prompt_id) != "running":
                self.duplicates_dropped += 1
                logger.warning("dropped group %s: its prompt is %s already", g.group_id,
                               self.ledger.states.get(g.prompt_id))
            elif self.staleness.is_fresh(g, version):
                fresh.append(g)
            else:
                stale.append(g)
                self.ledger.finish(g.prompt_id, "filtered", "stale")
        return fresh, stale

    def finish(self, groups: list[TrajectoryGroup]) -> list[TrajectoryGroup]:
        """The trainer trained on these groups: each prompt is trained, or filtered by the loss's
        group filter (e.g. all rewards equal). Returns the trained ones."""
        trained = []
        for g in groups:
            reason = group_filter_reason(g, self.cfg.algorithm.loss)
            self.ledger.finish(g.prompt_id, "filtered" if reason else "trained", reason or "")
            if not reason:
                self.trained.append(g.prompt_id)
                trained.append(g)
        return trained

    def held(self) -> tuple[set[str], set[str]]:
        """The prompts whose groups the workers hold, and those queued. Workers first, then the
        queue: a group moving from one to the other meanwhile is seen twice rather than missed
        (it leaves a worker only once it is queued)."""
        in_workers = self.workers.pending_prompts()
        return in_workers, set(ray.get(self.queue.prompt_ids.remote()))

    def restart_lost(self, mirrored: list[PendingGroupState]) -> tuple[int, int, int]:
        """Continue every running prompt that neither a worker nor the queue holds (a dead
        worker's): from its group in `mirrored` (the dead worker's last mirror) where there is one,
        from its prompt otherwise. Returns the prompts restarted, the loops resumed and the
        generated tokens kept."""
        held, queued = self.held()
        lost = self.ledger.running() - held - queued
        resumed = [g for g in mirrored if g.prompt_id in lost]
        answer = self.workers.restore(resumed, [self.agents.problem_by_id(g.prompt_id) for g in resumed])
        fresh = sorted(lost - {g.prompt_id for g in resumed})
        answer = Admitted.merge([answer, self.workers.submit([self.agents.problem_by_id(p) for p in fresh])])
        for prompt_id, failure in answer.rejected.items():
            self.ledger.finish(prompt_id, "failed", failure.code)
        return len(fresh), sum(len(g.snapshots) for g in resumed), sum(g.generated_tokens() for g in resumed)

    def counts(self) -> dict[str, int]:
        """Every admitted prompt in exactly one state; running ones are where the workers and queue say."""
        counts = self.ledger.counts()
        running = self.ledger.running()
        in_workers, in_queue = self.held()
        unaccounted = running - in_queue - in_workers
        if unaccounted:
            logger.error("invariant broken: %d running prompts are neither queued nor in a worker, e.g. %s",
                         len(unaccounted), sorted(unaccounted)[:3])
        counts.update({"queued": len(running & in_queue), "in_workers": len(running - in_queue - unaccounted),
                       "lost": len(unaccounted), "admitted": len(self.ledger.states)})
        return counts

    def trained_twice(self) -> int:
        return len(self.trained) - len(set(self.trained))

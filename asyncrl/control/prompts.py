"""The prompts of a run: admission under the staleness bound, the account of where each admitted
prompt is (invariant: none lost, none trained twice; `check`), and the batches the trainer takes.

A prompt is admitted (`admit`: dealt to the rollout workers), runs (in a worker, then
queued), and ends trained, filtered (by the trainer's group filter, or stale) or failed (its
row refused). `batch` takes B groups from the queue and drops the stale and the duplicates;
`finish` records what the trainer did with them. The counts live in one
`rollout.admission.PromptAccount`; the driver only calls the methods here.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from asyncrl.agents.multi_task import WeightedMultiTask
from asyncrl.config.schema import AlgorithmConfig
from asyncrl.control import TrainingError
from asyncrl.control.step_metrics import rollout_metrics
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.interfaces import QueueHandle
from asyncrl.messages import Admitted, PendingGroupState
from asyncrl.rollout.admission import PromptAccount, PromptAccountState, StalenessController
from asyncrl.types import TrajectoryGroup

logger = logging.getLogger(__name__)

# While the trainer waits for groups, the engines' and workers' health is checked this often.
WAIT_SLICE_S = 10.0


class Prompts:
    def __init__(self, algorithm: AlgorithmConfig, wait_timeout_s: float, agents: WeightedMultiTask,
                 workers: WorkerPool, queue: QueueHandle):
        """`wait_timeout_s`: how long `batch` waits for the groups of a step (trainer.dist_timeout_s)."""
        self.prompts_per_step, self.wait_timeout_s = algorithm.prompts_per_step, wait_timeout_s
        self.agents, self.workers, self.queue = agents, workers, queue
        self.account = PromptAccount(StalenessController.of(algorithm))

    def use_queue(self, queue: QueueHandle) -> None:
        """A new queue (the trainer's restart starts one)."""
        self.queue = queue

    def admit(self, version: int) -> None:
        """Start as many new prompts as staleness control allows, spread over the workers."""
        room = self.account.admissible(version)
        all_rejected = 0
        while room > 0:
            problems = [self.agents.next_problem() for _ in range(room)]
            answer = self.workers.submit(problems)
            self.account.admit([p.prompt_id for p in problems],
                               {p: failure.code for p, failure in answer.rejected.items()}, version)
            room = self.account.admissible(version)
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
        b, timeout = self.prompts_per_step, self.wait_timeout_s
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
            if (state := self.account.state_of(g.prompt_id)) != "running":
                self.account.dropped_duplicate()
                logger.warning("dropped group %s: its prompt is %s already", g.group_id, state)
            elif self.account.rule.is_fresh(g, version):
                fresh.append(g)
            else:
                stale.append(g)
                self.account.filtered(g.prompt_id, "stale")
        return fresh, stale

    def finish(self, groups: list[TrajectoryGroup], filtered: dict[str, str]) -> list[TrajectoryGroup]:
        """The trainer took these groups and filtered `filtered` (prompt id -> why it gave no
        training signal, e.g. all rewards equal): each prompt is trained or filtered. Returns the
        trained ones."""
        trained = []
        for g in groups:
            if g.prompt_id in filtered:
                self.account.filtered(g.prompt_id, filtered[g.prompt_id])
            else:
                self.account.trained(g.prompt_id)
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
        lost = self.account.running() - held - queued
        resumed = [g for g in mirrored if g.prompt_id in lost]
        fresh = sorted(lost - {g.prompt_id for g in resumed})
        self._continue(resumed, fresh)
        return len(fresh), sum(len(g.snapshots) for g in resumed), sum(g.generated_tokens() for g in resumed)

    def _continue(self, resumed: list[PendingGroupState], fresh: list[str]) -> None:
        """Running prompts go on: `resumed` from their loops' snapshots, `fresh` from their prompts;
        a prompt the workers refuse now (e.g. a smaller context) fails."""
        answer = self.workers.restore(resumed, [self.agents.problem_by_id(g.prompt_id) for g in resumed])
        if fresh:
            answer = Admitted.merge([answer, self.workers.submit([self.agents.problem_by_id(p) for p in fresh])])
        for prompt_id, failure in answer.rejected.items():
            if self.account.state_of(prompt_id) == "running":
                self.account.failed(prompt_id, failure.code)

    def check(self, version: int) -> None:
        """The account's invariant, with what the workers and the queue hold: call it after a health
        check (a worker dead since would hold nothing, and its prompts would read as lost)."""
        in_workers, in_queue = self.held()
        self.account.check(version, in_workers | in_queue)

    def counts(self) -> dict[str, int]:
        """Every admitted prompt in exactly one state; running ones are where the workers and queue say."""
        counts = self.account.counts()
        running = self.account.running()
        in_workers, in_queue = self.held()
        unaccounted = running - in_queue - in_workers
        if unaccounted:
            logger.error("invariant broken: %d running prompts are neither queued nor in a worker, e.g. %s",
                         len(unaccounted), sorted(unaccounted)[:3])
        counts.update({"queued": len(running & in_queue), "in_workers": len(running - in_queue - unaccounted),
                       "lost": len(unaccounted), "admitted": sum(counts.values())})
        return counts

    def metrics(self) -> dict[str, int]:
        return {"batch/duplicates_dropped": self.account.duplicates_dropped, "progress/admitted": self.account.admitted}

    def summary(self) -> dict[str, Any]:
        """summary.json's prompt figures."""
        return {"prompts": self.counts(), "prompts_trained_twice": self.account.trained_twice(),
                "duplicates_dropped": self.account.duplicates_dropped}

    # -- checkpoints ----------------------------------------------------------------------

    def state(self) -> PromptAccountState:
        return self.account.state()

    def resume(self, state: PromptAccountState, version: int, queued: set[str],
               pending: list[PendingGroupState]) -> int:
        """Continue from a checkpoint's account: its loops (`pending`) from their snapshots, a running
        prompt in neither the queue nor `pending` (a remote agent's group, or a queued group the
        checks dropped) from its prompt. Returns the prompts restarted."""
        self.account = PromptAccount(self.account.rule, state)
        self.account.check(version)
        restart = sorted(self.account.running() - queued - {g.prompt_id for g in pending})
        self._continue(pending, restart)
        return len(restart)


"""The run's checkpoint directory beside the trainer's state: what the driver, the queue, the
ledger and the rollout loops hold, written and read as typed data.

    checkpoints/step_NNNNNN/
        (the trainer's megatron distributed checkpoint, trainer_state.pt)   TrainerGroup.save_checkpoint
        hf/             the policy as a Hugging Face checkpoint (`asyncrl eval` reads it)
        queue.json      QueueState: the groups queued
        loops.json      [PendingGroupState]: every unfinished group, its loops' snapshots
        ledger.json     PromptAccountState: where every admitted prompt is, the order trained in
        run_state.json  RunState, written last: it marks the checkpoint complete

`config.validate.latest_checkpoint` finds the newest complete one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray

from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.evaluation import EvalResult
from asyncrl.messages import PendingGroupState, QueueState
from asyncrl.rollout.admission import PromptAccountState
from asyncrl.rollout.trust import TrajectoryLimits, group_problem
from asyncrl.trainer.safe_checkpoint import STATE_JSON_MAX_BYTES, CheckpointRefused, read_checkpoint_json

logger = logging.getLogger(__name__)

# The most each of the driver's files may hold, read before it is parsed (queue.json and loops.json
# hold trajectories, which grow with the run's batch and context: not capped, but never sparse).
FILE_CAPS = {"run_state.json": STATE_JSON_MAX_BYTES, "ledger.json": 256 << 20}


@dataclass
class RunState:
    """The driver's own part of a checkpoint."""

    step: int
    version: int
    samples: int
    problem_stream: dict[str, Any]  # WeightedMultiTask.state()
    base_eval: EvalResult
    syncs_deferred: int = 0  # weight syncs evaluations held back so far (admission counts them as done)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunState:
        d = dict(d)
        base = d.pop("base_eval")
        base["pass_at_k"] = {int(k): v for k, v in base["pass_at_k"].items()}  # JSON keys are strings
        return cls(**d, base_eval=EvalResult(**base))


@dataclass
class RunCheckpoint:
    """Everything of a checkpoint but the trainer's state."""

    state: RunState
    queue: QueueState
    loops: list[PendingGroupState]
    prompts: PromptAccountState

    def write(self, path: Path) -> None:
        """Into `path` (the trainer's state already there); run_state.json last."""
        (path / "queue.json").write_text(json.dumps(self.queue.to_dict()))
        (path / "loops.json").write_text(json.dumps([g.to_dict() for g in self.loops]))
        (path / "ledger.json").write_text(json.dumps(asdict(self.prompts)))
        (path / "run_state.json").write_text(json.dumps(asdict(self.state)))

    @classmethod
    def read(cls, path: Path) -> RunCheckpoint:
        """From `write`'s files, each read as a regular file (no link to /dev/zero or to another
        file, not sparse, within its cap: asyncrl/trainer/safe_checkpoint.py), every number in it
        finite; a file of another shape is refused naming it. What they hold is checked where it is
        used (the samples by asyncrl/rollout/trust.py, by type then by value, when the queue and
        the workers restore them)."""
        names = ["run_state.json", "queue.json", "ledger.json", *(["loops.json"] if (path / "loops.json").exists()
                                                                  else [])]
        # every file checked before any is parsed
        raw = {name: read_checkpoint_json(path / name, FILE_CAPS.get(name)) for name in names}

        def parsed(name: str, parse: Callable[[Any], Any]) -> Any:
            try:
                return parse(raw[name])
            except (KeyError, TypeError, ValueError, AttributeError) as e:  # not the shape `write` gives it
                why = str(e) if type(e) is ValueError else f"{type(e).__name__}: {e}"
                raise CheckpointRefused(f"checkpoint {path / name} refused: {why}") from None

        loops = parsed("loops.json", lambda d: [PendingGroupState.from_dict(g) for g in d]) if "loops.json" in raw \
            else []
        prompts = parsed("ledger.json", PromptAccountState.from_dict)
        return cls(state=parsed("run_state.json", RunState.from_dict), queue=parsed("queue.json", QueueState.from_dict),
                   loops=loops, prompts=prompts)


def drop_untrainable(queue: QueueState, limits: TrajectoryLimits) -> list[str]:
    """Drop the queued groups of a checkpoint that fail the checks of asyncrl/rollout/trust.py
    (a corrupt or crafted queue.json: a token id past the vocabulary would crash a train step);
    returns their prompt ids, to start again."""
    kept, dropped = [], []
    for g in queue.groups:
        why = group_problem(g, len(g.trajectories), limits)
        if why is None:
            kept.append(g)
        else:
            logger.warning("checkpoint: queued group %s refused (%s): its prompt starts again", g.group_id, why)
            dropped.append(g.prompt_id)
    queue.groups = kept
    return dropped


def take_snapshots(workers: WorkerPool, engines: EnginePool, queue: Any, check_health: Callable[[], object]
                   ) -> tuple[list[PendingGroupState], QueueState]:
    """Every running loop's snapshot and the queue's contents, at one instant: the workers stop
    their loops, the engines pause (abort: requests return what they generated), the workers
    hand over their unfinished groups, the queue its groups; then all go on."""
    workers.interrupt()
    paused = engines.pause()
    pending = workers.checkpoint()
    queue_state: QueueState = ray.get(queue.state.remote())
    resumed = engines.resume(paused)
    workers.resume_interrupted()
    if resumed < len(engines.live()):  # one died meanwhile: replaced now, its loops went on
        check_health()
    return pending, queue_state

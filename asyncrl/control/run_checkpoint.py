"""The run's checkpoint directory beside the trainer's state: what the driver, the queue, the
ledger and the rollout loops hold, written and read as typed data.

    checkpoints/step_NNNNNN/
        (the trainer's megatron distributed checkpoint, trainer_state.pt)   TrainerGroup.save_checkpoint
        hf/             the policy as a Hugging Face checkpoint (`asyncrl eval` reads it)
        queue.json      QueueState: the groups queued
        loops.json      [PendingGroupState]: every unfinished group, its loops' snapshots
        ledger.json     PromptLedger: where every admitted prompt is
        run_state.json  RunState, written last: it marks the checkpoint complete

`config.validate.latest_checkpoint` finds the newest complete one.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from asyncrl.control.engine_pool import EnginePool
from asyncrl.control.worker_pool import WorkerPool
from asyncrl.evaluation import EvalResult
from asyncrl.messages import PendingGroupState, QueueState
from asyncrl.rollout.admission import PromptLedger


@dataclass
class RunState:
    """The driver's own part of a checkpoint."""

    step: int
    version: int
    samples: int
    admitted: int
    problem_stream: dict[str, Any]  # WeightedMultiTask.state()
    base_eval: EvalResult
    trained_prompts: list[str] = field(default_factory=list)  # in order (a prompt trained twice would show)
    syncs_deferred: int = 0  # weight syncs evaluations held back so far (admission counts them as done)

    @classmethod
    def from_json(cls, text: str) -> RunState:
        d = json.loads(text)
        base = d.pop("base_eval")
        base["pass_at_k"] = {int(k): v for k, v in base["pass_at_k"].items()}  # JSON keys are strings
        return cls(**d, base_eval=EvalResult(**base))


@dataclass
class RunCheckpoint:
    """Everything of a checkpoint but the trainer's state."""

    state: RunState
    queue: QueueState
    loops: list[PendingGroupState]
    ledger: PromptLedger

    def write(self, path: Path) -> None:
        """Into `path` (the trainer's state already there); run_state.json last."""
        (path / "queue.json").write_text(json.dumps(self.queue.to_dict()))
        (path / "loops.json").write_text(json.dumps([g.to_dict() for g in self.loops]))
        (path / "ledger.json").write_text(json.dumps({"states": self.ledger.states,
                                                      "reasons": dict(self.ledger.reasons)}))
        (path / "run_state.json").write_text(json.dumps(asdict(self.state)))

    @classmethod
    def read(cls, path: Path) -> RunCheckpoint:
        ledger = json.loads((path / "ledger.json").read_text())
        loops_file = path / "loops.json"
        loops = [PendingGroupState.from_dict(g) for g in json.loads(loops_file.read_text())] \
            if loops_file.is_file() else []
        return cls(state=RunState.from_json((path / "run_state.json").read_text()),
                   queue=QueueState.from_dict(json.loads((path / "queue.json").read_text())), loops=loops,
                   ledger=PromptLedger(ledger["states"], collections.Counter(ledger["reasons"])))


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

"""The reward-only agent: a Python module gives the problems, the reward and, for
multi-turn episodes, the environment's observations.

    agents:
      - env_id: guess
        type: reward_only
        agent_loop: multi_turn          # with observations; partial_single_turn for one turn
        params: {module: recipes.multi_task.guess_env, max_turns: 3}

The module defines
    problems(split: str) -> list[dict]           each with "question" (and anything the reward needs)
    reward(problem: Problem, response: str) -> float
    observe(problem: Problem, response: str, turn: int) -> str | None     (optional; multi-turn)
`problem.entry` is the row's dict. `observe` sees the whole response so far (the model's turns
and earlier observations) and returns the environment's reply, or None to end the episode; the
episode also ends after `max_turns` model turns.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from omegaconf import MISSING

from asyncrl.agents.api import SPLITS, Agent, AgentSettings
from asyncrl.config.schema import AgentConfig
from asyncrl.tasks import Problem


@dataclass
class RewardOnlyParams:
    module: str = MISSING
    max_turns: int = 1
    prompt_template: str = "{question}"


class RewardOnlyAgent(Agent):
    params_class = RewardOnlyParams

    def __init__(self, spec: AgentConfig, params: RewardOnlyParams, settings: AgentSettings):
        super().__init__(spec, params, settings)
        if params.max_turns < 1:
            raise ValueError(f"env {spec.env_id!r}: params.max_turns={params.max_turns}: must be >= 1")
        self.module = _import(params.module, spec.env_id)
        for hook in ("problems", "reward"):
            if not callable(getattr(self.module, hook, None)):
                raise ValueError(f"env {spec.env_id!r}: module {params.module!r} defines no {hook}()")

    def reward(self, problem: Problem, response: str) -> float:
        return float(self.module.reward(problem, response))

    def observe(self, problem: Problem, response: str, turn: int) -> str | None:
        hook = getattr(self.module, "observe", None)
        if hook is None or turn >= self.params.max_turns:
            return None
        return hook(problem, response, turn)

    def load_splits(self) -> dict[str, list[Problem]]:
        out = {}
        for split in SPLITS:
            rows = list(self.module.problems(split))
            bad = [i for i, r in enumerate(rows) if not isinstance(r, dict) or not str(r.get("question", "")).strip()]
            if bad:
                raise ValueError(f"env {self.env_id!r}: {self.params.module}.problems({split!r}) row {bad[0]} "
                                 "is not a dict with a non-empty 'question'")
            out[split] = [Problem(prompt_id=f"{self.env_id}/{split}/{i}", task="", question=r["question"],
                                  prompt=self.params.prompt_template.format(question=r["question"]),
                                  answer=str(r.get("answer", "")), entry=r, env_id=self.env_id)
                          for i, r in enumerate(rows)]
        return out


def _import(module: str, env_id: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"env {env_id!r}: params.module={module!r} cannot be imported: {e}") from e

"""A recipe's Python hooks, loaded from the module its config names (`recipe.module`).

A recipe module (recipes/<name>/__init__.py) defines
  - `extract_answer(response) -> str`: the answer in the generated text, for the task's scorer;
  - optionally `reward(problem, response) -> float`: a reward of its own. Without it the
    reward is the task's scorer on the extracted answer;
  - optionally `sft_target(problem) -> str`: the text scripts/build_base_model.py trains the
    base model to write (a worked solution). Without it, the bare answer;
  - optionally `direct_answer(problem) -> str`: the bare answer in the recipe's format, which
    `build_base_model.py --terse-steps` mixes into the end of the build (a base that mostly
    answers directly though its worked solutions are more often right). Without it, the answer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.tasks import Problem, score_answer


@dataclass(frozen=True)
class RecipeHooks:
    module: str
    extract_answer: Callable[[str], str]
    custom_reward: Callable[[Problem, str], float] | None = None
    custom_sft_target: Callable[[Problem], str] | None = None
    custom_direct_answer: Callable[[Problem], str] | None = None

    def reward(self, problem: Problem, response: str) -> float:
        if self.custom_reward is not None:
            return float(self.custom_reward(problem, response))
        return score_answer(problem, self.extract_answer(response))

    def sft_target(self, problem: Problem) -> str:
        return self.custom_sft_target(problem) if self.custom_sft_target is not None else problem.answer

    def direct_answer(self, problem: Problem) -> str:
        return self.custom_direct_answer(problem) if self.custom_direct_answer is not None else problem.answer


def load_recipe_hooks(module: str) -> RecipeHooks:
    """Import `module` and collect its hooks; a clear error names what is missing."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"recipe.module={module!r} cannot be imported: {e}") from e
    extract = getattr(mod, "extract_answer", None)
    if not callable(extract):
        raise ValueError(f"recipe.module={module!r} defines no extract_answer(response: str) -> str")
    reward = getattr(mod, "reward", None)
    if reward is not None and not callable(reward):
        raise ValueError(f"recipe.module={module!r}: `reward` must be a function (problem, response) -> float")
    targets = {name: getattr(mod, name, None) for name in ("sft_target", "direct_answer")}
    for name, fn in targets.items():
        if fn is not None and not callable(fn):
            raise ValueError(f"recipe.module={module!r}: `{name}` must be a function (problem) -> str")
    return RecipeHooks(module=module, extract_answer=extract, custom_reward=reward,
                       custom_sft_target=targets["sft_target"], custom_direct_answer=targets["direct_answer"])

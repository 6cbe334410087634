"""A recipe's Python hooks, loaded from the module its config names (`recipe.module`).

A recipe module (recipes/<name>/__init__.py) defines `extract_answer(response) -> str`,
which turns generated text into the answer the task's scorer checks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RecipeHooks:
    module: str
    extract_answer: Callable[[str], str]


def load_recipe_hooks(module: str) -> RecipeHooks:
    """Import `module` and collect its hooks; a clear error names what is missing."""
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"recipe.module={module!r} cannot be imported: {e}") from e
    extract = getattr(mod, "extract_answer", None)
    if not callable(extract):
        raise ValueError(f"recipe.module={module!r} defines no extract_answer(response: str) -> str")
    return RecipeHooks(module=module, extract_answer=extract)

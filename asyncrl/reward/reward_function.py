"""A reward function with verl's signature, taken from a Python file (`reward_function` of a
dataset agent's data settings):

    reward_function: path/to/score.py::compute_score     # the name defaults to compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

It is called as verl calls it, with keywords. It returns a number (the reward) or a dict
whose "score" is the reward; the dict's other keys with finite numbers are per-sample
metrics (the rest are ignored). A result that is not a finite number raises, so the caller
counts it like any reward exception.

Loading executes the file (as verl does); validation loads it, so a missing file, a missing
or uncallable function, or a signature verl could not call is reported before a run starts.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_NAME = "compute_score"  # verl's custom_reward_function.name default
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


def parse_spec(spec: str) -> tuple[str, str]:
    """("path/to/score.py", "compute_score") of "path/to/score.py::compute_score" (the name
    defaults to compute_score)."""
    path, sep, name = spec.partition("::")
    return path, (name if sep else DEFAULT_NAME)


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function `spec` names; ValueError saying what is wrong (the file, the import, the name,
    the signature). Cached per process: validation and the agents share one import."""
    path, name = parse_spec(spec)
    if not path.endswith(".py"):
        raise ValueError(f"{path!r} is not a .py file (give path/to/score.py::{name})")
    if not name.isidentifier():
        raise ValueError(f"{name!r} is not a function name (give path/to/score.py::compute_score)")
    file = Path(path).resolve()
    if not file.is_file():
        raise ValueError(f"{path!r}: no such file")
    return _load(str(file), name)


@functools.cache  # a failure raises, so only successful loads are cached
def _load(file: str, name: str) -> Callable[..., Any]:
    # one module per file, named after its path, so two score.py files never collide
    module_name = f"asyncrl_reward_{Path(file).stem}_{hashlib.sha1(file.encode()).hexdigest()[:10]}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, file)
        if spec is None or spec.loader is None:
            raise ValueError(f"{file!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dataclasses and pickle look their module up here
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # a user file may raise anything, sys.exit() included
            del sys.modules[module_name]
            raise ValueError(f"{file!r} raised on import: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{file!r} defines no {name}")
    if not callable(fn):
        raise ValueError(f"{file!r}: {name} is not callable (it is {type(fn).__name__})")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: the call will tell
        return fn
    try:
        signature.bind(**dict.fromkeys(VERL_ARGUMENTS))
    except TypeError as e:
        raise ValueError(f"{file!r}: {name}{signature} cannot take verl's arguments "
                         f"({', '.join(VERL_ARGUMENTS)}): {e}") from None
    return fn


def call_reward_function(fn: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any,
                         extra_info: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """(reward, per-sample metrics) of one call; TypeError / ValueError for a result that is not a
    finite number (or a dict without one under "score")."""
    result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                extra_info=extra_info)
    metrics: dict[str, float] = {}
    if isinstance(result, dict):
        if "score" not in result:
            raise ValueError(f"returned a dict without a 'score' key (keys: {', '.join(map(str, result)) or 'none'})")
        for key, value in result.items():
            if key != "score" and isinstance(key, str) and _is_number(value) and math.isfinite(float(value)):
                metrics[key] = float(value)
        result = result["score"]
    if not _is_number(result):
        raise TypeError(f"returned {type(result).__name__} {_short(result)}, not a number")
    reward = float(result)
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward!r}, not a finite number")
    return reward, metrics


def _is_number(value: Any) -> bool:
    """A Python, numpy or 0-d tensor number; never text ("1.0" is not a score)."""
    if isinstance(value, str | bytes | bytearray) or not hasattr(value, "__float__"):
        return False
    try:
        float(value)
    except (TypeError, ValueError):  # e.g. a tensor of several elements
        return False
    return True


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

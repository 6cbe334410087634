"""What a trajectory from outside this process must be before it is queued for training.

A remote agent's env server (`RemoteAgent`, through `asyncrl serve-env` or anyone's server)
answers with whole trajectory groups: token ids, logprobs, versions, rewards, routes. A hostile
or buggy server must not crash a train step (a token id of 2**70, routes that do not reshape) or
poison it (a NaN reward or logprob makes the loss NaN, and bf16/fp32 weights take it). Each
group is checked here against what this run's model and engines can have produced; a group that
fails becomes a counted `remote_error` (rollout/worker.py), never a trained one. The samples a
checkpoint holds (finished trajectories, loop snapshots) are checked the same way when a run
resumes from it: one that fails starts again from its prompt (`checkpoint_refused`).

Types first, then values: a token id must be an int (not a bool, a string or a float that numpy
would round), a logprob or reward a finite number (not a string), the worker's counters in `info`
ints and its metrics numbers (pydantic, strict: `type_problem`); then the values against what the
run's model and engines can have produced (`trajectory_problem`). Each problem names its field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictBytes, StrictInt, StrictStr, ValidationError

from asyncrl.config.schema import DEFAULT_MAX_ABS_REWARD
from asyncrl.types import Trajectory, TrajectoryGroup


@dataclass(frozen=True)
class TrajectoryLimits:
    """What this run's model and engines can produce."""

    vocab_size: int  # token ids are in [0, vocab_size)
    newest_version: int | None = None  # no token is of a later policy version (None: unchecked)
    # MoE with routing replay: (layers, top_k, experts) of the routes; None: a trajectory has none
    routes: tuple[int, int, int] | None = None
    max_tokens: int | None = None  # prompt + response (engine.max_model_len); None: unchecked
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD  # reward.max_abs


def model_limits(model_path: str, max_tokens: int | None = None,
                 max_abs_reward: float = DEFAULT_MAX_ABS_REWARD) -> TrajectoryLimits:
    """The limits a checkpoint's config sets (its vocabulary; its experts, for an MoE model), with the
    run's context length and reward bound."""
    from transformers import PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(model_path)
    raw = raw.get("text_config", raw)
    experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts")  # DeepSeek's
    layers = int(raw["num_hidden_layers"]) - int(raw.get("first_k_dense_replace") or 0)  # the MoE layers route
    routes = (layers, int(raw["num_experts_per_tok"]), int(experts)) if experts else None
    return TrajectoryLimits(int(raw["vocab_size"]), routes=routes, max_tokens=max_tokens,
                            max_abs_reward=max_abs_reward)


def group_problem(group: TrajectoryGroup, size: int, limits: TrajectoryLimits, group_id: str | None = None,
                  at_least: bool = False) -> str | None:
    """Why `group` (asked for `size` trajectories, as group `group_id` when given; `at_least`: or more,
    an agent whose samples may branch) cannot be trained on, in one line; None if it can."""
    if group_id is not None and group.group_id != group_id:
        return f"group id {group.group_id!r}, not the {group_id!r} asked for"
    if len(group.trajectories) < size or (len(group.trajectories) > size and not at_least):
        return f"{len(group.trajectories)} trajectories for a group of {size}"
    for i, t in enumerate(group.trajectories):
        why = trajectory_problem(t, limits)
        if why is not None:
            return f"trajectory {i}: {why}"
    return None


def trajectory_problem(t: Trajectory, limits: TrajectoryLimits) -> str | None:
    """Why trajectory `t` cannot be trained on or continued, in one line; None if it can."""
    if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
        return f"reward {t.reward!r} is not a finite number"
    if (why := type_problem(t)) is not None:
        return why
    if abs(t.reward) > limits.max_abs_reward:
        return f"reward {t.reward:g} outside [-{limits.max_abs_reward:g}, {limits.max_abs_reward:g}] (reward.max_abs)"
    if not t.prompt_token_ids:
        return "an empty prompt"
    ids = _array(list(t.prompt_token_ids) + t.response_token_ids, np.int64)
    if limits.max_tokens is not None and ids is not None and len(ids) > limits.max_tokens:
        return f"{len(ids)} tokens, more than the context holds (engine.max_model_len={limits.max_tokens})"
    if ids is None or (ids.size and (ids.min() < 0 or ids.max() >= limits.vocab_size)):
        return f"token ids outside the vocabulary [0, {limits.vocab_size})"
    logprobs = _array(t.response_logprobs, np.float64)
    if logprobs is None or not np.isfinite(logprobs).all() or (logprobs > 0).any():
        return "logprobs that are not finite numbers <= 0"
    mask = _array(t.loss_mask, np.int64)
    if mask is None or ((mask != 0) & (mask != 1)).any():
        return "a loss mask of other values than 0 and 1"
    versions = _array(t.versions, np.int64)
    if versions is None or (versions.size and versions.min() < -1):
        return "policy versions below -1"
    if limits.newest_version is not None and versions.size and versions.max() > limits.newest_version:
        return f"policy version {int(versions.max())}, newer than any engine's ({limits.newest_version})"
    teacher = t.teacher_logprobs
    if teacher is not None and (len(teacher) != t.num_response_tokens or (np.asarray(teacher) > 0).any()):
        return f"{len(teacher)} teacher logprobs for {t.num_response_tokens} response tokens, or some > 0"
    if t.routes is not None:
        if limits.routes is None:
            return "routes, for a model without experts"
        layers, top_k, experts = limits.routes
        if (t.routes.layers, t.routes.top_k) != (layers, top_k) or len(t.routes.data) % (layers * top_k):
            return f"routes of {t.routes.layers} layers x top-{t.routes.top_k}, the model's are {layers} x {top_k}"
        routes = t.routes.array()
        if len(routes) > len(ids) or (routes.size and routes.max() >= experts):
            return f"routes past the tokens or expert ids outside [0, {experts})"
    return None


def _array(values, dtype) -> np.ndarray | None:
    """`values` as a 1-D numpy array of `dtype` (one conversion, no loop here), or None if they are
    not numbers (an integer past 64 bits, NaN as an id, a nested list)."""
    try:
        out = np.asarray(values, dtype=dtype)
    except (OverflowError, ValueError, TypeError):
        return None
    return out if out.ndim == 1 else None


# -- types ----------------------------------------------------------------------------------------

Finite = Annotated[float, Field(allow_inf_nan=False)]  # strict: an int is a number too; a str or a bool is not


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _SegmentTypes(_Strict):
    token_ids: list[StrictInt]
    logprobs: list[Finite]
    loss_mask: list[StrictInt]
    versions: list[StrictInt]


class _RoutesTypes(_Strict):
    data: StrictBytes
    layers: StrictInt
    top_k: StrictInt


class _InfoTypes(BaseModel):
    """What the worker and the driver read of `info` (the rest is the recipe's, never read by asyncrl)."""

    model_config = ConfigDict(strict=True, extra="allow")
    tool_calls: Annotated[StrictInt, Field(ge=0)] = 0
    tool_errors: dict[StrictStr, Annotated[StrictInt, Field(ge=0)]] = {}
    reward_metrics: dict[StrictStr, Finite | StrictBool] = {}


class _TrajectoryTypes(_Strict):
    prompt_id: StrictStr
    group_id: StrictStr
    prompt_token_ids: list[StrictInt]
    segments: list[_SegmentTypes]
    reward: Finite
    failure_reason: StrictStr | None
    env_id: StrictStr
    timings: dict[StrictStr, Finite]
    info: _InfoTypes
    routes: _RoutesTypes | None
    teacher_logprobs: list[Finite] | None


def type_problem(t: Trajectory) -> str | None:
    """Why a trajectory's fields are not of the types asyncrl reads them as (the first, with its field
    path, e.g. "segments.0.token_ids.3: Input should be a valid integer (got str)"); None if they are."""
    view: dict[str, Any] = {
        "prompt_id": t.prompt_id, "group_id": t.group_id, "prompt_token_ids": t.prompt_token_ids,
        "segments": [vars(s) for s in t.segments], "reward": t.reward, "failure_reason": t.failure_reason,
        "env_id": t.env_id, "timings": t.timings, "info": t.info, "teacher_logprobs": t.teacher_logprobs,
        "routes": None if t.routes is None else {"data": t.routes.data, "layers": t.routes.layers,
                                                  "top_k": t.routes.top_k}}
    try:
        _TrajectoryTypes.model_validate(view)
    except ValidationError as e:
        error = e.errors(include_url=False)[0]  # its input is named by type only: never echoed
        where = ".".join(str(x) for x in error["loc"])
        return f"{where}: {error['msg']} (got {type(error.get('input')).__name__})"
    except TypeError as e:  # a segment that is not an object at all
        return f"segments: {e}"
    return None

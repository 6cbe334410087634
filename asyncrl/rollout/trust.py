"""What a trajectory from outside this process must be before it is queued for training.

A remote agent's env server (`RemoteAgent`, through `asyncrl serve-env` or anyone's server)
answers with whole trajectory groups: token ids, logprobs, versions, rewards, routes. A hostile
or buggy server must not crash a train step (a token id of 2**70, routes that do not reshape) or
poison it (a NaN reward or logprob makes the loss NaN, and bf16/fp32 weights take it). Each
group is checked here against what this run's model and engines can have produced; a group that
fails becomes a counted `remote_error` (rollout/worker.py), never a trained one. The samples a
checkpoint holds (finished trajectories, loop snapshots) are checked the same way when a run
resumes from it: one that fails starts again from its prompt (`checkpoint_refused`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from asyncrl.types import TrajectoryGroup


@dataclass(frozen=True)
class TrajectoryLimits:
    """What this run's model and engines can produce."""

    vocab_size: int  # token ids are in [0, vocab_size)
    newest_version: int | None = None  # no token is of a later policy version (None: unchecked)
    # MoE with routing replay: (layers, top_k, experts) of the routes; None: a trajectory has none
    routes: tuple[int, int, int] | None = None


def model_limits(model_path: str) -> TrajectoryLimits:
    """The limits a checkpoint's config sets (its vocabulary; its experts, for an MoE model)."""
    from transformers import PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(model_path)
    raw = raw.get("text_config", raw)
    experts = raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts")  # DeepSeek's
    layers = int(raw["num_hidden_layers"]) - int(raw.get("first_k_dense_replace") or 0)  # the MoE layers route
    routes = (layers, int(raw["num_experts_per_tok"]), int(experts)) if experts else None
    return TrajectoryLimits(int(raw["vocab_size"]), routes=routes)


def group_problem(group: TrajectoryGroup, size: int, limits: TrajectoryLimits) -> str | None:
    """Why `group` (asked for `size` trajectories) cannot be trained on, in one line; None if it can."""
    if len(group.trajectories) != size:
        return f"{len(group.trajectories)} trajectories for a group of {size}"
    for i, t in enumerate(group.trajectories):
        why = trajectory_problem(t, limits)
        if why is not None:
            return f"trajectory {i}: {why}"
    return None


def trajectory_problem(t, limits: TrajectoryLimits) -> str | None:
    """Why trajectory `t` cannot be trained on or continued, in one line; None if it can."""
    if not isinstance(t.reward, (int, float)) or not math.isfinite(t.reward):
        return f"reward {t.reward!r} is not a finite number"
    if not t.prompt_token_ids:
        return "an empty prompt"
    ids = _array(list(t.prompt_token_ids) + t.response_token_ids, np.int64)
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

"""From trajectory groups to packed micro-batches: what one trainer step consumes.

1) `build_samples`: each usable trajectory becomes a `TrainSample` (prompt + response
   token ids exactly as the engine produced them, behaviour logprobs mu, loss mask,
   per-token versions) with its advantage as the step's `AdvantagePlan` says
   (asyncrl/algorithm/plan.py; with `gae` the trainer computes each token's from the critic's
   values later: the sample keeps its reward), and with a distillation teacher its per-token term.
   Failed trajectories, (optionally) groups whose rewards are all equal and
   (optionally) truncated responses are left out and counted.
2) `assign_weights` gives each token its aggregation weight within one optimizer
   update; `shard_for_data_parallel` gives each data-parallel rank a share, balanced
   by tokens.
3) `micro_batches` + `pack`: samples go into micro-batches of at most
   `trainer.max_tokens_per_micro_batch` tokens (first-fit decreasing; a longer sample alone),
   each packed end to end into one row (no padding, except a tail to a multiple of the
   tensor-parallel size where sequence parallelism splits the row); the row's cu_seqlens
   keep the sequences from seeing each other (attention.py; Transformer Engine's THD
   attention where installed). Nothing here or in the attention grows with the square of
   a row: memory is linear in its tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.algorithm.advantages import is_uniform
from asyncrl.algorithm.losses import aggregation_weights
from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.types import TrajectoryGroup, TrajectoryStatus


@dataclass
class TrainSample:
    tokens: list[int]  # prompt + response
    prompt_len: int
    mu: list[float]  # behaviour logprob of each response token
    mask: list[int]  # 1 = trained (policy token), 0 = tool/env token
    versions: list[int]  # policy version of each response token (-1 for env tokens)
    advantage: float
    reward: float = 0.0  # the trajectory's reward (gae's advantages start from it)
    # On-policy distillation: added to each response token's advantage, coef x (teacher - mu), 0 on env tokens
    token_bonus: np.ndarray | None = None
    # Aggregation weight of each response token (set by `assign_weights`; they sum to 1 over a mini-batch).
    weights: list[float] = field(default_factory=list)
    # Routing replay: the engine's experts for the first positions of `tokens`, uint8 [n, layers, top_k].
    routes: np.ndarray | None = None

    @property
    def num_response(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class StepBatch:
    samples: list[TrainSample]
    stats: dict[str, float] = field(default_factory=dict)
    filtered: dict[str, str] = field(default_factory=dict)  # prompt id -> group_filter_reason


def group_filter_reason(group: TrajectoryGroup, plan: AdvantagePlan) -> str | None:
    """Why a group gives no training signal ("no_usable", "uniform"), or None when it does. With a
    signal per token (gae's values, a distillation teacher) every usable sample has one: groups of
    equal rewards too."""
    rewards = [t.reward for t in group.trajectories if t.status is not TrajectoryStatus.FAILED]
    if len(rewards) < (1 if plan.per_token else 2):
        return "no_usable"
    if plan.filter_uniform and not plan.per_token and is_uniform(rewards):
        return "uniform"
    return None


def build_samples(groups: list[TrajectoryGroup], plan: AdvantagePlan) -> StepBatch:
    """The step's training samples, each with its advantage as `plan` says."""
    samples: list[TrainSample] = []
    stats = {"groups": len(groups), "groups_filtered_uniform": 0, "groups_empty": 0,
             "trajectories": 0, "trajectories_failed": 0, "trajectories_truncated": 0,
             "trajectories_masked_truncated": 0, "trajectories_routes_incomplete": 0}
    distill = _Distill(plan.distill_coef, stats) if plan.distill_coef else None
    rewards_all: list[float] = []
    reasons = [group_filter_reason(g, plan) for g in groups]
    usable = [[t for t in g.trajectories if t.status is not TrajectoryStatus.FAILED] for g in groups]
    trained = [i for i, reason in enumerate(reasons) if reason is None]
    advantages = dict(zip(trained, plan.sample_advantages([[t.reward for t in usable[i]] for i in trained])))
    for i, (group, kept, reason) in enumerate(zip(groups, usable, reasons)):
        stats["trajectories"] += len(group.trajectories)
        stats["trajectories_failed"] += len(group.trajectories) - len(kept)
        stats["trajectories_truncated"] += sum(t.status is TrajectoryStatus.TRUNCATED for t in kept)
        rewards_all += [t.reward for t in kept]
        if reason is not None:
            stats["groups_empty" if reason == "no_usable" else "groups_filtered_uniform"] += 1
            continue
        for traj, adv in zip(kept, advantages[i]):
            mask = traj.loss_mask
            if not traj.segments or not any(mask):
                continue
            if plan.mask_truncated and traj.status is TrajectoryStatus.TRUNCATED:
                stats["trajectories_masked_truncated"] += 1
                continue
            tokens = list(traj.prompt_token_ids) + traj.response_token_ids
            routes = traj.routes.array() if traj.routes is not None else None
            # Every position but the last feeds a trained logit; routes past the tokens are not ours.
            if routes is not None and len(routes) < len(tokens) - 1:
                stats["trajectories_routes_incomplete"] += 1
            samples.append(TrainSample(
                tokens=tokens, prompt_len=len(traj.prompt_token_ids),
                mu=traj.response_logprobs, mask=mask, versions=traj.versions,
                advantage=adv, reward=traj.reward, routes=routes[:len(tokens)] if routes is not None else None,
                token_bonus=distill.bonus(traj) if distill is not None else None))
    stats["samples"] = len(samples)
    if distill is not None:
        distill.finish()
    stats["reward_mean"] = sum(rewards_all) / len(rewards_all) if rewards_all else 0.0
    return StepBatch(samples, stats, {g.prompt_id: r for g, r in zip(groups, reasons) if r is not None})


class _Distill:
    """On-policy distillation's term of each sample (vector ops, no loop over tokens), and the
    step's per-token reverse KL estimate mean(log mu - log teacher) over trained tokens."""

    def __init__(self, coef: float, stats: dict[str, float]):
        self.coef, self.stats = coef, stats
        self.kl_sum, self.tokens = 0.0, 0
        stats["trajectories_without_teacher"] = 0

    def bonus(self, traj) -> np.ndarray | None:
        if traj.teacher_logprobs is None or len(traj.teacher_logprobs) != traj.num_response_tokens:
            self.stats["trajectories_without_teacher"] += 1  # its teacher failed: no distillation term
            return None
        mask = np.asarray(traj.loss_mask, dtype=np.float64)
        gap = (np.asarray(traj.teacher_logprobs, dtype=np.float64) - np.asarray(traj.response_logprobs)) * mask
        self.kl_sum -= float(gap.sum())
        self.tokens += int(mask.sum())
        return (self.coef * gap).astype(np.float32)

    def finish(self) -> None:
        self.stats["distill_reverse_kl"] = self.kl_sum / max(self.tokens, 1)


def assign_weights(samples: list[TrainSample], aggregation: str) -> None:
    """Set each token's aggregation weight over these samples (one optimizer update's worth)."""
    weights = aggregation_weights([torch.tensor(s.mask) for s in samples], aggregation)
    for sample, w in zip(samples, weights):
        sample.weights = w.tolist()


def shard_for_data_parallel(samples: list[TrainSample], dp_rank: int, dp_size: int) -> list[TrainSample]:
    """This rank's share: longest first, each to the least-loaded rank (deterministic on every rank)."""
    if dp_size == 1:
        return list(samples)
    loads = [0] * dp_size
    shards: list[list[TrainSample]] = [[] for _ in range(dp_size)]
    for s in sorted(samples, key=lambda s: -len(s.tokens)):
        r = min(range(dp_size), key=lambda i: (loads[i], i))
        shards[r].append(s)
        loads[r] += len(s.tokens)
    return shards[dp_rank]


def micro_batches(samples: list[TrainSample], max_tokens: int, max_samples: int = 0) -> list[list[TrainSample]]:
    """Samples into micro-batches of at most `max_tokens` tokens (and `max_samples` samples,
    0: any number): first-fit decreasing, longest first into the first micro-batch with room;
    a sample longer than `max_tokens` gets one of its own. Deterministic (ties keep their order).
    The loss's aggregation weights are set per mini-batch beforehand, so how samples are grouped
    changes no gradient (only the order of floating-point sums)."""
    bins: list[list[TrainSample]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: -len(s.tokens)):
        n = len(s.tokens)
        for i, left in enumerate(room):
            if n <= left and (not max_samples or len(bins[i]) < max_samples):
                bins[i].append(s)
                room[i] -= n
                break
        else:
            bins.append([s])
            room.append(max_tokens - n)
    return bins


@dataclass
class PackedBatch:
    """One micro-batch packed into a single row of L tokens."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L], restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32 sequence boundaries (THD), on the host
    max_seqlen: int
    # For the N response tokens of the micro-batch (in sample order):
    logit_index: torch.Tensor  # [N] position whose logits predict the token (its own position - 1)
    targets: torch.Tensor  # [N] token ids
    mu: torch.Tensor  # [N]
    mask: torch.Tensor  # [N] float
    advantages: torch.Tensor  # [N]
    weights: torch.Tensor  # [N]
    versions: torch.Tensor  # [N]
    seq_index: torch.Tensor  # [N] which sample of the micro-batch each token is of (sequence-level losses)
    rewards: torch.Tensor  # [n] each sample's reward (gae)
    # Filled by the trainer before the update when the loss needs them: [N] logprobs.
    prox: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    # gae, filled by the trainer: [N] the critic's values before the step, and their targets
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    # Routing replay, for all L positions: [L, layers, top_k] expert ids, and which positions have
    # the engine's (the others, a sequence's last token and the pad, hold experts 0..top_k-1: no
    # trained logit depends on them).
    routes: torch.Tensor | None = None
    routes_valid: torch.Tensor | None = None
    # `cu_seqlens` on the device the batch was moved to (`to`): what attention kernels read.
    cu_seqlens_device: torch.Tensor | None = None

    def to(self, device: torch.device) -> PackedBatch:
        """On `device`: the tensors the forward and the loss read, in one host-to-device copy per
        dtype (pinned, asynchronous on CUDA); `cu_seqlens` stays on the host too (megatron's
        per-sequence rope and the per-sequence attention read it there without a synchronisation)."""
        if device.type == "cpu":
            return dataclasses.replace(self, cu_seqlens_device=self.cu_seqlens)
        host = dataclasses.replace(self, cu_seqlens_device=self.cu_seqlens)
        names = [k for k, v in vars(host).items() if isinstance(v, torch.Tensor) and k != "cu_seqlens"]
        tensors = [getattr(host, k) for k in names]
        # one flat int64/float32 staging buffer per dtype: few copies, each from pinned memory
        moved = {}
        for dtype in {t.dtype for t in tensors}:
            group = [(k, t) for k, t in zip(names, tensors) if t.dtype == dtype]
            flat = torch.cat([t.reshape(-1) for _, t in group]).pin_memory().to(device, non_blocking=True)
            for (k, t), part in zip(group, flat.split([t.numel() for _, t in group])):
                moved[k] = part.view(t.shape)
        return dataclasses.replace(host, **moved)


def pack(samples: list[TrainSample], multiple: int = 1) -> PackedBatch:
    """One row of `samples` end to end; its length a multiple of `multiple` (sequence parallelism
    splits the row across tensor-parallel ranks): a tail of pad tokens, a sequence of its own
    that no real token attends to and no loss reads."""
    ids, pos, cu = [], [], [0]
    logit_index, targets, mu, mask, adv, weights, versions, seq_index = [], [], [], [], [], [], [], []
    for i, s in enumerate(samples):
        start = len(ids)
        ids += s.tokens
        pos += range(len(s.tokens))
        cu.append(len(ids))
        first = start + s.prompt_len
        logit_index += range(first - 1, first - 1 + s.num_response)
        targets += s.tokens[s.prompt_len:]
        mu += s.mu
        mask += s.mask
        adv += [s.advantage] * s.num_response
        weights += s.weights
        versions += s.versions
        seq_index += [i] * s.num_response
    pad = -len(ids) % multiple
    if pad:
        ids += [0] * pad
        pos += range(pad)
        cu.append(len(ids))
    routes, routes_valid = _pack_routes(samples, len(ids))
    advantages = torch.tensor(adv, dtype=torch.float32)
    if any(s.token_bonus is not None for s in samples):
        advantages += torch.from_numpy(np.concatenate([
            s.token_bonus if s.token_bonus is not None else np.zeros(s.num_response, np.float32) for s in samples]))
    return PackedBatch(
        input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max([len(s.tokens) for s in samples] + [pad]),
        logit_index=torch.tensor(logit_index), targets=torch.tensor(targets),
        mu=torch.tensor(mu, dtype=torch.float32), mask=torch.tensor(mask, dtype=torch.float32),
        advantages=advantages, weights=torch.tensor(weights, dtype=torch.float32),
        versions=torch.tensor(versions), seq_index=torch.tensor(seq_index),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32), routes=routes,
        routes_valid=routes_valid)


def _pack_routes(samples: list[TrainSample], length: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    shapes = {s.routes.shape[1:] for s in samples if s.routes is not None}
    if not shapes:
        return None, None
    if len(shapes) > 1:
        raise ValueError(f"samples carry routes of different shapes [layers, top_k]: {sorted(shapes)}")
    layers, top_k = shapes.pop()
    routes = torch.arange(top_k).expand(length, layers, top_k).clone()
    valid = torch.zeros(length, dtype=torch.bool)
    start = 0
    for s in samples:
        if s.routes is not None:
            n = min(len(s.routes), len(s.tokens))
            routes[start:start + n] = torch.from_numpy(s.routes[:n].astype(np.int64))
            valid[start:start + n] = True
        start += len(s.tokens)
    return routes, valid

"""The trainer's MoE routers: rollout routing replay (R3) and router health, on megatron-core.

Replay (algorithm.routing_replay=r3): every token of a packed micro-batch carries the experts the
engine routed it to at each MoE layer (`PackedBatch.routes`, [L, layers, top_k]). Before the
micro-batch's forward each router of the model chunk gets its layer's [L, top_k] ids through
megatron's router replay (`TransformerConfig.moe_enable_routing_replay`,
megatron/core/transformer/moe/router_replay.py): the router then uses those experts, its gate
probabilities taken from its own current logits at them (renormalised over the top-k, or the
full softmax's where the HF router does not renormalise: hf_bridge.renormalises_top_k), so
gradients still reach the router. Shared experts (Qwen2-MoE, DeepSeek-V3) are not routed: every token goes
through them in every forward, replayed or not; only the routed experts' choice is replayed.
Its per-instance calls are used, not the process-wide list (which also holds the reference
model's routers). A recomputed forward during backward would pop the same ids again
(REPLAY_BACKWARD); asyncrl recomputes nothing today, and `clear` empties that list after every
schedule run.

Health (`RouterStats`, every train step, replay or not): per layer, the tokens each expert got,
the auxiliary load-balancing loss the router would add (Switch / GShard form: E x sum_e f_e P_e,
f_e the share of routed slots, P_e the mean gate probability — for a sigmoid router, its
scores normalised over the experts; 1.0 when balanced), and
`router_agreement`: the share of (token, layer) pairs whose own top-k (from the router's logits
in this forward, picked as the router picks: with its correction bias and group limit where it
has them) equals the engine's. Without replay that forward is the plain trainer forward;
with replay the earlier layers' inputs were computed with the engine's routes, so the figure is
per layer, given the engine's choices below it. No tokens are dropped (no capacity factor).
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.trainer import mbridge_compat


def routers(chunk: torch.nn.Module) -> list[Any]:
    """The TopKRouters of a model chunk (its pipeline stage's MoE layers)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in chunk.modules() if isinstance(m, TopKRouter)]


def moe_layer_pattern(config: Any) -> list[int]:
    """1 for each MoE layer of the model, 0 for each dense one (megatron's `moe_layer_freq`)."""
    freq = config.moe_layer_freq
    return [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)


def route_layer(router: Any) -> int:
    """The router's place on the routes' layer axis: its layer's among the model's MoE layers (the
    engine records the MoE layers only, in order; DeepSeek's first layers are dense)."""
    return sum(moe_layer_pattern(router.config)[:router.layer_number - 1])


def replay(chunk: torch.nn.Module, routes: torch.Tensor) -> None:
    """Make this chunk's routers use `routes` ([L, MoE layers, top_k] expert ids; `route_layer`)
    in its next forward."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in routers(chunk):
        rr = router.router_replay
        rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        rr.set_target_indices(routes[:, route_layer(router)].long())


def after_forward(chunk: torch.nn.Module) -> None:
    """A recomputation in backward replays the same ids (megatron keeps them in a list)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for router in routers(chunk):
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def clear(chunks: list[torch.nn.Module]) -> None:
    for chunk in chunks:
        for router in routers(chunk):
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def router_scores(router: Any, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate probabilities over the experts, the scores the router picks its top-k by) from its
    logits [T, E]: softmax and the logits; for a sigmoid router (DeepSeek-V3) the sigmoid scores
    normalised over the experts, and the scores plus its correction bias."""
    if router.config.moe_router_score_function != "sigmoid":
        return torch.softmax(logits, -1), logits
    scores = torch.sigmoid(logits)
    bias = getattr(router, "expert_bias", None)
    return scores / scores.sum(-1, keepdim=True), scores if bias is None else scores + bias.float()


def own_top_k(router: Any, choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts [T, top_k] the router picks by `choice` [T, E], within its best groups if it has
    group-limited routing."""
    config = router.config
    if config.moe_router_group_topk:
        from megatron.core.transformer.moe.moe_utils import group_limited_topk

        return group_limited_topk(choice, top_k, choice.shape[0], choice.shape[1], config.moe_router_num_groups,
                                  config.moe_router_group_topk)[1]
    return choice.topk(top_k, dim=-1).indices


class RouterStats:
    """Per-layer router health over the training forwards of one step (see the module docstring).

    Built once over the model chunks (it hooks their routers); per step: `reset()`, then before each
    micro-batch `batch(routes, valid)` (the engine's routes of its rows, or None), then `reduce()`.
    """

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, num_experts: int, top_k: int) -> None:
        """`num_layers`: the model's layers; the figures are per MoE layer (`route_layer`)."""
        config = getattr(chunks[0], "config", None) if chunks else None
        if getattr(config, "num_moe_experts", None):
            num_layers = sum(moe_layer_pattern(config))
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.reset()
        self._routes: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None
        self.enabled = False  # the trainer turns it on around its training forwards
        self._hooks = [r.register_forward_hook(self._hook) for c in chunks for r in routers(c)]

    def reset(self) -> None:
        self.tokens = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)  # routed slots
        self.probs = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)  # gate probability sums
        self.agree = torch.zeros(self.num_layers, 2, dtype=torch.float64)  # (agreeing, compared) pairs

    def batch(self, routes: torch.Tensor | None, valid: torch.Tensor | None) -> None:
        self._routes, self._valid = routes, valid

    @torch.no_grad()
    def _hook(self, router: Any, args: tuple, output: tuple) -> None:
        if not self.enabled or mbridge_compat.in_backward():  # not in a recompute during backward
            return
        layer = route_layer(router)
        _, routing_map = output  # [T, E] bool: the experts used (replayed or chosen)
        logits = router.gating(args[0]).view(-1, self.num_experts).float()
        probs, choice = router_scores(router, logits)
        self.tokens[layer] += routing_map.sum(0).double().cpu()
        self.probs[layer] += probs.sum(0).double().cpu()
        if self._routes is not None:
            own = own_top_k(router, choice, self.top_k).sort(-1).values.cpu()
            engine = self._routes[:, layer].long().sort(-1).values
            same = (own == engine).all(-1)[self._valid]
            self.agree[layer] += torch.tensor([float(same.sum()), float(same.numel())], dtype=torch.float64)

    def reduce(self, tp_size: int, device: torch.device | None = None) -> dict[str, float]:
        """Metrics over every rank's tokens (TP ranks hold copies; PP stages hold their own layers).
        `device`: where the collective runs (NCCL reduces CUDA tensors only)."""
        vec = torch.cat([self.tokens.flatten(), self.probs.flatten(), self.agree.flatten()])
        if torch.distributed.is_initialized():
            vec = vec.to(device or vec.device)
            torch.distributed.all_reduce(vec)
            vec = vec.cpu()
        vec /= tp_size
        n = self.num_layers * self.num_experts
        tokens, probs, agree = vec[:n].view_as(self.tokens), vec[n:2 * n].view_as(self.probs), vec[2 * n:].view(-1, 2)
        out: dict[str, float] = {}
        slots = tokens.sum(-1).clamp(min=1.0)
        share = tokens / slots[:, None]  # f_e per layer
        mean_prob = probs / (slots / self.top_k).clamp(min=1.0)[:, None]  # P_e: per token, not per slot
        for layer in range(self.num_layers):
            out[f"moe/layer{layer}/max_load"] = float(share[layer].max() * self.num_experts)  # 1.0: balanced
            out[f"moe/layer{layer}/idle_experts"] = float((tokens[layer] == 0).sum())
            out[f"moe/layer{layer}/aux_loss"] = float(self.num_experts * (share[layer] * mean_prob[layer]).sum())
        out["moe/max_load"] = max(out[f"moe/layer{i}/max_load"] for i in range(self.num_layers))
        out["moe/aux_loss"] = sum(out[f"moe/layer{i}/aux_loss"] for i in range(self.num_layers)) / self.num_layers
        out["moe/dropped_tokens"] = 0.0  # megatron drops tokens only with a capacity factor, never set here
        if agree[:, 1].sum() > 0:
            out["moe/router_agreement"] = float(agree[:, 0].sum() / agree[:, 1].sum())
            for layer in range(self.num_layers):
                if agree[layer, 1] > 0:
                    out[f"moe/layer{layer}/router_agreement"] = float(agree[layer, 0] / agree[layer, 1])
        return out

    def close(self) -> None:
        for h in self._hooks:
            h.remove()

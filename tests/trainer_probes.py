"""A TrainerRank with test-only probes (built through asyncrl.actors.create_trainer's
`rank_class`): full logits and the loss gradient, to check the trainer against Hugging Face."""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from types import SimpleNamespace

import torch

from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.config.schema import LossConfig
from asyncrl.trainer.batch import build_samples
from asyncrl.trainer.settings import TrainerSettings
from asyncrl.trainer.trainer_rank import TrainerRank


class ProbedTrainerRank(TrainerRank):
    @torch.no_grad()
    def forward_logits(self, token_ids: list[list[int]]) -> torch.Tensor:
        """Full-vocabulary logits [batch, seq, vocab] for equal-length rows (conversion checks)."""
        from megatron.core import parallel_state as mpu
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        if mpu.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("forward_logits needs pipeline_parallel_size=1")
        # the rows packed end to end into one, as the trainer packs a micro-batch (THD, cu_seqlens)
        b, n = len(token_ids), len(token_ids[0])
        cu = torch.arange(0, b * n + 1, n, dtype=torch.int32)
        row = SimpleNamespace(input_ids=torch.tensor([sum(token_ids, [])], device=self.device),
                              position_ids=torch.arange(n, device=self.device).repeat(b)[None],
                              cu_seqlens=cu, cu_seqlens_device=cu.to(self.device), max_seqlen=n)
        self.model[0].eval()
        logits = self._forward(self.model[0], row)
        return gather_from_tensor_model_parallel_region(logits).float().cpu().view(b, n, -1)

    def critic_values(self, groups: list) -> torch.Tensor:
        """The critic's value of every response token of these groups' samples, in packing order
        (algorithm.advantage=gae; this rank's share)."""
        updates = self._packed_updates(build_samples(groups, self.advantage_plan).samples)
        self.critic.prepare(updates)
        return torch.cat([b.values for update in updates for b in update])

    def embedding_grad(self, groups: list, max_tokens: int | None = None, logit_chunk: int | None = None,
                       loss: LossConfig | None = None) -> tuple[torch.Tensor, list[int]]:
        """The loss gradient w.r.t. the (tied) embedding for these groups, without an update:
        the whole loss path against a reference implementation (TP=1); and the number of samples
        in each micro-batch. `max_tokens` / `logit_chunk` / `loss`: another token budget per
        micro-batch / fp32 logits held at once by the loss / loss settings, for this call."""
        if self.tp_size > 1 or self.dp_size > 1:
            raise NotImplementedError("embedding_grad is for single-rank checks")
        settings, chunk = self.settings, self.logit_chunk
        if max_tokens is not None:
            self.settings = replace(settings, trainer=replace(settings.trainer, max_tokens_per_micro_batch=max_tokens))
        if loss is not None:
            self.settings = replace(self.settings, algorithm=replace(self.settings.algorithm, loss=loss))
        self.logit_chunk = logit_chunk or chunk
        try:
            return self._embedding_grad(groups)
        finally:
            self.settings, self.logit_chunk = settings, chunk

    def _embedding_grad(self, groups: list) -> tuple[torch.Tensor, list[int]]:
        samples = build_samples(groups, AdvantagePlan.of(self.settings.algorithm)).samples  # its loss, for this call
        batches = [b for update in self._packed_updates(samples) for b in update]
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self._run(self.model, batches, forward_only=False)
        grad = self.model[0].module.embedding.word_embeddings.weight.main_grad.detach().cpu().clone()
        return grad, [len(b.cu_seqlens) - 1 for b in batches]

    def routes_used(self, groups: list) -> list[dict]:
        """For each packed micro-batch of these groups (this rank's share): the experts every router
        of this rank's stage used for every position in a forward (replayed ones, with
        algorithm.routing_replay=r3) as sorted [L, layers, top_k] ids, those layers, and the batch's
        own routes of those layers and their validity."""
        from asyncrl.trainer import moe_routing

        used: dict[int, torch.Tensor] = {}

        def record(router, args, output):
            used[moe_routing.route_layer(router)] = output[1].nonzero()[:, 1].view(output[1].shape[0], -1).cpu()

        hooks = [r.register_forward_hook(record) for c in self.model for r in moe_routing.routers(c)]
        out = []
        try:
            samples = build_samples(groups, AdvantagePlan.of(self.settings.algorithm)).samples
            for batch in (b for update in self._packed_updates(samples) for b in update):
                self._run(self.model, [batch], forward_only=True)
                layers = sorted(used)  # this rank's pipeline stage's MoE layers
                out.append({"layers": layers, "used": torch.stack([used[i] for i in layers], dim=1),
                            "routes": None if batch.routes is None else batch.routes[:, layers].sort(-1).values,
                            "valid": batch.routes_valid})
        finally:
            for h in hooks:
                h.remove()
        return out


class ReusedTrainerRank(ProbedTrainerRank):
    """A ProbedTrainerRank whose process serves one trainer after another (`reinit`): tests that
    build many small trainers in turn import megatron-core once per process (~11 CPU-s here), not
    once per trainer."""

    def reinit(self, settings: TrainerSettings, rank: int, world_size: int) -> None:
        """Forget the previous trainer (its process group, megatron's parallel state) and become
        rank `rank` of a new one (not set up yet: `setup`, as a fresh rank)."""
        from megatron.core import parallel_state as mpu

        self.shutdown()
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        # megatron's models set these for their attention backend and refuse to be built where they are
        # set otherwise (LanguageModule._set_attention_backend): a fresh process has none
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(name, None)
        TrainerRank.__init__(self, settings, rank, world_size)


class ReusedRanks:
    """`count` ReusedTrainerRank actors in the session's Ray cluster that serve a module's trainers in
    turn: `with ranks.trainer(cfg) as group:` is a TrainerGroup of the first world-size of them, set
    up for `cfg` if `setup`, its process group released after (the processes stay)."""

    def __init__(self, count: int = 2):
        import ray

        from asyncrl.run_config import load_config

        cfg = load_config([])
        self.ranks = [ray.remote(ReusedTrainerRank).options(num_cpus=cfg.trainer.num_cpus_per_rank)
                      .remote(TrainerSettings.of(cfg), r, count) for r in range(count)]

    @contextlib.contextmanager
    def trainer(self, cfg, setup: bool = True):
        import ray

        from asyncrl.actors import trainer_world_size
        from asyncrl.trainer.trainer_group import TrainerGroup

        world = trainer_world_size(cfg)
        assert world <= len(self.ranks), f"a trainer of {world} ranks on {len(self.ranks)} rank processes"
        ranks = self.ranks[:world]
        ray.get([r.reinit.remote(TrainerSettings.of(cfg), i, len(ranks)) for i, r in enumerate(ranks)])
        group = TrainerGroup(ranks)
        try:
            if setup:
                group.setup()
            yield group
        finally:
            ray.get([r.shutdown.remote() for r in ranks])

    def kill(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)

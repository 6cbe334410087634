"""PPO's value model (`algorithm.advantage=gae`), trained in the trainer ranks beside the policy.

The critic is the backbone of `algorithm.critic.path` (default: the policy's checkpoint) as a
megatron GPTModel of its own (its own bridge and config, DDP, Adam) whose output layer is a
scalar head (`ValueHead`, zeros at the start). It shares the policy's ranks and parallel groups:
tensor parallel like the policy, data parallel over the same shares; pipeline stages are not
built (validation refuses them). It costs a second model, its gradients and its Adam state on
every rank, and a forward pass and a backward pass of it per step.

In a step (`TrainerRank.train_step`):
  1) `prepare`: before any update, the critic's values V of every trained token of the step's
     packed micro-batches (V_t: the hidden state that predicts token t, as the policy's logits);
     GAE from them and each sample's reward (asyncrl.algorithm.advantages.gae) gives each token's
     advantage (whitened over the step's tokens of every data-parallel rank, with
     algorithm.loss.normalize_adv_std) and return;
  2) the policy's updates read those advantages;
  3) `train`: the critic's updates, one per policy update on the same micro-batches, with the
     clipped value loss (asyncrl.algorithm.losses.value_loss) against the returns.
What the critic sees under asynchrony: the step's tokens were sampled by policies up to
`algorithm.max_staleness` versions old (several within one partial rollout); the critic is the
trainer's current one. Its values estimate the return of the behaviour that produced the
samples it was trained on, a mixture of recent policies: the policy loss's importance ratios
correct the policy's side; the value's bias is what staleness costs PPO here, as in every
asynchronous PPO (AReaL, PipelineRL).
"""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import torch

from asyncrl.algorithm.advantages import EPS, mean_std, packed_gae
from asyncrl.algorithm.losses import LossOutput, value_loss
from asyncrl.trainer.batch import PackedBatch
from asyncrl.trainer.megatron_model import adam, forward_packed, grads_finite, run_schedule, wrap_ddp
from asyncrl.trainer.settings import TrainerSettings

logger = logging.getLogger(__name__)


class ValueHead(torch.nn.Module):
    """In place of GPTModel's output layer: hidden states [s, b, h] -> values [s, b, 1]. The same
    on every tensor-parallel rank (the hidden states are whole there; under sequence parallelism
    they are gathered first, and the gradient goes back to each rank's own positions only: every
    rank computes the same loss over all of them)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, device: torch.device):
        super().__init__()
        # named as GPTModel's output layer's (its sharded state dict reads `output_layer.weight`);
        # zeros: every value is 0 until the critic learns
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        # GPTModel's output layer returns (output, bias)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


class Critic:
    """The value model of one trainer rank (built after megatron's parallel state)."""

    def __init__(self, settings: TrainerSettings, device: torch.device, dtype: torch.dtype):
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        from asyncrl.trainer.hf_bridge import build_gpt_model, load_bridge, uses_transformer_engine

        self.spec = settings.algorithm.critic  # algorithm.critic
        self.path = self.spec.path or settings.model.path
        # its own layers' kind: a critic of another family than the policy's may take other layers
        use_te = uses_transformer_engine(self.path, device.type == "cpu")
        self.device, self.dtype, self.use_te = device, dtype, use_te
        self.dp_size = mpu.get_data_parallel_world_size()
        self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.lr = self.spec.lr or settings.trainer.lr
        self.whiten = settings.algorithm.loss.normalize_adv_std  # the advantages, over the step's tokens
        # a bridge of its own: megatron keeps the schedule's hooks (DDP's, the loss scale) in the
        # model's config object, which the policy's bridge shares with the policy
        bridge = load_bridge(self.path, dtype, use_te=use_te, cpu=device.type == "cpu",
                             recompute=settings.trainer.recompute)
        chunks = build_gpt_model(bridge, device)
        bridge.load_weights(chunks, self.path)
        gpt = chunks[0]
        gpt.output_layer = ValueHead(gpt.config.hidden_size, gpt.config.sequence_parallel, gpt.config.params_dtype,
                                     device)
        gpt.share_embeddings_and_output_weights = False  # the head is not the embedding (tied or not)
        for param in gpt.output_layer.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(c.config, c) for c in chunks]
        self.model = wrap_ddp(chunks)
        self.tp_fold_params = []  # as the policy's (TrainerRank.setup): MoE under TP on CPU
        mc = gpt.config
        if device.type == "cpu" and mc.num_moe_experts and self.tp_size > 1 and not mc.sequence_parallel:
            from asyncrl.trainer.megatron_cpu import tp_fold_expert_params

            self.tp_fold_params = tp_fold_expert_params(self.model)
        self.optimizer = adam(self.model, settings.trainer, dtype, self.lr)
        self.skipped_updates = 0  # in this run so far

    # -- a step ------------------------------------------------------------------------

    @torch.no_grad()
    def prepare(self, updates: list[list[PackedBatch]]) -> dict[str, float]:
        """Values, GAE advantages (whitened, with loss.normalize_adv_std) and returns for every
        micro-batch of the step (set on the batches, on the host); the statistics of the values,
        returns and raw advantages."""
        self.model[0].eval()
        batches = [b for update in updates for b in update]
        for b in batches:
            b.values = run_schedule(self.model, [b], self._forward_step, forward_only=True)[0]
            b.advantages, b.returns = packed_gae(b.values, b.mask, b.seq_index, b.rewards, self.spec.gamma,
                                                 self.spec.lam)
        # whitening and the statistics over the trained tokens of every data-parallel rank
        a, v, g = (_trained(batches, name) for name in ("advantages", "values", "returns"))
        sums = self._dp_sum([a.numel(), a.sum(), (a * a).sum(), v.sum(), g.sum(), (g * g).sum(), (g - v).sum(),
                             ((g - v) ** 2).sum()])
        n, a_sum, a_sq, v_sum, g_sum, g_sq, e_sum, e_sq = sums
        a_mean, a_std = mean_std(n, a_sum, a_sq)
        n = max(n, 1.0)
        if self.whiten:
            for b in batches:
                trained = b.mask > 0
                b.advantages[trained] = ((b.advantages[trained] - a_mean) / (a_std + EPS)).float()
        var_g = g_sq / n - (g_sum / n) ** 2
        var_e = e_sq / n - (e_sum / n) ** 2
        return {"critic/values_mean": v_sum / n, "critic/returns_mean": g_sum / n,
                "critic/advantages_raw_mean": a_mean, "critic/advantages_raw_std": a_std,
                "critic/explained_variance": 1.0 - var_e / var_g if var_g > 1e-12 else 0.0}

    def train(self, updates: list[list[PackedBatch]]) -> dict[str, float]:
        """One critic update per policy update, on the same micro-batches; the metrics."""
        self.model[0].train()
        sums = {"value_loss": 0.0, "value_clip_fraction": 0.0, "tokens": 0.0}
        grad_norms = []
        for batches in updates:
            for m in self.model:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
            outputs = [o for o in run_schedule(self.model, batches, self._forward_step, forward_only=False)
                       if isinstance(o, LossOutput)]
            for param in self.tp_fold_params:
                param.main_grad.div_(self.tp_size)
            if not grads_finite(self.model, self.device):  # as the policy's: NaN or inf never reaches the weights
                self.skipped_updates += 1
                logger.warning("critic: a gradient is not finite: this update is skipped (%d so far)",
                               self.skipped_updates)
            else:
                _, grad_norm, _ = self.optimizer.step()
                grad_norms.append(float(grad_norm or 0.0))
            for o in outputs:
                sums["tokens"] += o.tokens
                for k, v in o.sums.items():
                    sums[k] += v
        # TP ranks hold copies; every data-parallel rank its share
        total = self._dp_sum([float(v) for v in sums.values()])
        tokens = max(total[-1], 1.0)
        return {"critic/value_loss": total[0] / tokens, "critic/value_clip_fraction": total[1] / tokens,
                "critic/grad_norm": max(grad_norms) if grad_norms else 0.0, "critic/lr": self.lr,
                "critic/updates_skipped_nonfinite": self.skipped_updates}

    def _dp_sum(self, values: list) -> list[float]:
        """Sums over the data-parallel ranks, in one all-reduce."""
        from megatron.core import parallel_state as mpu

        vec = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            torch.distributed.all_reduce(vec, group=mpu.get_data_parallel_group())
        return vec.tolist()

    def _forward_step(self, forward_only: bool, num_micro: int, data_iterator, model):
        batch: PackedBatch = next(data_iterator)
        output = forward_packed(model, batch.to(self.device), self.use_te, half=self.dtype != torch.float32)
        return output, partial(self._loss, batch, forward_only, num_micro)

    def _loss(self, batch: PackedBatch, forward_only: bool, num_micro: int, output: torch.Tensor):
        values = output[0, batch.logit_index.to(output.device), 0].float()
        if forward_only:
            return torch.zeros((), device=values.device), values.detach().cpu()
        out = value_loss(values, *(t.to(values.device) for t in (batch.values, batch.returns, batch.mask,
                                                                  batch.weights)), self.spec.value_clip)
        # as the policy's loss: the weights average over the mini-batch of every data-parallel rank
        return out.loss * num_micro * self.dp_size, out

    # -- checkpoints -------------------------------------------------------------------

    def _sharded_state(self) -> dict:
        model_sd = self.model[0].module.sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd)}

    def save(self, path: Path) -> None:
        from megatron.core import dist_checkpointing

        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self._sharded_state(), str(path))

    def load(self, path: Path, load_optimizer: bool = True) -> None:
        """The critic of `save` (model, optimizer); a checkpoint saved without a critic (a run
        without gae) leaves this one as built, and says so."""
        from asyncrl.trainer.safe_dist_checkpoint import load_dist_checkpoint

        if not path.is_dir():
            logger.warning("%s: no critic in this checkpoint (saved without algorithm.advantage=gae): the critic "
                           "starts from %s", path.parent, self.path)
            return
        state = self._sharded_state()
        if not load_optimizer:
            state.pop("optimizer")
        loaded = load_dist_checkpoint(state, str(path))
        self.model[0].module.load_state_dict(loaded["model"])
        if load_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])


def _trained(batches: list[PackedBatch], name: str) -> torch.Tensor:
    """A per-token tensor of the batches (`name`), at their trained tokens, end to end (fp64)."""
    return torch.cat([getattr(b, name)[b.mask > 0] for b in batches] + [torch.zeros(0)]).double()

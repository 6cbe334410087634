"""TrainerRank: one megatron-core rank of the trainer (a plain class; Ray wraps it at the edge).

The ranks of one trainer form their own torch.distributed world (gloo on CPU, NCCL on
GPU) with tensor, pipeline and data parallel groups from `trainer.*_parallel_size`.
Every rank receives the same calls with the same arguments; ranks split the work
among themselves (data parallel shards, tensor/pipeline parallel model parts).

A train step (`train_step`):
  1) trajectories -> samples with group advantages (batch.py), split into
     `trainer.mini_batches_per_step` optimizer updates, each with its aggregation weights,
     data-parallel share and packed micro-batches;
  2) if needed, forward only: proximal logprobs pi_prox (the weights before this step's
     first update) and reference logprobs;
  3) per update: forward + backward over the micro-batches (gradient accumulation), the
     loss from `asyncrl.algorithm.losses`, then data-parallel gradient all-reduce,
     clipping, optimizer step, LR schedule.
With `algorithm.advantage=gae` a value model (critic.py) gives each token its advantage
between 2) and 3), and makes its own updates after the policy's.
Then the statistics of all ranks are reduced into one metrics dict.

Weights leave the trainer in Hugging Face names (mbridge): broadcast to the engines
(`broadcast_weights`, rank 0 sends), or written as an HF checkpoint (`export_hf`).
Megatron distributed checkpoints (`save_checkpoint`/`load_checkpoint`) hold model,
optimizer and scheduler state and load at another tensor-parallel size; loading one runs no
general unpickler (safe_checkpoint.py, safe_dist_checkpoint.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
import warnings
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch

from asyncrl.algorithm.losses import LossOutput, policy_loss
from asyncrl.algorithm.plan import AdvantagePlan
from asyncrl.cpu_cores import bind_this_process
from asyncrl.messages import StagedWeights, TrainerSetupInfo, TrainStepResult
from asyncrl.sync.collective import (
    BucketPlan,
    byte_sum,
    create_group,
    dtype_name,
    pack_buckets,
    send_buckets,
)
from asyncrl.sync.group_store import bind_store_socket, open_group_store, store_host
from asyncrl.sync.shared_buckets import SharedBucketsWriter, device_place
from asyncrl.trainer import lora, mbridge_compat, moe_routing
from asyncrl.trainer.batch import (
    PackedBatch,
    assign_weights,
    build_samples,
    micro_batches,
    pack,
    shard_for_data_parallel,
)
from asyncrl.trainer.logprobs import LOGIT_CHUNK_ELEMENTS, token_logprobs
from asyncrl.trainer.megatron_model import adam, forward_packed, grads_finite, run_schedule, wrap_ddp
from asyncrl.trainer.policy_lag import PolicyLag
from asyncrl.trainer.safe_checkpoint import read_trainer_state, write_trainer_state
from asyncrl.trainer.settings import TrainerSettings
from asyncrl.types import staleness

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "generation_config.json", "chat_template.jinja")


class TrainerRank:
    def __init__(self, settings: TrainerSettings, rank: int, world_size: int):
        self.settings = settings  # the run's model, trainer and algorithm sections, and a few values
        self.advantage_plan = AdvantagePlan.of(settings.algorithm)
        self.rank = rank
        self.world_size = world_size
        self.on_cpu = settings.device == "cpu"
        self.device = torch.device("cpu") if self.on_cpu else torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.float32 if self.on_cpu else torch.bfloat16
        self.step = 0
        self._weight_group = None
        self._store_socket: socket.socket | None = None  # rank 0: the weight group's, bound ahead of its store
        self._world_socket: socket.socket | None = None  # rank 0: the trainer world's, bound ahead of its store
        self._world_store: Any = None
        self._staged: list[torch.Tensor] | None = None  # packed buckets waiting for broadcast_weights
        # Rank 0, with a shared transport: the region the engines read the staged buckets from
        self._shared: SharedBucketsWriter | None = None
        # Rank 0, with algorithm.policy_lag: the packed weights of the last versions staged, oldest
        # first, as (version, buckets, checksums); a sync sends the one policy_lag versions back.
        self._lag = PolicyLag(settings.algorithm.policy_lag)
        # trainer.lora: adapters on the frozen base; weight syncs and exports carry the adapters
        self.lora = settings.trainer.lora if settings.trainer.lora.rank else None
        self.logit_chunk = LOGIT_CHUNK_ELEMENTS  # fp32 logits the loss holds at once (token_logprobs)
        self.skipped_updates = 0  # optimizer updates skipped for a non-finite gradient (_update)

    # -- setup ---------------------------------------------------------------------

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def world_address(self, member_nodes: list[str]) -> tuple[str, int]:
        """Rank 0: bind the trainer world's store socket, kept for `setup`: on loopback when every
        rank runs on this node (`member_nodes`: their Ray node ids), else on this node's address,
        never every interface (asyncrl.sync.group_store, as the weight group's). Returns (host, port)."""
        import ray

        host = store_host(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), member_nodes)
        if self._world_socket is not None:  # bound for a setup that never came
            self._world_socket.close()
        self._world_socket = bind_store_socket(host)
        return host, self._world_socket.getsockname()[1]

    def setup(self, master_addr: str, master_port: int, secret: str) -> TrainerSetupInfo:
        """Join the trainer world (its store hosted by rank 0 on the socket `world_address` bound,
        every key sealed with `secret`, this formation's), build the model from the HF checkpoint,
        the optimizer and schedule."""
        t0 = time.monotonic()
        t = self.settings.trainer
        # megatron-core warns about optional extras (Apex, TE, deprecated defaults) at every
        # model build, on every rank: noise in a run's console, not actionable by users.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
        warnings.filterwarnings("ignore", message=r".*an autograd kernel was not registered.*")
        sock, self._world_socket = self._world_socket, None
        # Kept referenced while the world lives: torch holds a Python store by pointer only.
        self._world_store = open_group_store(master_addr, master_port, self.rank, secret, t.dist_timeout_s,
                                             listen_socket=sock)
        torch.distributed.init_process_group(
            "gloo" if self.on_cpu else "nccl", store=self._world_store,
            rank=self.rank, world_size=self.world_size, timeout=timedelta(seconds=t.dist_timeout_s))
        from megatron.core import parallel_state as mpu
        from megatron.core import tensor_parallel

        from asyncrl.trainer.hf_bridge import build_gpt_model, load_bridge, uses_transformer_engine

        if self.on_cpu:
            from asyncrl.trainer.megatron_cpu import (
                apply_cpu_patches,
                seed_cpu_model_parallel_rng,
                tp_fold_expert_params,
            )

            apply_cpu_patches()
            bind_this_process(t.cpu_cores)
            torch.set_num_threads(t.torch_threads or max(1, int(t.num_cpus_per_rank)))
        mpu.initialize_model_parallel(tensor_model_parallel_size=t.tensor_parallel_size,
                                      pipeline_model_parallel_size=t.pipeline_parallel_size,
                                      expert_model_parallel_size=t.expert_parallel_size)
        if self.on_cpu:
            seed_cpu_model_parallel_rng(self.settings.seed, mpu.get_tensor_model_parallel_rank(),
                                        mpu.get_expert_model_parallel_rank())
        else:
            tensor_parallel.model_parallel_cuda_manual_seed(self.settings.seed)
        self.use_te = uses_transformer_engine(self.settings.model.path, self.on_cpu)
        self.tp_size, self.dp_size = mpu.get_tensor_model_parallel_world_size(), mpu.get_data_parallel_world_size()
        self.dp_rank = mpu.get_data_parallel_rank()

        path = self.settings.model.path
        self.replay_routes = self.settings.algorithm.routing_replay == "r3"
        self.bridge = load_bridge(path, self.dtype, use_te=self.use_te, cpu=self.on_cpu,
                                  routing_replay=self.replay_routes, recompute=t.recompute)
        # Sequence parallelism splits each packed row across the tensor-parallel ranks.
        self.sequence_parallel = self.bridge.config.sequence_parallel
        self.pack_multiple = self.tp_size if self.sequence_parallel else 1
        self.model = wrap_ddp(self._load_model(build_gpt_model, path, adapters=True))
        mc = self.bridge.config
        self.tp_fold_params = []  # MoE under TP without sequence parallelism (CPU): gradients divided by TP
        if self.on_cpu and mc.num_moe_experts and self.tp_size > 1 and not self.sequence_parallel:
            self.tp_fold_params = tp_fold_expert_params(self.model)
        self.router_stats = (moe_routing.RouterStats(self.model, mc.num_layers, mc.num_moe_experts, mc.moe_router_topk)
                             if mc.num_moe_experts else None)
        self.ref_model = None
        if self.advantage_plan.needs_reference:
            self.ref_model = self._load_model(build_gpt_model, path)
            for p in self.ref_model[0].parameters():
                p.requires_grad_(False)
        self.optimizer, self.scheduler = self._build_optimizer()
        self.critic = None  # algorithm.advantage=gae: the value model, trained beside the policy
        if self.advantage_plan.needs_critic:
            from asyncrl.trainer.critic import Critic

            self.critic = Critic(self.settings, self.device, self.dtype)
        self.plan = BucketPlan.build(self._export_specs(), int(t.weight_sync_bucket_mb * 2**20),
                                     int(t.weight_sync_in_place_mb * 2**20))
        if self.settings.algorithm.policy_lag:  # the base policy is version 0 of the engines' lagged weights
            self.stage_weights(0)
            self._staged = None
        n_params = sum(p.numel() for p in self.model[0].parameters())
        info = TrainerSetupInfo(
            setup_s=time.monotonic() - t0, params_this_rank=n_params, transformer_engine=self.use_te, tp=self.tp_size,
            pp=mpu.get_pipeline_model_parallel_world_size(), dp=self.dp_size, weight_bytes=self.plan.total_bytes,
            weight_buckets=len(self.plan.buckets), cpu_cores=sorted(os.sched_getaffinity(0)))
        if self.rank == 0:
            logger.info("trainer ready in %.1fs: %s", info.setup_s, info)
        return info

    def _load_model(self, build, path: str, adapters: bool = False) -> list[torch.nn.Module]:
        chunks = build(self.bridge, self.device)
        self.bridge.load_weights(chunks, path)
        if adapters and self.lora:  # before DDP and the optimizer: they take the trainable parameters
            for c in chunks:
                lora.apply_lora(c, self.lora, self.settings.seed)
        if self.dtype != torch.float32:
            from megatron.core.transformer.module import Float16Module

            chunks = [Float16Module(c.config, c) for c in chunks]
        return chunks

    def _build_optimizer(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t = self.settings.trainer
        optimizer = adam(self.model, t, self.dtype, t.lr)
        updates = t.total_steps * t.mini_batches_per_step
        warmup = t.warmup_steps * t.mini_batches_per_step
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0 if warmup else t.lr, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=warmup,
            lr_decay_steps=max(updates, warmup + 1), lr_decay_style=t.lr_schedule, start_wd=t.weight_decay,
            end_wd=t.weight_decay, wd_incr_steps=max(updates, 1), wd_incr_style="constant")
        return optimizer, scheduler

    # -- training ----------------------------------------------------------------------

    def train_step(self, groups: list, policy_version: int) -> TrainStepResult:
        """One trainer step on these trajectory groups (every rank gets the same list)."""
        t0, cpu0 = time.monotonic(), time.process_time()
        step = build_samples(groups, self.advantage_plan)
        # floats, or 0-d tensors on the device (the loss's statistics), read once at the end of the step
        stats: dict[str, float | torch.Tensor] = {}
        maxima: dict[str, float | torch.Tensor] = {}
        tokens: float | torch.Tensor = 0
        loss_sum: float | torch.Tensor = 0.0  # the objective as the loss defines it (weights sum to 1 per update),
        # averaged over updates
        grad_norms = []
        updates = self._packed_updates(step.samples)
        if self.router_stats is not None:
            self.router_stats.reset()
        need_prox = self.advantage_plan.needs_prox(len(updates))  # with several updates: computed up front
        for batches in updates:
            for b in batches:
                b.prox = self._logprobs(self.model, b) if need_prox else None
                b.ref = self._logprobs(self.ref_model, b) if self.ref_model is not None else None
        critic_metrics = self.critic.prepare(updates) if self.critic is not None else {}  # gae's advantages
        for batches in updates:
            outputs, grad_norm = self._update(batches)
            grad_norms.append(grad_norm)
            for out in outputs:
                tokens = tokens + out.tokens
                loss_sum = loss_sum + out.loss.detach() / len(updates)
                for name, v in out.sums.items():
                    stats[name] = stats.get(name, 0.0) + v
                for name, v in out.maxima.items():
                    maxima[name] = torch.maximum(maxima[name], v) if name in maxima else v
            for b in batches:
                trained = b.mask > 0
                stale = staleness(policy_version, b.versions[trained]).float()
                stats["staleness"] = stats.get("staleness", 0.0) + float(stale.sum())
                maxima["staleness"] = max(maxima.get("staleness", 0.0), float(stale.max()) if stale.numel() else 0.0)
                for s in range(self.settings.algorithm.max_staleness + 1):  # the same names on every rank
                    stats[f"staleness_share_{s}"] = stats.get(f"staleness_share_{s}", 0.0) + float((stale == s).sum())
        if self.critic is not None:  # after the policy's updates: they read the values the step started with
            critic_metrics.update(self.critic.train(updates))
        self.step += 1
        stats, maxima = _read(stats), _read(maxima)
        tokens, loss_sum = _read({"tokens": tokens, "loss": loss_sum}).values()
        metrics = self._reduce_metrics(stats, maxima, tokens, loss_sum)
        metrics.update({f"batch/{k}": v for k, v in step.stats.items()})
        metrics.update(critic_metrics)
        if self.router_stats is not None:
            metrics.update(self.router_stats.reduce(1 if self.sequence_parallel else self.tp_size, self.device))
        metrics["train/grad_norm"] = max(grad_norms) if grad_norms else 0.0
        metrics["train/updates_skipped_nonfinite"] = self.skipped_updates  # in this run so far
        metrics["train/lr"] = self.optimizer.param_groups[0]["lr"]
        metrics["train/step_s"] = time.monotonic() - t0
        # CPU seconds this rank's process used in the step; well below step_s on a CPU run, the
        # rank was not computing: waiting for a core another process held, or blocked.
        metrics["train/cpu_s"] = time.process_time() - cpu0
        metrics["train/tokens_per_s"] = metrics["train/tokens"] / max(metrics["train/step_s"], 1e-9)
        metrics["train/step"] = self.step
        return TrainStepResult(metrics, staleness_max=round(metrics["train/staleness_max"]),
                               tokens=round(metrics["train/tokens"]), filtered=step.filtered)

    def _packed_updates(self, samples: list) -> list[list[PackedBatch]]:
        """Per optimizer update: its aggregation weights, this rank's share, packed micro-batches."""
        k, aggregation = self.settings.trainer.mini_batches_per_step, self.settings.algorithm.loss.aggregation
        updates = []
        for mini in (samples[i::k] for i in range(k)):
            if mini:
                assign_weights(mini, aggregation)
                mine = shard_for_data_parallel(mini, self.dp_rank, self.dp_size)
                t = self.settings.trainer
                updates.append([pack(mb, self.pack_multiple)
                                for mb in micro_batches(mine, t.max_tokens_per_micro_batch, t.micro_batch_size)])
        return updates

    def _update(self, batches: list[PackedBatch]) -> tuple[list[LossOutput], float]:
        """Forward + backward over the micro-batches, then one optimizer step."""
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.router_stats is not None:  # router health over the training forwards only
            self.router_stats.enabled = True
        try:
            results = self._run(self.model, batches, forward_only=False)
        finally:
            if self.router_stats is not None:
                self.router_stats.enabled = False
        for param in self.tp_fold_params:
            param.main_grad.div_(self.tp_size)
        outputs = [r for r in results if isinstance(r, LossOutput)]
        if not grads_finite(self.model, self.device):  # the last guard: NaN or inf never reaches the weights
            self.skipped_updates += 1
            logger.warning("trainer step %d: a gradient is not finite (loss %s): this update is skipped (%d so far)",
                           self.step + 1, [float(o.loss) for o in outputs][:4], self.skipped_updates)
            return outputs, 0.0
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=1)
        return outputs, float(grad_norm or 0.0)

    @torch.no_grad()
    def _logprobs(self, model: list[torch.nn.Module], batch: PackedBatch) -> torch.Tensor | None:
        for m in model:
            m.eval()
        out = self._run(model, [batch], forward_only=True)
        return out[0] if out else None  # None on pipeline stages that do not hold the output layer

    def _run(self, model: list[torch.nn.Module], batches: list[PackedBatch], forward_only: bool) -> list:
        """megatron's schedule (handles pipeline stages) over our packed micro-batches."""
        try:
            return run_schedule(model, batches, self._forward_step, forward_only)
        finally:
            if self.replay_routes:
                moe_routing.clear(model)

    def _forward_step(self, forward_only: bool, num_micro: int, data_iterator, model):
        batch: PackedBatch = next(data_iterator).to(self.device)
        routes, valid = self._local_rows(batch.routes), self._local_rows(batch.routes_valid)
        if self.replay_routes:
            if routes is None:
                raise ValueError("algorithm.routing_replay=r3, but a micro-batch has no routes (no sample carries any)")
            moe_routing.replay(model, routes)
        if self.router_stats is not None:
            self.router_stats.batch(routes, valid)
        output = self._forward(model, batch)
        if self.replay_routes:
            moe_routing.after_forward(model)
        return output, partial(self._loss, batch, forward_only, num_micro)

    def _local_rows(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's rows of a per-position tensor: a 1/TP slice under sequence parallelism."""
        if rows is None or not self.sequence_parallel:
            return rows
        from megatron.core import parallel_state as mpu

        n = rows.shape[0] // self.tp_size
        return rows[mpu.get_tensor_model_parallel_rank() * n:][:n]

    def _forward(self, model: torch.nn.Module, batch: PackedBatch) -> torch.Tensor:
        return forward_packed(model, batch, self.use_te, half=self.dtype != torch.float32)

    def _loss(self, batch: PackedBatch, forward_only: bool, num_micro: int, logits: torch.Tensor):
        # The rows that predict response tokens, at the sampling temperature (the engines report
        # logprobs of the temperature-scaled distribution they sample from), in fp32 a chunk at a time.
        logp, entropy = token_logprobs(logits[0], batch.logit_index, batch.targets, self.settings.temperature,
                                       with_entropy=not forward_only, chunk_elements=self.logit_chunk)
        if forward_only:
            return torch.zeros((), device=logp.device), logp.detach().cpu()
        prox = batch.prox.to(self.device) if batch.prox is not None else logp.detach()
        ref = batch.ref.to(self.device) if batch.ref is not None else None
        out = policy_loss(logp, batch.mu, batch.advantages, batch.mask, batch.weights, self.settings.algorithm.loss,
                          prox=prox, ref_logp=ref, entropy=entropy, seq_index=batch.seq_index)
        # Our weights already average over the whole mini-batch of all data-parallel ranks;
        # megatron divides each micro-batch loss by their number and DDP averages over ranks.
        return out.loss * num_micro * self.dp_size, out

    def _reduce_metrics(self, sums: dict[str, float], maxima: dict[str, float], tokens: float,
                        loss: float) -> dict[str, float]:
        """Sum/max over all ranks (TP ranks hold copies: divided out) into means per trained token."""
        names = sorted(set(sums) | {"clip_fraction", "clip_low", "clip_high", "ratio", "is_weight", "staleness",
                                    "is_weight_truncated", "entropy", "mismatch_kl", "kl_ref", "icepop_masked"})
        # on the rank's device: NCCL reduces CUDA tensors only
        vec = torch.tensor([sums.get(n, 0.0) for n in names] + [loss, float(tokens)], dtype=torch.float64,
                           device=self.device)
        torch.distributed.all_reduce(vec)
        vec /= self.tp_size
        max_names = sorted(set(maxima) | {"ratio", "is_weight", "staleness", "mismatch_abs_logratio"})
        mvec = torch.tensor([maxima.get(n, 0.0) for n in max_names], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(mvec, op=torch.distributed.ReduceOp.MAX)
        total = float(vec[-1])
        out = {f"train/{n}_mean": float(v) / max(total, 1.0) for n, v in zip(names, vec[:-2].tolist())}
        out["train/loss"] = float(vec[-2])
        out.update({f"train/{n}_max": float(v) for n, v in zip(max_names, mvec.tolist())})
        out["train/tokens"] = total
        return out

    # -- weights out -----------------------------------------------------------------

    def _export(self):
        """(HF name, full tensor) pairs; every rank must drain it (TP shards are gathered). With
        trainer.lora: the adapters only, PEFT-named (the engines load them as a vLLM adapter)."""
        if self.lora:
            return (item for m in self._gpt_models() for item in lora.peft_tensors(m, self.bridge.config))
        return self.bridge.export_weights([m.module for m in self.model])

    def _gpt_models(self) -> list[torch.nn.Module]:
        from megatron.core.utils import unwrap_model

        return unwrap_model(self.model)

    def _export_specs(self) -> list[tuple[str, str, list[int]]]:
        return [(name, dtype_name(t.dtype), list(t.shape)) for name, t in self._export()]

    def weight_plan(self) -> list:
        return self.plan.to_wire()

    def adapter_config(self) -> dict | None:
        return lora.peft_config(self.lora, self.settings.model.path) if self.lora else None

    def weight_group_address(self, member_nodes: list[str]) -> tuple[str, int]:
        """Rank 0: bind the weight-broadcast group's store socket, kept for `init_weight_group`:
        on loopback when every other member runs on this node (`member_nodes`: their Ray node
        ids), else on this node's address (asyncrl.sync.group_store). Returns (host, port)."""
        import ray

        host = store_host(ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), member_nodes)
        if self._store_socket is not None:  # bound for a formation that never came
            self._store_socket.close()
        self._store_socket = bind_store_socket(host)
        return host, self._store_socket.getsockname()[1]

    def init_weight_group(self, host: str, port: int, world_size: int, backend: str, secret: str) -> None:
        """Rank 0 joins the broadcast group (`backend`: asyncrl.sync.collective.BACKENDS) as its
        source, hosting its store on the socket `weight_group_address` bound (or, without one, on
        (host, port)); `secret`: this formation's. Other ranks have nothing to join."""
        if self.rank == 0:
            self._close_shared()  # this formation broadcasts
            sock, self._store_socket = self._store_socket, None
            self._weight_group = create_group(host, port, 0, world_size, backend, secret,
                                              self.settings.trainer.dist_timeout_s, listen_socket=sock)

    def weight_sync_place(self) -> dict:
        """Where this rank runs, for the choice of transport (asyncrl.sync.shared_buckets.choose_transport)."""
        import ray

        return device_place(ray.get_runtime_context().get_node_id(), self.device)

    def init_shared_weights(self, transport: str, secret: str) -> dict | None:
        """Rank 0: create this formation's shared region (`transport`: shared_memory or cuda_ipc),
        named after `secret`; returns what the engines need besides the secret to open it (wire
        data). The buckets are packed into it from the next `stage_weights` on."""
        if self.rank != 0:
            return None
        self._close_shared()
        self._weight_group = None  # the broadcast group of an earlier formation, if any
        self._shared = SharedBucketsWriter(transport, self.plan, secret, self.device)
        return self._shared.share

    def shared_weights_joined(self) -> None:
        """Every engine worker holds the shared region: its name goes (nothing else can open it)."""
        if self._shared is not None:
            self._shared.unlink_name()

    def _close_shared(self) -> None:
        if self._shared is not None:
            self._shared.close()
            self._shared = None

    def stage_weights(self, version: int, newest: bool = False) -> StagedWeights:
        """Export the current weights (policy `version`) and pack them into the broadcast buckets
        ahead of the sync, while the engines still generate (the export gathers tensor-parallel
        shards, so every rank takes part; rank 0 keeps the buckets). With algorithm.policy_lag = L
        the buckets staged for the broadcast are those of version - L (or the oldest kept: the
        weights this trainer started from); `newest` stages the current weights whatever the lag
        and starts the lag's history again from them (a restored run; the final evaluation).
        Returns seconds, the version staged and its per-tensor checksums."""
        t0 = time.monotonic()
        if self.rank != 0:
            for _ in self._export():
                pass
            return StagedWeights(time.monotonic() - t0, {}, version)
        sums: dict[str, torch.Tensor] = {}

        def tensors():
            for name, t in self._export():
                sums[name] = byte_sum(t)  # on the device, read once below: no synchronisation per tensor
                yield name, t

        # Without a lag the buckets go straight into the shared region, if any (no engine reads it
        # now: the previous sync has returned); with one, the kept versions need memory of their own.
        out = self._shared.buffers() if self._shared is not None and not self.settings.algorithm.policy_lag else None
        buckets = pack_buckets(self.plan, tensors(), self.device, out)
        checksums = dict(zip(sums, torch.stack(list(sums.values())).tolist()))
        staged_version, (self._staged, staged_checksums) = self._lag.stage(version, (buckets, checksums), newest)
        if self._shared is not None:
            self._shared.write(self._staged)  # a copy only with a lag
        return StagedWeights(time.monotonic() - t0, staged_checksums, staged_version)

    def broadcast_weights(self) -> float:
        """Send the staged buckets to every engine worker (rank 0; a no-op elsewhere; with a shared
        transport they are in the shared region already, staged there). Returns seconds."""
        t0 = time.monotonic()
        if self.rank == 0:
            if self._staged is None:
                raise RuntimeError("broadcast_weights without stage_weights: nothing to send")
            if self._shared is None:
                send_buckets(self._weight_group, self._staged)
            self._staged = None
        return time.monotonic() - t0

    def export_hf(self, out_dir: str) -> str:
        """Write the current policy as a Hugging Face checkpoint (with the tokenizer files). With
        trainer.lora: the adapters merged into the base weights, and the adapters alone in PEFT's
        format in `out_dir`/adapter (adapter_config.json, adapter_model.safetensors)."""
        if self.lora:
            views = [mbridge_compat.WeightsView(m, *lora.merged_weights(m)) for m in self._gpt_models()]
            self.bridge.save_weights(views, out_dir)
            tensors = {name: t.cpu().clone() for name, t in self._export()}  # q, k, v share A: own copies
            if self.rank == 0:
                lora.save_peft_adapter(Path(out_dir) / "adapter", tensors,
                                       lora.peft_config(self.lora, self.settings.model.path))
        else:
            self.bridge.save_weights([m.module for m in self.model], out_dir)
        if self.rank == 0:
            src = Path(self.settings.model.tokenizer_path or self.settings.model.path)
            for name in TOKENIZER_FILES:
                if (src / name).exists():
                    shutil.copy(src / name, Path(out_dir) / name)
        torch.distributed.barrier()
        return out_dir

    # -- checkpoints -------------------------------------------------------------------

    def _sharded_state(self) -> dict[str, Any]:
        model_sd = self.model[0].module.sharded_state_dict()
        return {"model": model_sd, "optimizer": self.optimizer.sharded_state_dict(model_sd)}

    def save_checkpoint(self, ckpt_dir: str) -> str:
        """Megatron distributed checkpoint of model + optimizer, plus scheduler and step (rank 0)."""
        from megatron.core import dist_checkpointing

        path = Path(ckpt_dir)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(self._sharded_state(), str(path))
        if self.critic is not None:
            self.critic.save(path / "critic")
        if self.rank == 0:
            write_trainer_state(path, self.step, self.scheduler.state_dict())
        torch.distributed.barrier()
        return str(path)

    def load_checkpoint(self, ckpt_dir: str, load_optimizer: bool = True) -> int:
        """Model (and optimizer, scheduler) state from `save_checkpoint`; returns the trainer's step.
        Raises `CheckpointRefused` for a checkpoint file that holds anything but data: nothing of
        it runs (the weights may be half loaded then: a refused checkpoint ends the run)."""
        from asyncrl.trainer.safe_dist_checkpoint import load_dist_checkpoint

        step, scheduler_state = read_trainer_state(ckpt_dir)
        state = self._sharded_state()
        if not load_optimizer:
            state.pop("optimizer")
        loaded = load_dist_checkpoint(state, ckpt_dir)
        self.model[0].module.load_state_dict(loaded["model"])
        if load_optimizer:
            self.optimizer.load_state_dict(loaded["optimizer"])
        if self.critic is not None:
            self.critic.load(Path(ckpt_dir) / "critic", load_optimizer)
        self.step = step
        self._lag.clear()  # the restored weights are the oldest a lagged sync can send now
        if load_optimizer:
            self.scheduler.load_state_dict(scheduler_state)
        return self.step

    def shutdown(self) -> None:
        self._close_shared()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _read(values: dict[str, Any]) -> dict[str, float]:
    """`values` as floats, the tensors among them read in one device-to-host copy (all on one device)."""
    names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    read = torch.stack([values[k].double().reshape(()) for k in names]).tolist() if names else []
    return {k: float(v) for k, v in {**values, **dict(zip(names, read))}.items()}

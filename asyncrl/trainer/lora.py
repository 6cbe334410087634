"""LoRA adapters on megatron-core's linear layers (`trainer.lora`), and their export.

Our own small module, not a library's: megatron-core 0.16.1 has no LoRA, and Megatron-Bridge's
(0.3.1, the newest pip resolves with mcore 0.16) imports Transformer Engine unconditionally, pins
transformers < 5 and renames the wrapped layers' parameters (`linear_qkv.to_wrap.weight`), which
mbridge's export then cannot map (docs/lora.md). Here the base layers keep their names: each
adapter is a sibling module (`self_attention.linear_qkv_lora`) whose output a forward hook adds to
its layer's.

Tensor parallelism, as the layer the adapter sits on (x: the layer's input, s = alpha / rank):
- column-parallel layers (linear_qkv, linear_fc1): A [r, in] is replicated, B [out / tp, r] is
  split like the weight's rows; h = x A^T enters the parallel region (identity forward,
  all-reduce of its gradient), out_local += s h B_local^T;
- row-parallel layers (linear_proj, linear_fc2): A [r, in / tp] is split like the weight's
  columns, B [out, r] is replicated; h = all-reduce(x_local A_local^T), out += s h B^T.
So a merged weight is local: W_local + s B_local A (column) or W_local + s B A_local (row).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from asyncrl.config.schema import LoRAConfig

# megatron's module names of the layers an adapter can sit on -> how the layer is split
LORA_TARGETS = {"linear_qkv": "column", "linear_fc1": "column", "linear_proj": "row", "linear_fc2": "row"}
# -> their Hugging Face projections (Qwen2, Qwen3, Llama): fused layers export one adapter per
# projection, with the shared A and the projection's rows of B (exactly the fused update)
HF_PROJECTIONS = {"linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
                  "linear_proj": ("self_attn", ("o_proj",)),
                  "linear_fc1": ("mlp", ("gate_proj", "up_proj")), "linear_fc2": ("mlp", ("down_proj",))}
PEFT_PREFIX = "base_model.model.model.layers"


class LoRAAdapter(torch.nn.Module):
    """A and B of one adapted layer (this rank's shards), and the output they add."""

    def __init__(self, base: torch.nn.Module, kind: str, lora: LoRAConfig, tp_size: int, generator: torch.Generator):
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.kind, self.scale = kind, lora.alpha / lora.rank
        out_local, in_local = base.weight.shape
        device, dtype = base.weight.device, base.weight.dtype
        in_full = in_local * tp_size if kind == "row" else in_local
        # PEFT's init: A kaiming-uniform, B zero (the adapted model starts as the base model). The
        # whole A is drawn from a generator every rank seeds alike, so replicas and shards agree.
        a = torch.empty(lora.rank, in_full)
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        if kind == "row":
            from megatron.core import parallel_state as mpu

            a = a.chunk(tp_size, dim=1)[mpu.get_tensor_model_parallel_rank()]
        self.A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = torch.nn.Parameter(torch.zeros(out_local, lora.rank, device=device, dtype=dtype))
        split = self.B if kind == "column" else self.A
        set_tensor_model_parallel_attributes(split, True, 0 if kind == "column" else 1, 1)
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        h = torch.nn.functional.linear(self.dropout(x), self.A)
        if self.kind == "column":
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.B) * self.scale

    def delta(self) -> torch.Tensor:
        """s B A: what merging adds to this rank's shard of the layer's weight."""
        return (self.B.float() @ self.A.float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """For megatron's distributed checkpoint: the split factor sharded like its layer."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axis = {"B": 0} if self.kind == "column" else {"A": 1}
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                   sharded_offsets)


def _parent(layer: torch.nn.Module, target: str) -> torch.nn.Module:
    """The module of a transformer layer that holds `target` (and its adapter, beside it)."""
    return layer.self_attention if target in ("linear_qkv", "linear_proj") else layer.mlp


def adapted_layers(model: torch.nn.Module, targets: list[str]) -> Iterator[tuple[int, str, torch.nn.Module, str]]:
    """(global layer index, target name, its parent module, kind) for every layer to adapt."""
    for layer in model.decoder.layers:
        for target in targets:
            parent = _parent(layer, target)
            if not hasattr(parent, target):
                raise ValueError(f"trainer.lora.target_modules: layer {layer.layer_number - 1} has no {target} "
                                 f"(a mixture-of-experts MLP: adapt linear_qkv and linear_proj only)")
            yield layer.layer_number - 1, target, parent, LORA_TARGETS[target]


def apply_lora(model: torch.nn.Module, lora: LoRAConfig, seed: int) -> int:
    """Freeze `model` (an unwrapped GPTModel) and give each target layer an adapter; returns the
    number of adapter parameters on this rank. Call before DDP and the optimizer are built:
    they hold (and keep state for) the parameters that need gradients only."""
    from megatron.core import parallel_state as mpu

    if getattr(model.config, "sequence_parallel", False):
        raise NotImplementedError("trainer.lora with sequence parallelism (TP MoE on GPUs) is not supported yet")
    for p in model.parameters():
        p.requires_grad_(False)
    tp = mpu.get_tensor_model_parallel_world_size()
    count = 0
    for index, target, parent, kind in adapted_layers(model, lora.target_modules):
        base = getattr(parent, target)
        generator = torch.Generator().manual_seed(seed * 100_003 + index * len(LORA_TARGETS)
                                                  + list(LORA_TARGETS).index(target))
        adapter = LoRAAdapter(base, kind, lora, tp, generator)
        parent.add_module(f"{target}_lora", adapter)
        base.register_forward_hook(_add_adapter_output(adapter))
        count += adapter.A.numel() + adapter.B.numel()
    return count


def _add_adapter_output(adapter: LoRAAdapter):
    def hook(module, args, output):
        out, bias = output  # megatron's parallel linears return (output, bias)
        return out + adapter(args[0]).to(out.dtype), bias

    return hook


def adapters(model: torch.nn.Module) -> Iterator[tuple[int, str, torch.nn.Module, LoRAAdapter]]:
    """(global layer index, target, the adapted layer, its adapter) of a model apply_lora changed."""
    for layer in model.decoder.layers:
        for target in LORA_TARGETS:
            parent = _parent(layer, target)
            adapter = getattr(parent, f"{target}_lora", None)
            if adapter is not None:
                yield layer.layer_number - 1, target, getattr(parent, target), adapter


def merged_weights(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The adapted layers' merged weights by parameter name (this rank's shards, with their
    tensor-parallel attributes), and the names of the adapters' own parameters: what the
    export reads instead of, and besides, the model's parameters (mbridge_compat.WeightsView)."""
    merged: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    hidden: set[str] = set()
    for _, _, layer, adapter in adapters(model):
        w = layer.weight
        m = (w.float() + adapter.delta()).to(w.dtype)
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
            if hasattr(w, attr):
                setattr(m, attr, getattr(w, attr))
        merged[names[id(w)]] = m
        hidden.update(names[id(p)] for p in adapter.parameters())
    return merged, hidden


def peft_tensors(model: torch.nn.Module, mcfg) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters as PEFT names the whole tensors (every tensor-parallel rank must drain it:
    the split factors are gathered). `mcfg`: the model's TransformerConfig (head layout)."""
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    for index, target, _, adapter in adapters(model):
        a, b = adapter.A.detach(), adapter.B.detach()
        if adapter.kind == "row":
            a = torch.cat(_gather(a, tp), dim=1) if tp > 1 else a
            shards = [b]
        else:
            shards = _gather(b, tp) if tp > 1 else [b]
        module, projections = HF_PROJECTIONS[target]
        for projection, b_part in zip(projections, _split_rows(target, shards, mcfg)):
            name = f"{PEFT_PREFIX}.{index}.{module}.{projection}"
            yield f"{name}.lora_A.weight", a
            yield f"{name}.lora_B.weight", b_part


def _gather(t: torch.Tensor, tp: int) -> list[torch.Tensor]:
    from megatron.core import parallel_state as mpu

    out = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(out, t.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return out


def _split_rows(target: str, shards: list[torch.Tensor], mcfg) -> list[torch.Tensor]:
    """B's rows per Hugging Face projection, from each tensor-parallel rank's rows (megatron's
    layouts, as mbridge splits the fused weights: linear_qkv holds, per query group, that group's
    q heads then its k and v head; each rank's linear_fc1 rows are its gate rows then its up rows)."""
    if target == "linear_fc1":
        gate, up = zip(*(s.chunk(2, dim=0) for s in shards))
        return [torch.cat(gate), torch.cat(up)]
    b = torch.cat(shards)
    if target != "linear_qkv":
        return [b]
    groups, head = mcfg.num_query_groups, mcfg.kv_channels
    q_rows = mcfg.num_attention_heads // groups * head
    g = b.view(groups, q_rows + 2 * head, b.shape[-1])
    return [g[:, :q_rows].reshape(-1, b.shape[-1]), g[:, q_rows:q_rows + head].reshape(-1, b.shape[-1]),
            g[:, q_rows + head:].reshape(-1, b.shape[-1])]


def peft_config(lora: LoRAConfig, base_model_path: str) -> dict:
    """adapter_config.json for the tensors of peft_tensors (PEFT and vLLM read it)."""
    modules = sorted(p for t in lora.target_modules for p in HF_PROJECTIONS[t][1])
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": modules, "bias": "none",
            "base_model_name_or_path": base_model_path, "fan_in_fan_out": False, "inference_mode": True}


def save_peft_adapter(out_dir: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """PEFT's adapter format, which PEFT's from_pretrained and vLLM's LoRARequest load."""
    import safetensors.torch

    out_dir.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

"""Hugging Face <-> Megatron weights for Qwen2, Qwen3, Llama, Mistral and Gemma 3 (dense), Qwen3-MoE,
Mixtral, Qwen2-MoE, DeepSeek-V3 and GLM-4.5 (mixture-of-experts) and Qwen3.5 (hybrid) models, through
mbridge.

mbridge (what verl uses) maps HF tensor names and layouts to megatron-core's GPTModel
(fused QKV, fused gate/up, tensor-parallel splits) and back. We use it as is, except
where it falls short here; each gap is closed in `load_bridge` / `build_gpt_model` (the ones
that reach into mbridge's or megatron's private API through mbridge_compat.py):
- its layer spec hard-codes Transformer Engine, which needs CUDA: without TE we build
  megatron's local layers, whose layer norms are separate modules, so their names are
  added to its name map (QK-norm keeps TE's names, `self_attention.q_layernorm`, and maps as is);
- with transformers 5 `rope_theta` moved into `config.rope_parameters`, and published configs
  leave out the head_dim HF derives (Mixtral, Mistral): `read_model_config` fills both in;
- rope scaling: with transformers 5 mbridge's llama bridge never sees `rope_scaling` (so
  llama3 scaling is dropped), and where it did it mapped any "factor" to linear position
  interpolation; megatron's own llama3 scaling fixes low/high_freq_factor and the original
  context (1, 4, 8192). We compute HF's frequencies and give them to megatron's rotary embedding;
- Qwen2Bridge writes the tied-embedding mapping into a dict shared by every Qwen2/Qwen3 bridge
  of the process: each bridge gets its own output-layer mapping;
- `Bridge.get_model` moves modules with `.cuda()`: `build_gpt_model` builds from its
  model provider instead;
- it has no Mistral bridge: Mistral is Llama's architecture under another model_type (with
  Mistral-7B-v0.1's sliding window on every layer: megatron's `window_size`), so "mistral" is
  registered to its LLaMA bridge;
- its MoE bridges fix where the router's softmax goes (Mixtral's before the top-k, which skips the
  renormalisation HF's Mixtral router does); `renormalises_top_k` sets it from the HF config;
- its Qwen2-MoE bridge maps the shared expert's gate but does not ask megatron to build it:
  `moe_shared_expert_gate` is set;
- it has no Qwen3.5 bridge: `mbridge_compat.qwen3_5_text_bridge`, dense or MoE (its layers: trainer/qwen3_5.py);
- its Gemma 3 bridge is the vision-language model's, TE only: `mbridge_compat.gemma3_text_bridge`
  (its layers: trainer/gemma3.py);
- its GLM-4.5 bridge maps no local-layer norm and always maps the output layer to lm_head
  (`mbridge_compat.glm4_moe_bridge`), always builds a QKV bias, sizes one shared expert, sets no
  expert groups (`glm4_moe_settings`);
- its DeepSeek-V3 bridge passes megatron-core 0.16.1 a config argument under an older name (it
  cannot be built as is: a subclass renames it), sets no group-limited routing, moves the router's
  correction bias after every step, builds a checkpoint's multi-token-prediction layer (HF and
  vLLM skip it), reads checkpoints in bf16 only, and maps only TE's names of the MLA's q/kv norms
  (`deepseek_v3_settings`; megatron's MLA itself needs megatron_cpu.mla_without_te without TE).
What the conversion is not known to do exactly (docs/models.md) is refused by
`read_model_config` before anything is built, in one line.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from asyncrl.config.models import (
    GEMMA3_TEXT,
    OWN_LAYER_MODEL_TYPES,
    QWEN3_5_MOE_TEXT,
    QWEN3_5_TEXT,
    model_problem,
    rope_parameters,
)
from asyncrl.config.schema import MOE_MODEL_TYPES
from asyncrl.trainer import mbridge_compat, megatron_cpu

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# Model types whose layers are asyncrl's own (megatron's local layers with its modules), with or
# without Transformer Engine: Qwen3.5's gated DeltaNet (trainer/qwen3_5.py), Gemma 3's norms and
# sliding windows (trainer/gemma3.py)
LOCAL_LAYERS_ONLY = OWN_LAYER_MODEL_TYPES



def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (it needs CUDA; never on a CPU machine)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises OSError/RuntimeError, not only ImportError, without CUDA
        return False
    return True


def uses_transformer_engine(model_path: str, on_cpu: bool) -> bool:
    """Whether the trainer builds Transformer Engine's layers for this checkpoint (a directory or
    a Hub id): on a GPU where TE imports, but for the model types whose layers are our own
    (LOCAL_LAYERS_ONLY)."""
    if on_cpu or not transformer_engine_available():
        return False
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path).model_type not in LOCAL_LAYERS_ONLY


def read_model_config(model_path: str, tp_size: int = 1) -> PreTrainedConfig:
    """The HF config at `model_path` (a directory or a Hub id), checked: a ValueError of one line
    names what asyncrl's trainer cannot load exactly (an unsupported model type, a feature).
    Validation runs the same check before anything starts (asyncrl/config/models.py)."""
    from transformers import AutoConfig

    problem = model_problem(model_path, tp_size)
    if problem:
        raise ValueError(f"{model_path}: {problem}")
    hf = AutoConfig.from_pretrained(model_path)
    # Published checkpoints leave out what HF derives, where mbridge reads the key itself: Mixtral's
    # and Mistral's configs have no head_dim (transformers 5 saves a MixtralConfig's as null), and
    # configs written before transformers 5 keep rope_theta at the top level, not in rope_parameters.
    if getattr(hf, "head_dim", None) is None and not getattr(hf, "kv_lora_rank", None):  # MLA has no head_dim
        hf.head_dim = hf.hidden_size // hf.num_attention_heads
    if getattr(hf, "rope_theta", None) is None:  # (Gemma 3's: its full-attention layers')
        hf.rope_theta = rope_parameters(hf).get("rope_theta", 10000.0)
    return hf


def hf_rope_inv_freq(hf: PreTrainedConfig) -> torch.Tensor | None:
    """HF's rotary inverse frequencies for this config (with rope settings per layer type, Gemma 3's,
    its full-attention layers'), or None for plain rope (megatron's equal them)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = rope_parameters(hf).get("rope_type", "default")
    if rope_type == "default":
        return None
    layer_type = {"layer_type": "full_attention"} if hf.model_type == GEMMA3_TEXT else {}  # rope per layer type
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, **layer_type)
    if attention_factor != 1.0:  # SUPPORTED_ROPE_TYPES have none; megatron's rope would not apply it
        raise ValueError(f"rope_type {rope_type!r}: attention scaling {attention_factor} is not supported")
    return inv_freq.float()


def renormalises_top_k(hf: PreTrainedConfig) -> bool:
    """Whether HF's router renormalises the top-k probabilities (softmax over the chosen experts'
    logits); if not, they are the full softmax's (Qwen2-MoE's `norm_topk_prob: false`)."""
    return hf.model_type == "mixtral" or bool(getattr(hf, "norm_topk_prob", True))  # Mixtral always does


def load_bridge(model_path: str, dtype: torch.dtype, use_te: bool, cpu: bool, routing_replay: bool = False,
                recompute: str = "none"):
    """An mbridge bridge for the HF checkpoint at `model_path`, set up for our layers (with
    `routing_replay`, MoE routers that can replay given experts: moe_routing.py; `recompute`:
    trainer.recompute, megatron's activation recomputation).

    Must be called after megatron's parallel state is initialised (the bridge reads it).
    """
    from mbridge import AutoBridge
    from mbridge.core import register_model
    from mbridge.models import LLaMABridge
    from megatron.core import parallel_state as mpu

    register_model("mistral")(LLaMABridge)  # mbridge's public registry (idempotent); see the docstring
    register_model("deepseek_v3")(mbridge_compat.deepseek_v3_bridge())
    register_model("glm4_moe")(mbridge_compat.glm4_moe_bridge())
    register_model(QWEN3_5_TEXT)(mbridge_compat.qwen3_5_text_bridge())
    register_model(QWEN3_5_MOE_TEXT)(mbridge_compat.qwen3_5_text_bridge(moe=True))
    register_model(GEMMA3_TEXT)(mbridge_compat.gemma3_text_bridge())
    hf = read_model_config(model_path, mpu.get_tensor_model_parallel_world_size())
    bridge = AutoBridge.from_config(hf, dtype=dtype)
    moe = hf.model_type in MOE_MODEL_TYPES
    bridge.set_extra_args(
        # megatron trains MoE layers under TP only with sequence parallelism; packed rows are then
        # padded to a multiple of TP (batch.pack). Dense layers keep whole rows on every rank. Torch
        # norms (no TE: CPU) refuse sequence parallelism: there megatron_cpu lifts the MoE guard.
        sequence_parallel=moe and use_te and mpu.get_tensor_model_parallel_world_size() > 1,
        use_cpu_initialization=cpu,
        # Megatron's fused softmax is a CUDA extension of its own (scaled_masked_softmax_cuda), not
        # in its wheel: on, without it, the first attention fails (seen on an H200, docs/gpu.md).
        # Off, megatron's local attention uses torch's softmax; TE's attention has its own kernels.
        masked_softmax_fusion=not cpu and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        bias_dropout_fusion=not cpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if moe and not use_te:
        # mbridge's MoE bridges ask for TE's fused norms and grouped GEMM; megatron's local layers
        # have neither, so the experts run as SequentialMLP (one linear pair per expert).
        bridge.set_extra_args(persist_layer_norm=False, moe_grouped_gemm=False, bias_activation_fusion=False)
        mbridge_compat.map_sequential_experts(bridge)
        # The shared experts' overlap with the dispatcher runs them on a CUDA stream.
        bridge.set_extra_args(moe_shared_expert_overlap=False)
    if moe:
        # Megatron's top-k of the softmax (pre_softmax) keeps the full softmax's probabilities;
        # its softmax of the top-k logits renormalises them. Replayed routes take either from the
        # router's own logits (moe_routing.py).
        bridge.set_extra_args(moe_router_pre_softmax=not renormalises_top_k(hf))
    if hf.model_type in ("qwen2_moe", QWEN3_5_MOE_TEXT):  # sigmoid(x . gate) scales the shared expert, as HF's
        bridge.set_extra_args(moe_shared_expert_gate=True)
    if hf.model_type in ("mistral", "mixtral") and getattr(hf, "sliding_window", None) is not None:
        # HF and vLLM apply Mistral's window on every layer whenever it is set: W keys, the query's own
        # included (megatron's window in flash-attention's terms; TE and the packed attention read it)
        bridge.set_extra_args(window_size=(hf.sliding_window - 1, 0))
    if hf.model_type == "deepseek_v3":
        deepseek_v3_settings(bridge, hf, use_te)
    if hf.model_type == "glm4_moe":
        glm4_moe_settings(bridge, hf)
    if routing_replay:
        if not moe:
            raise ValueError(f"{model_path}: routing replay needs a mixture-of-experts model, not {hf.model_type}")
        # Each router then holds a RouterReplay; megatron keeps every one made in the process in a
        # list that only grows (the trainer addresses its own routers, never that list).
        mbridge_compat.clear_router_replays()
        bridge.set_extra_args(moe_enable_routing_replay=True)
    if recompute == "full":  # each layer's input kept, the rest recomputed in backward
        bridge.set_extra_args(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":  # the MLPs' (or MoE layers') activations, the largest per token
        bridge.set_extra_args(recompute_granularity="selective", recompute_modules=["moe" if moe else "mlp"])
    mbridge_compat.map_output_layer(bridge)
    mbridge_compat.skip_single_stage_broadcasts()
    if hf.model_type in LOCAL_LAYERS_ONLY:  # their bridge builds local layers of its own spec
        mbridge_compat.map_local_layer_norms(bridge)
    elif not use_te:
        mbridge_compat.use_local_layer_spec(bridge)
        mbridge_compat.map_local_layer_norms(bridge)
    return bridge


def sigmoid_router_settings(hf: PreTrainedConfig) -> dict:
    """DeepSeek-V3's router (GLM-4.5's too) as HF computes it, where mbridge's bridges leave it out."""
    groups = getattr(hf, "n_group", 1) or 1
    return dict(
        # HF picks the top_k experts within the topk_group best of n_group groups; the bridges set no
        # groups (models.sigmoid_router_problems checks megatron scores groups as HF does)
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=(getattr(hf, "topk_group", 1) or 1) if groups > 1 else None,
        # The correction bias only picks experts; megatron would move it after every step by the
        # tokens each expert got (DeepSeek's load balancing). HF's training keeps it, and so does RL
        # here: it is exported with the weights, as it was loaded.
        moe_router_bias_update_rate=0.0,
        # HF and vLLM run the main model only (a checkpoint's MTP layer is skipped): so does the trainer
        mtp_num_layers=None,
    )


def deepseek_v3_settings(bridge, hf: PreTrainedConfig, use_te: bool) -> None:
    """What mbridge's DeepSeek-V3 bridge leaves out or sets otherwise than HF computes."""
    bridge.set_extra_args(**sigmoid_router_settings(hf))
    if bridge.dtype != torch.bfloat16:  # mbridge reads DeepSeek checkpoints in bf16 only
        mbridge_compat.read_plain_safetensors(bridge)
    if not use_te:
        mbridge_compat.map_mla_layer_norms(bridge)
        megatron_cpu.mla_without_te(hf.kv_lora_rank, hf.qk_rope_head_dim, hf.q_lora_rank)


def glm4_moe_settings(bridge, hf: PreTrainedConfig) -> None:
    """What mbridge's GLM-4.5 bridge sets otherwise than HF computes: it always builds a QKV bias,
    sizes the shared expert as one expert whatever n_shared_experts says, and balances load by an
    auxiliary loss RL does not use (its coefficient 0: off either way)."""
    bridge.set_extra_args(
        **sigmoid_router_settings(hf), add_qkv_bias=bool(getattr(hf, "attention_bias", False)),
        moe_shared_expert_intermediate_size=hf.moe_intermediate_size * hf.n_shared_experts,  # >= 1: validated
        moe_router_load_balancing_type="none")


def build_gpt_model(bridge, device: torch.device) -> list[torch.nn.Module]:
    """The GPTModel chunks of this pipeline stage, on `device`, without weights loaded."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    provider = mbridge_compat.model_provider(bridge)  # Bridge.get_model would call .cuda() on every module
    model = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    inv_freq = hf_rope_inv_freq(bridge.hf_config)
    if inv_freq is not None:
        mbridge_compat.set_rope_frequencies(model, inv_freq)
    return [model.to(device)]

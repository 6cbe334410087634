"""Every call asyncrl makes into a private mbridge API, in one place, the one into megatron's
rotary embedding that the HF conversion needs on every device, and the two that routing replay
makes into megatron's global router list and torch's autograd state.

Checked against mbridge 0.15.1 with megatron-core 0.16.1 (`CHECKED_VERSIONS`).
tests/test_compat.py checks that every name in `PRIVATE_NAMES` and `SOURCE_FACTS` is
still there and that the installed versions are the ones checked: after an upgrade,
read each function here against the new source, then update `CHECKED_VERSIONS`.
megatron-core's own private APIs for CPU training are patched in megatron_cpu.py.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

import torch

CHECKED_VERSIONS = {"mbridge": "0.15.1", "megatron-core": "0.16.1"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed mbridge.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("mbridge.core.llm_bridge", "LLMBridge._get_transformer_layer_spec"),
    ("mbridge.core.llm_bridge", "LLMBridge._model_provider"),
    ("mbridge.core.bridge", "Bridge._OTHER_MAPPING"),
    ("mbridge.models.qwen2", "Qwen2Bridge._MLP_MAPPING"),
    ("mbridge.models.llama", "LLaMABridge._MLP_MAPPING"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"),
    ("mbridge.core.bridge", "Bridge._DIRECT_MAPPING"),
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_to_hf"),
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_local_to_global"),
    ("mbridge.models.qwen2", "Qwen2Bridge._DIRECT_MAPPING"),
    ("mbridge.models.llama", "LLaMABridge._DIRECT_MAPPING"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_freqs_non_repeated"),
    ("mbridge.core.bridge", "broadcast_from_megatron_pp"),
    ("mbridge.core.bridge", "broadcast_str_from_megatron_pp"),
    ("megatron.core.transformer.moe.router_replay", "RouterReplay.clear_global_router_replay_instances"),
    ("torch._C", "_current_graph_task_id"),
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge._ATTENTION_MAPPING"),
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge.TransformerConfigClass"),
    ("mbridge.core.llm_bridge", "LLMBridge._build_base_config"),
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge._get_safetensor_io"),
    ("mbridge.core.bridge", "Bridge._get_safetensor_io"),
    ("mbridge.models.qwen2", "Qwen2Bridge._ATTENTION_MAPPING"),
    ("mbridge.core.llm_bridge", "LLMBridge._build_config"),
    ("mbridge.core.llm_bridge", "LLMBridge._get_gptmodel_args"),
    ("mbridge.core.bridge", "Bridge._weight_to_mcore_format"),
    ("mbridge.core.bridge", "Bridge._weight_to_hf_format"),
    ("mbridge.core.bridge", "Bridge._weight_split_across_tp"),
    ("mbridge.core.bridge", "Bridge._weight_merge_across_tp"),
    ("mbridge.models.glm4moe", "GLM4MoEBridge._weight_name_mapping_mcore_to_hf"),
    ("mbridge.models.glm4moe", "GLM4MoEBridge._get_gptmodel_args"),
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_other"),
    ("mbridge.models.qwen2moe", "Qwen2MoEBridge._ATTENTION_MAPPING"),
]

# What no attribute lookup shows: (module, attribute path, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    ("mbridge.core.llm_bridge", "LLMBridge._model_provider", "self._get_transformer_layer_spec(vp_stage)"),
    ("mbridge.core.bridge", "Bridge", "self._OTHER_MAPPING.items()"),
    ("mbridge.core.bridge", "Bridge", "self._MLP_MAPPING.items()"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec", "use_transformer_engine"),
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_to_hf",
     "return [self._DIRECT_MAPPING[mcore_weights_name]]"),
    # Why map_output_layer is needed: the tied mapping is written into the class's dict.
    ("mbridge.models.qwen2", "Qwen2Bridge._adjust_mapping_for_shared_weights",
     'self._DIRECT_MAPPING["output_layer.weight"] = "model.embed_tokens.weight"'),
    # Why set_rope_frequencies is needed: megatron fixes llama3's other constants, mbridge's llama
    # bridge maps a rope "factor" to linear interpolation (when it sees one at all).
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding._apply_scaling",
     "original_max_position_embeddings=8192"),
    ("mbridge.models.llama", "LLaMABridge._get_gptmodel_args", 'rope_scaling_args["seq_len_interpolation_factor"]'),
    # What it relies on: the frequencies are read from these two attributes at every (uncached) forward.
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_freqs_non_repeated",
     "seq *= 1 / self.seq_len_interpolation_factor"),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding.get_freqs_non_repeated",
     "freqs = torch.outer(seq, self.inv_freq)"),
    ("megatron.core.models.gpt.gpt_model", "GPTModel.__init__", "self.rotary_pos_emb = RotaryEmbedding("),
    # What map_sequential_experts translates to: grouped-GEMM expert names, the expert id after ".weight".
    ("mbridge.models.qwen2moe", "Qwen2MoEBridge._weight_name_mapping_mlp", 'expert_id = name.split("weight")[-1]'),
    ("mbridge.core.bridge", "Bridge.export_weights", 'name_prefix, local_expert_id = name.split(".weight")'),
    # What WeightsView stands in for: all the export reads of a model chunk.
    ("mbridge.core.bridge", "Bridge.export_weights", "for name, param in model.named_parameters():"),
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_mcore_local_to_global", "model.state_dict().keys()"),
    ("mbridge.core.bridge", "Bridge.load_weights",
     "local_to_global_map = self._weight_name_mapping_mcore_local_to_global(model)"),
    # Why skip_single_stage_broadcasts: the export broadcasts every tensor and its name over the
    # pipeline group, whatever its size.
    ("mbridge.core.bridge", "Bridge.export_weights", "broad_pp_param = broadcast_from_megatron_pp(param)"),
    ("mbridge.core.util", "broadcast_from_megatron_pp", "torch.distributed.all_gather_object("),
    # What the trainer's THD forward relies on (trainer_rank._forward): rope reads the "padded"
    # boundaries where given (the host's, so no synchronisation per layer), the kernels the others;
    # bf16 logits stay bf16 when asked.
    ("megatron.core.transformer.attention", "Attention.forward",
     "cu_seqlens_q = packed_seq_params.cu_seqlens_q_padded"),
    ("megatron.core.transformer.module", "Float16Module.forward", "fp32_output=True"),
    # Why deepseek_v3_bridge: the bridge's config argument that megatron-core 0.16.1 renamed, and
    # where the config class is called.
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge._build_config",
     'max_position_embeddings=mla_rope_config["original_max_position_embeddings"]'),
    ("mbridge.core.llm_bridge", "LLMBridge._build_base_config", "return self.TransformerConfigClass(**base_config)"),
    # Why map_mla_layer_norms: the bridge knows the MLA's q/kv norms only fused into TE's linears.
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge",
     '"self_attention.linear_q_up_proj.layer_norm_weight": ['),
    # Why read_plain_safetensors: the bridge's reader dequantises FP8 to bf16 and refuses other dtypes.
    ("mbridge.models.deepseek_v3", "DeepseekV3Bridge._get_safetensor_io",
     'raise NotImplemented("only support bfloat16'),
    # What qwen3_5_text_bridge relies on: a parameter maps by the first attention key its name
    # contains; megatron's gated attention splits each query group as [queries, gates, key, value]
    # (qwen3_5.gated_qkv_to_mcore) and passes the packed rows to whatever holds the self-attention
    # slot (gdn.PackedGatedDeltaNet).
    ("mbridge.core.bridge", "Bridge._weight_name_mapping_attention", "if keyword in name:"),
    ("megatron.core.transformer.attention", "SelfAttention.get_query_key_value_tensors",
     "(query, gate, key, value) = torch.split(mixed_qkv, split_arg_list, dim=3)"),
    ("megatron.core.transformer.transformer_layer", "TransformerLayer._forward_attention",
     "packed_seq_params=packed_seq_params,"),
    # Why glm4_moe_bridge and hf_bridge.glm4_moe_settings: GLM4MoEBridge's own name map (no fallback for
    # other names, a fixed lm_head), its top-level partial rope, its QKV bias and one-expert shared size.
    ("mbridge.models.glm4moe", "GLM4MoEBridge._weight_name_mapping_mcore_to_hf",
     '"output_layer.weight": "lm_head.weight"'),
    ("mbridge.models.glm4moe", "GLM4MoEBridge._get_gptmodel_args",
     "rotary_percent=self.hf_config.partial_rotary_factor"),
    ("mbridge.models.glm4moe", "GLM4MoEBridge._build_config", "add_qkv_bias=True"),
    ("mbridge.models.glm4moe", "GLM4MoEBridge._build_config",
     "moe_shared_expert_intermediate_size=self.hf_config.moe_intermediate_size"),
    # What gemma3_text_bridge relies on: the model-creation callbacks get the stage's flags; the
    # local layer spec's attention and MLP are megatron's classes, replaced by gemma3's subclasses.
    ("mbridge.core.llm_bridge", "LLMBridge._model_provider", "pre_process=pre_process,"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec", "module=SelfAttention,"),
]


def use_local_layer_spec(bridge: Any) -> None:
    """Build megatron's local layers (plain torch) instead of Transformer Engine's, with the
    packed attention (attention.py) in place of megatron's dense-mask `DotProductAttention`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from asyncrl.trainer.attention import PackedAttention

    def local_layer_spec(vp_stage=None):
        spec = get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, vp_stage=vp_stage)
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = PackedAttention
        return spec

    # mbridge's layer spec hard-codes Transformer Engine, which needs CUDA.
    bridge._get_transformer_layer_spec = local_layer_spec


def map_local_layer_norms(bridge: Any) -> None:
    """Add the layer norms of megatron's local layers to mbridge's name map."""
    # Local layers keep the norms as modules of their own (TE fuses them into the linears),
    # and mbridge's name map only knows TE's names.
    # A bridge class that names its pre-MLP norm otherwise (Gemma 3's) keeps its own name.
    bridge._OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    bridge._MLP_MAPPING = {
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
        **type(bridge)._MLP_MAPPING,
    }


# megatron's SequentialMLP (the experts without grouped GEMM): one linear pair per local expert.
_SEQUENTIAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def map_sequential_experts(bridge: Any) -> None:
    """Let mbridge's MoE name map read megatron's sequential experts (`...experts.local_experts.E.
    linear_fc1.weight`) as the grouped-GEMM names it knows (`...experts.linear_fc1.weightE`)."""
    # mbridge 0.15.1 maps only TE's grouped experts; without TE (CPU) megatron builds SequentialMLP.
    # Its load and export both go through this local -> global map (expert ids made global only
    # when `consider_ep`; the export gathers the EP ranks' local ids itself), and every other
    # step keys on the parameter itself or on names the translation keeps ("linear_fc1.weight").
    original = bridge._weight_name_mapping_mcore_local_to_global

    def local_to_global(model: torch.nn.Module, consider_ep: bool = True) -> dict[str, str]:
        names = original(model, consider_ep)
        per_rank = bridge.config.num_moe_experts // bridge.mpu.ep_size
        offset = per_rank * bridge.mpu.ep_rank if consider_ep else 0
        return {local: _SEQUENTIAL_EXPERT.sub(lambda m: f".mlp.experts.{m[2]}.weight{int(m[1]) + offset}", name)
                for local, name in names.items()}

    bridge._weight_name_mapping_mcore_local_to_global = local_to_global


@functools.cache
def deepseek_v3_bridge() -> type:
    """mbridge's DeepSeek-V3 bridge, with its megatron config built as megatron-core 0.16.1 names it."""
    from mbridge.models.deepseek_v3 import DeepseekV3Bridge
    from megatron.core.transformer import MLATransformerConfig

    def mla_config(**kwargs: Any) -> MLATransformerConfig:
        # mbridge 0.15.1 passes YaRN's original context as `max_position_embeddings`, which
        # MLATransformerConfig (megatron-core 0.16.1) names `original_max_position_embeddings`:
        # as is, the bridge cannot be built (TypeError).
        if "max_position_embeddings" in kwargs:
            kwargs["original_max_position_embeddings"] = kwargs.pop("max_position_embeddings")
        return MLATransformerConfig(**kwargs)

    class DeepseekV3BridgeForMcore016(DeepseekV3Bridge):
        TransformerConfigClass = staticmethod(mla_config)

    return DeepseekV3BridgeForMcore016


@functools.cache
def glm4_moe_bridge() -> type:
    """mbridge's GLM-4.5 bridge, with the name map's fallbacks its own map lacks and partial rope where
    transformers 5 keeps it."""

    from mbridge.models.glm4moe import GLM4MoEBridge

    class GLM4MoEBridgeForLocalLayers(GLM4MoEBridge):
        def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
            # GLM4MoEBridge's map knows attention, MLP, MTP and three fixed names (the output layer
            # always lm_head): megatron's local layers' input norms had no name, and map_output_layer
            # no effect. The base Bridge's map falls back to _DIRECT_MAPPING and _OTHER_MAPPING.
            if mcore_weights_name in self._DIRECT_MAPPING:
                return [self._DIRECT_MAPPING[mcore_weights_name]]
            if not any(part in mcore_weights_name for part in ("mtp", "self_attention", "mlp")):
                return self._weight_name_mapping_other(mcore_weights_name)
            return super()._weight_name_mapping_mcore_to_hf(mcore_weights_name)

        def _get_gptmodel_args(self) -> dict:
            # its bridge reads a top-level partial_rotary_factor; HF and vLLM read rope_parameters'
            rope = getattr(self.hf_config, "rope_parameters", None) or {}
            factor = rope.get("partial_rotary_factor", getattr(self.hf_config, "partial_rotary_factor", 0.5))
            return {**super()._get_gptmodel_args(), "rotary_percent": factor}

    return GLM4MoEBridgeForLocalLayers


@functools.cache
def qwen3_5_text_bridge(moe: bool = False) -> type:
    """A bridge for Qwen3.5's text model (asyncrl/trainer/qwen3_5.py), which mbridge lacks: its
    Qwen2 bridge (with `moe`, its Qwen2-MoE bridge: routed experts and a gated shared one) with the
    gated DeltaNet's names, the gated attention's layout, partial rope and the hybrid layer spec;
    the DeltaNet's fused parameters split over tensor-parallel ranks by head."""
    from mbridge.models.qwen2 import Qwen2Bridge
    from mbridge.models.qwen2moe import Qwen2MoEBridge

    from asyncrl.trainer import qwen3_5

    base = Qwen2MoEBridge if moe else Qwen2Bridge
    linear = "model.layers.{layer_number}.linear_attn."

    class Qwen3_5TextBridge(base):
        # mbridge 0.15.1 maps a parameter by the first of these keys its name contains
        _ATTENTION_MAPPING = {
            **base._ATTENTION_MAPPING,
            "self_attention.in_proj.weight": [linear + f"in_proj_{part}.weight" for part in ("qkv", "z", "b", "a")],
            "self_attention.conv1d.weight": [linear + "conv1d.weight"],
            "self_attention.A_log": [linear + "A_log"],
            "self_attention.dt_bias": [linear + "dt_bias"],
            "self_attention.out_norm.weight": [linear + "norm.weight"],
            "self_attention.out_proj.weight": [linear + "out_proj.weight"],
        }

        def _build_config(self):
            # (Qwen2-MoE's bridge would add a QKV bias and Transformer Engine's fusions)
            return self._build_base_config(**qwen3_5.config_args(self.hf_config, moe))

        def _get_gptmodel_args(self) -> dict:
            return {**super()._get_gptmodel_args(), **qwen3_5.gptmodel_args(self.hf_config)}

        def _get_transformer_layer_spec(self, vp_stage: int | None = None):
            return qwen3_5.layer_spec(self.config, self.hf_config.layer_types, vp_stage)

        def _weight_to_mcore_format(self, mcore_weights_name: str, hf_weights: list[torch.Tensor]) -> torch.Tensor:
            fused = qwen3_5.to_mcore(mcore_weights_name, [w.to(self.dtype) for w in hf_weights], self.hf_config)
            return fused if fused is not None else super()._weight_to_mcore_format(mcore_weights_name, hf_weights)

        def _weight_to_hf_format(self, mcore_weights_name: str, mcore_weights: torch.Tensor):
            parts = qwen3_5.to_hf(mcore_weights_name, mcore_weights, self.hf_config)
            if parts is None:
                return super()._weight_to_hf_format(mcore_weights_name, mcore_weights)
            return self._weight_name_mapping_mcore_to_hf(mcore_weights_name), parts

        def _weight_split_across_tp(self, mcore_weights_name: str, mcore_weights: torch.Tensor, param: torch.Tensor,
                                    tp_split_size: int) -> list[torch.Tensor]:
            split = qwen3_5.split_for_tp(mcore_weights_name, mcore_weights, self.hf_config, tp_split_size)
            return split if split is not None else super()._weight_split_across_tp(
                mcore_weights_name, mcore_weights, param, tp_split_size)

        def _weight_merge_across_tp(self, mcore_weights_name: str, mcore_weights: list[torch.Tensor],
                                    param: torch.Tensor) -> torch.Tensor:
            merged = qwen3_5.merge_from_tp(mcore_weights_name, mcore_weights, self.hf_config)
            return merged if merged is not None else super()._weight_merge_across_tp(
                mcore_weights_name, mcore_weights, param)

    return Qwen3_5TextBridge


@functools.cache
def gemma3_text_bridge() -> type:
    """A bridge for Gemma 3's text model (asyncrl/trainer/gemma3.py), which mbridge lacks (its
    gemma3 bridge is the vision-language model's, Transformer Engine only): its Qwen2 bridge's
    names with Gemma's four norms a layer, Gemma's config, layer spec and scaled embeddings."""
    from mbridge.models.qwen2 import Qwen2Bridge

    from asyncrl.trainer import gemma3

    layer = "model.layers.{layer_number}."

    class Gemma3TextBridge(Qwen2Bridge):
        # mbridge 0.15.1 maps a parameter by the first of these keys its name contains
        _ATTENTION_MAPPING = {
            **Qwen2Bridge._ATTENTION_MAPPING,
            "self_attention.post_layernorm.weight": [layer + "post_attention_layernorm.weight"],
        }
        _MLP_MAPPING = {
            **Qwen2Bridge._MLP_MAPPING,
            "pre_mlp_layernorm.weight": [layer + "pre_feedforward_layernorm.weight"],
            "mlp.post_layernorm.weight": [layer + "post_feedforward_layernorm.weight"],
        }

        def _build_config(self):
            # (Qwen2's bridge would add a QKV bias)
            return self._build_base_config(**gemma3.config_args(self.hf_config))

        def _get_transformer_layer_spec(self, vp_stage: int | None = None):
            return gemma3.layer_spec(self.config, self.hf_config, vp_stage)

        def _model_provider(self, post_model_creation_callbacks: list):
            return super()._model_provider([*post_model_creation_callbacks, gemma3.scale_embeddings])

    return Gemma3TextBridge


def map_mla_layer_norms(bridge: Any) -> None:
    """Add multi-head latent attention's q/kv norms, as megatron's local layers name them, to
    mbridge's DeepSeek-V3 name map."""
    # TE fuses them into linear_q_up_proj / linear_kv_up_proj (`.layer_norm_weight`), the only names
    # the bridge maps; local layers keep them as modules of their own (mbridge 0.15.1).
    layer = "model.layers.{layer_number}.self_attn."
    bridge._ATTENTION_MAPPING = {
        **type(bridge)._ATTENTION_MAPPING,
        "self_attention.q_layernorm.weight": [layer + "q_a_layernorm.weight"],
        "self_attention.kv_layernorm.weight": [layer + "kv_a_layernorm.weight"],
    }


def read_plain_safetensors(bridge: Any) -> None:
    """Read the checkpoint's tensors as stored (mbridge's plain reader), for a bridge whose own
    reader does more."""
    # DeepseekV3Bridge._get_safetensor_io dequantises FP8 checkpoints to bf16 and raises for any
    # other dtype (mbridge 0.15.1); an unquantized checkpoint in fp32 reads as any other family's.
    from mbridge.core.bridge import Bridge

    bridge._get_safetensor_io = types.MethodType(Bridge._get_safetensor_io, bridge)


def map_output_layer(bridge: Any) -> None:
    """Give this bridge its own name map for the output layer: the embedding when tied, else lm_head."""
    # Qwen2Bridge (and Qwen3Bridge) write the tied mapping into the class-level _DIRECT_MAPPING,
    # so after one tied model every later untied one in the process would load its output layer
    # from the embedding (mbridge 0.15.1).
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    bridge._DIRECT_MAPPING = {
        **type(bridge)._DIRECT_MAPPING,
        "output_layer.weight": "model.embed_tokens.weight" if tied else "lm_head.weight",
    }


def set_rope_frequencies(model: Any, inv_freq: torch.Tensor) -> None:
    """Make a freshly built GPTModel's rope use `inv_freq` (HF's) at the positions as given.

    Call before the first forward: RotaryEmbedding.forward caches its output (lru_cache).
    """
    rope = model.rotary_pos_emb
    # RotaryEmbedding keeps its frequencies in plain attributes set in __init__, with no
    # argument for llama3's low/high_freq_factor or original context (mcore 0.16.1).
    rope.inv_freq = inv_freq.to(device=rope.inv_freq.device, dtype=torch.float32)
    rope.seq_len_interpolation_factor = None  # `inv_freq` already holds any scaling


def skip_single_stage_broadcasts() -> None:
    """With one pipeline stage, mbridge's export takes each tensor and its name as they are,
    instead of sending them to itself. Idempotent; with several stages its own functions run."""
    # Bridge.export_weights runs two all_gather_objects and two broadcasts per tensor on the
    # pipeline group even at size 1: on NCCL a host synchronisation each, which held weight
    # staging to 3-13 GB/s on an H200 (mbridge 0.15.1).
    import mbridge.core.bridge as bridge_module
    from megatron.core import parallel_state as mpu

    if getattr(bridge_module.broadcast_from_megatron_pp, "_asyncrl_single_stage", False):
        return
    originals = bridge_module.broadcast_from_megatron_pp, bridge_module.broadcast_str_from_megatron_pp

    def passthrough(original):
        def broadcast(obj):
            return obj if mpu.get_pipeline_model_parallel_world_size() == 1 else original(obj)

        broadcast._asyncrl_single_stage = True
        return broadcast

    bridge_module.broadcast_from_megatron_pp, bridge_module.broadcast_str_from_megatron_pp = map(passthrough, originals)


def hf_names(bridge: Any, mcore_name: str) -> list[str]:
    """The HF tensors a megatron parameter (global name, e.g. "output_layer.weight") is made of."""
    # mbridge has no public name lookup; this is the one its load and export use (mbridge 0.15.1).
    return bridge._weight_name_mapping_mcore_to_hf(mcore_name)


def model_provider(bridge: Any):
    """mbridge's GPTModel factory: `provider(pre_process=..., post_process=...)`."""
    # Bridge.get_model would call .cuda() on every module.
    return bridge._model_provider([])


class WeightsView:
    """A model chunk as mbridge's export (export_weights, save_weights) sees it, with some
    parameters replaced (LoRA's merged weights) and some hidden (the adapters): that export reads
    a chunk's named_parameters(), its state_dict()'s keys and decoder.layers, nothing else
    (mbridge 0.15.1, SOURCE_FACTS); every other attribute is the chunk's."""

    def __init__(self, model: Any, replace: dict[str, torch.Tensor], hide: set[str]):
        self._model, self._replace, self._hide = model, replace, hide

    def named_parameters(self):
        for name, p in self._model.named_parameters():
            if name not in self._hide:
                yield name, self._replace.get(name, p)

    def state_dict(self, *args, **kwargs) -> dict:
        return {k: v for k, v in self._model.state_dict(*args, **kwargs).items() if k not in self._hide}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def clear_router_replays() -> None:
    """Empty megatron's process-wide list of replaying routers: each model built adds its routers
    to it and nothing removes them (megatron-core 0.16.1); asyncrl addresses its own routers."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()


def in_backward() -> bool:
    """Whether autograd is running a backward pass now (a recomputed forward inside it): torch
    has no public test for it (torch 2.13: `torch._C._current_graph_task_id`, -1 outside)."""
    return torch._C._current_graph_task_id() != -1

"""Every call asyncrl makes into a private mbridge API, in one place.

Checked against mbridge 0.15.1 with megatron-core 0.16.1 (`CHECKED_VERSIONS`).
tests/test_compat.py checks that every name in `PRIVATE_NAMES` and `SOURCE_FACTS` is
still there and that the installed versions are the ones checked: after an upgrade,
read each function here against the new source, then update `CHECKED_VERSIONS`.
megatron-core's own private APIs are patched in megatron_cpu.py.
"""

from __future__ import annotations

from typing import Any

CHECKED_VERSIONS = {"mbridge": "0.15.1", "megatron-core": "0.16.1"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed mbridge.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("mbridge.core.llm_bridge", "LLMBridge._get_transformer_layer_spec"),
    ("mbridge.core.llm_bridge", "LLMBridge._model_provider"),
    ("mbridge.core.bridge", "Bridge._OTHER_MAPPING"),
    ("mbridge.models.qwen2", "Qwen2Bridge._MLP_MAPPING"),
    ("mbridge.models.llama", "LLaMABridge._MLP_MAPPING"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec"),
]

# What no attribute lookup shows: (module, attribute path, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    ("mbridge.core.llm_bridge", "LLMBridge._model_provider", "self._get_transformer_layer_spec(vp_stage)"),
    ("mbridge.core.bridge", "Bridge", "self._OTHER_MAPPING.items()"),
    ("mbridge.core.bridge", "Bridge", "self._MLP_MAPPING.items()"),
    ("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_decoder_block_spec", "use_transformer_engine"),
]


def use_local_layer_spec(bridge: Any) -> None:
    """Build megatron's local layers (plain torch) instead of Transformer Engine's."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def local_layer_spec(vp_stage=None):
        return get_gpt_decoder_block_spec(bridge.config, use_transformer_engine=False, vp_stage=vp_stage)

    # mbridge's layer spec hard-codes Transformer Engine, which needs CUDA.
    bridge._get_transformer_layer_spec = local_layer_spec


def map_local_layer_norms(bridge: Any) -> None:
    """Add the layer norms of megatron's local layers to mbridge's name map."""
    # Local layers keep the norms as modules of their own (TE fuses them into the linears),
    # and mbridge's name map only knows TE's names.
    bridge._OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}
    bridge._MLP_MAPPING = {
        **type(bridge)._MLP_MAPPING,
        "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
    }


def model_provider(bridge: Any):
    """mbridge's GPTModel factory: `provider(pre_process=..., post_process=...)`."""
    # Bridge.get_model would call .cuda() on every module.
    return bridge._model_provider([])

"""Gemma 3's text model (model_type gemma3_text) in megatron-core, converted to and from HF's
checkpoint exactly.

mbridge 0.15.1's Gemma 3 bridge is the vision-language model's, built of Transformer Engine layers
only. So, registered for mbridge's AutoBridge (mbridge_compat.gemma3_text_bridge):
- the layer spec: megatron's local layers with Gemma's four norms a layer, each HF's zero-centred
  RMSNorm (x * (1 + w)): the input norm, a norm of the attention's output before the residual
  (`Gemma3SelfAttention.post_layernorm`), the pre-MLP norm and a norm of the MLP's output
  (`PostNormMLP.post_layernorm`); the output norms sit after the whole attention / MLP, so LoRA's
  adapters (hooked on linear_proj / linear_fc2) add before them, as PEFT's do on HF's model;
- per layer, from `layer_types`: a "sliding_attention" layer attends to its `sliding_window`
  latest keys (the packed attention's window, attention.py) with rope of its own base
  (`rope_parameters["sliding_attention"]`), a "full_attention" layer to the whole prefix with the
  model's rope (`rope_parameters["full_attention"]`, HF's frequencies: hf_bridge);
- QK-norm, scores scaled by query_pre_attn_scalar ** -0.5, GELU with the tanh approximation in
  the gated MLP, and the embeddings scaled by sqrt(hidden_size) (in the embedding's dtype, as HF's);
  the output layer is the embedding, unscaled.
The names are Qwen2's (q/k/v/o, q_norm/k_norm, gate/up/down) plus the norms above.
One pipeline stage (more are refused at validation: config/models.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from asyncrl.config.models import rope_parameters
from asyncrl.trainer.norms import ZeroCenteredRMSNorm

MODEL_TYPE = "gemma3_text"


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's `gelu_pytorch_tanh` (a function of this module, so a config holding it pickles)."""
    return F.gelu(x, approximate="tanh")


class Gemma3SelfAttention(SelfAttention):
    """megatron's self-attention with the norm of its output Gemma applies before the residual
    and, for a sliding layer, rope of its own base (`rope_base`; None: the model's rope)."""

    def __init__(self, config: Any, *args: Any, rope_base: float | None = None, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(hidden_size=config.hidden_size, eps=config.layernorm_epsilon)
        # built as GPTModel builds the model's rope (frequencies in a plain attribute, on the device
        # use_cpu_initialization says); megatron's default frequencies are HF's (tests/test_model_families.py)
        self.local_rope = None if rope_base is None else RotaryEmbedding(
            config.kv_channels, rotary_percent=1.0, rotary_base=rope_base,
            use_cpu_initialization=config.use_cpu_initialization)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        emb = kwargs.get("rotary_pos_emb")
        if self.local_rope is not None and emb is not None:
            # the model's table covers the row's longest sequence: the same length, this layer's base
            length = (emb[0] if isinstance(emb, tuple) else emb).shape[0]
            kwargs["rotary_pos_emb"] = self.local_rope(length, packed_seq=kwargs.get("packed_seq_params") is not None)
        output, bias = super().forward(hidden_states, attention_mask, **kwargs)
        if bias is not None:  # config_args builds no linear biases; a bias would be added after the norm
            raise ValueError("Gemma 3's attention output norm with a linear bias is not supported")
        return self.post_layernorm(output), None


class PostNormMLP(MLP):
    """megatron's MLP with the norm of its output Gemma applies before the residual."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(hidden_size=config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, bias = super().forward(hidden_states, *args, **kwargs)
        if bias is not None:
            raise ValueError("Gemma 3's MLP output norm with a linear bias is not supported")
        return self.post_layernorm(output), None


def layer_spec(config: Any, hf: Any, vp_stage: int | None = None) -> Any:
    """megatron's local decoder block spec with Gemma 3's layers (the module docstring)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from asyncrl.trainer.attention import PackedAttention

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    if len(spec.layer_specs) != len(hf.layer_types):
        raise ValueError(f"{MODEL_TYPE}: {len(spec.layer_specs)} layers on this stage of {len(hf.layer_types)}: "
                         "pipeline parallelism is not built for it")
    local_base = rope_parameters(hf, "sliding_attention")["rope_theta"]
    layers = []
    for layer, kind in zip(spec.layer_specs, hf.layer_types):
        layer = copy.deepcopy(layer)  # the block's layers may share one spec: each layer gets its own
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        sliding = kind == "sliding_attention"
        sub.self_attention.module = Gemma3SelfAttention
        sub.self_attention.params = {**sub.self_attention.params, "rope_base": local_base if sliding else None}
        attention = sub.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
        attention.core_attention = ModuleSpec(module=PackedAttention,
                                              params={"window": hf.sliding_window if sliding else None})
        sub.mlp.module = PostNormMLP
        layers.append(layer)
    spec.layer_specs, spec.layer_norm = layers, ZeroCenteredRMSNorm
    return spec


def config_args(hf: Any) -> dict[str, Any]:
    """megatron's TransformerConfig settings for this HF config, beside mbridge's own."""
    return dict(qk_layernorm=True, kv_channels=hf.head_dim, softmax_scale=hf.query_pre_attn_scalar ** -0.5,
                activation_func=gelu_tanh, gated_linear_unit=True, bias_activation_fusion=False,
                add_bias_linear=False, add_qkv_bias=False)


def scale_embeddings(model: Any, pre_process: bool, **kwargs: Any) -> None:
    """An mbridge model-creation callback: the first stage's embeddings times sqrt(hidden_size),
    the factor cast to their dtype as HF's Gemma3TextScaledWordEmbedding does (fp32, then down)."""
    if not pre_process:
        return
    factor = torch.tensor(model.config.hidden_size ** 0.5, dtype=torch.float32)

    def scale(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return output * factor.to(device=output.device, dtype=output.dtype)

    model.embedding.register_forward_hook(scale)

"""Hugging Face <-> Megatron weights for Qwen2 and Llama, through mbridge.

mbridge (what verl uses) maps HF tensor names and layouts to megatron-core's GPTModel
(fused QKV, fused gate/up, tensor-parallel splits) and back. We use it as is, except
where it falls short here; each gap is closed in `load_bridge` (the ones that reach into
mbridge's private API through mbridge_compat.py):
- its layer spec hard-codes Transformer Engine, which needs CUDA: without TE we build
  megatron's local layers, whose layer norms are separate modules, so their names are
  added to its name map;
- with transformers 5 `rope_theta` moved into `config.rope_parameters`;
- `Bridge.get_model` moves modules with `.cuda()`: `build_gpt_model` builds from its
  model provider instead.
"""

from __future__ import annotations

import torch

from asyncrl.trainer import mbridge_compat

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (it needs CUDA; never on a CPU machine)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises OSError/RuntimeError, not only ImportError, without CUDA
        return False
    return True


def load_bridge(model_path: str, dtype: torch.dtype, use_te: bool, cpu: bool):
    """An mbridge bridge for the HF checkpoint at `model_path`, set up for our layers.

    Must be called after megatron's parallel state is initialised (the bridge reads it).
    """
    from mbridge import AutoBridge

    bridge = AutoBridge.from_pretrained(model_path, dtype=dtype)
    hf = bridge.hf_config
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {hf.model_type!r} at {model_path}: supported are {SUPPORTED_MODEL_TYPES}")
    if getattr(hf, "rope_theta", None) is None:  # transformers 5 keeps it in rope_parameters
        hf.rope_theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    tp = bridge.mpu.tp_size
    if hf.vocab_size % tp:
        # Padding the vocabulary would add logits that vLLM does not have (and shift logprobs).
        raise ValueError(f"vocab size {hf.vocab_size} is not divisible by trainer.tensor_parallel_size={tp}")
    bridge.set_extra_args(
        # Packed rows have varying lengths; sequence parallel would need them divisible by TP.
        sequence_parallel=False,
        use_cpu_initialization=cpu,
        # The fused softmax kernels are CUDA-only; megatron falls back to torch when off.
        masked_softmax_fusion=not cpu,
        bias_dropout_fusion=not cpu,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    if not use_te:
        mbridge_compat.use_local_layer_spec(bridge)
        mbridge_compat.map_local_layer_norms(bridge)
    return bridge


def build_gpt_model(bridge, device: torch.device) -> list[torch.nn.Module]:
    """The GPTModel chunks of this pipeline stage, on `device`, without weights loaded."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    provider = mbridge_compat.model_provider(bridge)  # Bridge.get_model would call .cuda() on every module
    model = provider(pre_process=mpu.is_pipeline_first_stage(), post_process=mpu.is_pipeline_last_stage())
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    return [model.to(device)]


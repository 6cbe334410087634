"""Which Hugging Face models the megatron trainer loads exactly: checked when the config is
validated (`trainable_model_problems`, before Ray starts) and again by the trainer
(asyncrl/trainer/hf_bridge.py `read_model_config`). docs/models.md has the families and the
tests behind each."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config.schema import MOE_MODEL_TYPES, Config

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

DENSE_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")  # mistral: Llama's layers (hf_bridge)
SUPPORTED_MODEL_TYPES = (*DENSE_MODEL_TYPES, *MOE_MODEL_TYPES)
# Rope types whose effect is only a fixed set of frequencies (no attention scaling, no
# dependence on the sequence length): HF's frequencies then make megatron's rope equal HF's.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def model_config_problems(hf: PreTrainedConfig, tp_size: int) -> list[str]:
    """What in this HF config asyncrl's trainer does not convert exactly (empty: nothing)."""
    problems = []
    rope = getattr(hf, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {rope['partial_rotary_factor']}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {hf.hidden_act!r} (only silu)")
    if getattr(hf, "use_sliding_window", False) or "sliding_attention" in (getattr(hf, "layer_types", None) or []):
        problems.append("sliding-window attention")
    elif hf.model_type in ("mistral", "mixtral") and getattr(hf, "sliding_window", None) is not None:
        # HF's Mistral and Mixtral apply `sliding_window` whenever it is set (no flag, no layer_types);
        # the trainer's packed attention attends to the whole prefix.
        problems.append(f"sliding-window attention (sliding_window={hf.sliding_window}; only null is supported)")
    if hf.model_type in ("qwen3", "llama") and getattr(hf, "attention_bias", False):
        # HF adds an o_proj bias too; mbridge maps only the QKV one and would drop it silently.
        problems.append("attention_bias=true")
    if getattr(hf, "mlp_bias", False):
        problems.append("mlp_bias=true")
    if hf.model_type == "qwen2_moe" and not getattr(hf, "qkv_bias", True):
        problems.append("qkv_bias=false (mbridge's qwen2_moe bridge always builds a QKV bias)")
    if hf.model_type in MOE_MODEL_TYPES:
        # norm_topk_prob either way: the trainer's router softmaxes before or after its top-k to match
        # (hf_bridge.renormalises_top_k).
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            problems.append("dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step)")
    if hf.vocab_size % tp_size:
        # Padding the vocabulary would add logits that vLLM does not have (and shift logprobs).
        problems.append(f"vocab_size {hf.vocab_size} is not divisible by trainer.tensor_parallel_size={tp_size}")
    return problems


def model_problem(model_path: str, tp_size: int = 1) -> str | None:
    """Why the megatron trainer cannot load the HF checkpoint at `model_path` exactly, in one
    line (an unsupported model type, a feature); None if it can."""
    from transformers import AutoConfig, PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(model_path)  # the type first: AutoConfig may not know it
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model type {model_type!r} is not supported by the megatron trainer; supported: "
                f"{', '.join(DENSE_MODEL_TYPES)} (dense), {', '.join(MOE_MODEL_TYPES)} (mixture of experts); "
                "see docs/models.md")
    problems = model_config_problems(AutoConfig.from_pretrained(model_path), tp_size)
    if problems:
        return f"{model_type} with {'; '.join(problems)} is not supported by the megatron trainer (see docs/models.md)"
    return None


def trainable_model_problems(c: Config) -> list[str]:
    """For commands that train: model.path, if a local checkpoint, is one the trainer loads (a Hub
    id is checked by the trainer once downloaded; the simulated trainer loads none)."""
    path = c.model.path
    if c.trainer.backend != "megatron" or not os.path.isfile(os.path.join(path, "config.json")):
        return []
    problem = model_problem(path, c.trainer.tensor_parallel_size)
    return [f"model.path={path!r}: {problem}"] if problem else []


def checkpoint_model_type(path: str) -> str | None:
    """The model_type in a checkpoint directory's config.json (None: not a readable local one)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None

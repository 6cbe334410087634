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
from asyncrl.config.text_model import TEXT_MODELS

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

GEMMA3_TEXT = "gemma3_text"  # Gemma 3's text model: local (sliding-window) and global attention (trainer/gemma3.py)
# mistral: Llama's layers, a window (hf_bridge)
DENSE_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", GEMMA3_TEXT)
QWEN3_5_TEXT = "qwen3_5_text"  # Qwen3.5's text model: gated DeltaNet + gated attention (trainer/qwen3_5.py)
QWEN3_5_MOE_TEXT = "qwen3_5_moe_text"  # the same layers with Qwen2-MoE's experts (a gated shared one)
HYBRID_MODEL_TYPES = (QWEN3_5_TEXT, QWEN3_5_MOE_TEXT)
# Model types whose layers are asyncrl's own (trainer/qwen3_5.py, trainer/gemma3.py): one pipeline stage
OWN_LAYER_MODEL_TYPES = (*HYBRID_MODEL_TYPES, GEMMA3_TEXT)
SUPPORTED_MODEL_TYPES = tuple(dict.fromkeys((*DENSE_MODEL_TYPES, *MOE_MODEL_TYPES, *HYBRID_MODEL_TYPES)))
# Why some model types users bring are refused, where it is known (docs/models.md); mbridge 0.15.1.
UNSUPPORTED_WHY = {
    # Qwen3.5 / Qwen3-Next: gated-DeltaNet layers (docs/plans/qwen3_5.md)
    "qwen3_next": "its gated-DeltaNet layers are built for Qwen3.5's text models (qwen3_5_text, qwen3_5_moe_text), "
                  "not Qwen3-Next's interleaved projections",
    **{vl: f"the vision-language checkpoint: the trainer takes its text model, a checkpoint of model_type {text} "
           f"({arch}), which `asyncrl text-model SRC DST` writes" for vl, (text, arch) in TEXT_MODELS.items()},
}
# Rope on a part of each head: megatron's rotary_percent (NeoX halves of the first dims, as HF's)
PARTIAL_ROPE_MODEL_TYPES = (*HYBRID_MODEL_TYPES, "glm4_moe")
# Rope types whose effect is only a fixed set of frequencies (no attention scaling, no
# dependence on the sequence length): HF's frequencies then make megatron's rope equal HF's.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf: PreTrainedConfig, layer_type: str = "full_attention") -> dict:
    """The rope settings of one kind of layer: transformers 5 keeps one dict for the model, or one per
    layer type (Gemma 3's: "full_attention", "sliding_attention")."""
    rope = getattr(hf, "rope_parameters", None) or {}
    per_layer_type = rope.get(layer_type)
    return per_layer_type if isinstance(per_layer_type, dict) else rope


def model_config_problems(hf: PreTrainedConfig, tp_size: int) -> list[str]:
    """What in this HF config asyncrl's trainer does not convert exactly (empty: nothing)."""
    problems = []
    rope = rope_parameters(hf)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope_type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and hf.model_type not in PARTIAL_ROPE_MODEL_TYPES:
        problems.append(f"partial_rotary_factor {rope['partial_rotary_factor']}")
    if hf.model_type in HYBRID_MODEL_TYPES and (hf.linear_num_key_heads % tp_size
                                                or hf.linear_num_value_heads % tp_size):
        problems.append(f"linear_num_key_heads {hf.linear_num_key_heads} / linear_num_value_heads "
                        f"{hf.linear_num_value_heads} not divisible by trainer.tensor_parallel_size={tp_size}")
    if hf.model_type == GEMMA3_TEXT:  # its own activation key; its sliding window is built (trainer/gemma3.py)
        problems += gemma3_text_problems(hf)
    else:
        if getattr(hf, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {hf.hidden_act!r} (only silu)")
        # (Mistral's and Mixtral's `sliding_window`, every layer's whenever set, is built: hf_bridge)
        if getattr(hf, "use_sliding_window", False) or "sliding_attention" in (getattr(hf, "layer_types", None) or []):
            problems.append("sliding-window attention")
    if hf.model_type in ("qwen3", "llama", "deepseek_v3") and getattr(hf, "attention_bias", False):
        # HF adds an o_proj bias too; mbridge maps only the QKV one and would drop it silently.
        problems.append("attention_bias=true")
    if getattr(hf, "mlp_bias", False):
        problems.append("mlp_bias=true")
    if hf.model_type == "qwen2_moe" and not getattr(hf, "qkv_bias", True):
        problems.append("qkv_bias=false (mbridge's qwen2_moe bridge always builds a QKV bias)")
    if hf.model_type in MOE_MODEL_TYPES:
        # norm_topk_prob either way: the trainer's router softmaxes before or after its top-k to match
        # (hf_bridge.renormalises_top_k).
        # (DeepSeek's first_k_dense_replace dense layers before the MoE ones are supported: the bridge
        # builds them, and routes address the MoE layers only, as the engine records them)
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            problems.append("dense layers between the MoE layers (mlp_only_layers / decoder_sparse_step)")
    if hf.model_type == "deepseek_v3":
        problems += deepseek_v3_problems(hf)
    if hf.model_type == "glm4_moe":
        problems += glm4_moe_problems(hf)
    quantization = getattr(hf, "quantization_config", None)
    if quantization:  # e.g. DeepSeek-V3's published fp8 weights: the bridge reads them as plain floats
        method = quantization.get("quant_method") if isinstance(quantization, dict) else type(quantization).__name__
        problems.append(f"a quantized checkpoint (quantization_config: {method}; the trainer loads bf16, fp16 "
                        "or fp32 weights)")
    if hf.vocab_size % tp_size:
        # Padding the vocabulary would add logits that vLLM does not have (and shift logprobs).
        problems.append(f"vocab_size {hf.vocab_size} is not divisible by trainer.tensor_parallel_size={tp_size}")
    return problems


def sigmoid_router_problems(hf: PreTrainedConfig) -> list[str]:
    """What of DeepSeek-V3's router (sigmoid scores, a correction bias, groups; GLM-4.5's too) HF and
    megatron's router do not compute alike."""
    problems = []
    if not getattr(hf, "norm_topk_prob", True):  # megatron's sigmoid router always renormalises its top-k
        problems.append("norm_topk_prob=false")
    if hf.num_experts_per_tok == 1:  # HF renormalises one expert's score to 1; megatron keeps the sigmoid
        problems.append("num_experts_per_tok 1")
    groups, group_topk = getattr(hf, "n_group", 1) or 1, getattr(hf, "topk_group", 1) or 1
    if groups > 1 and hf.num_experts_per_tok // group_topk != 2:
        # HF scores a group by its best 2 experts; megatron by its best top_k // topk_group
        problems.append(f"num_experts_per_tok {hf.num_experts_per_tok} // topk_group {group_topk} != 2")
    return problems


def deepseek_v3_problems(hf: PreTrainedConfig) -> list[str]:
    """What of a DeepSeek-V3 config HF, vLLM and the trainer (mbridge's bridge, megatron's MLA and
    router) do not all compute alike (docs/models.md)."""
    problems = []
    # HF's class always routes by sigmoid scores plus the correction bias; vLLM reads DeepSeek's own
    # keys and, without them, softmaxes and drops the bias.
    if getattr(hf, "scoring_func", None) != "sigmoid" or getattr(hf, "topk_method", None) != "noaux_tc":
        problems.append(f"scoring_func {getattr(hf, 'scoring_func', None)!r} / topk_method "
                        f"{getattr(hf, 'topk_method', None)!r} (only 'sigmoid' / 'noaux_tc', which HF always applies)")
    problems += sigmoid_router_problems(hf)
    if not getattr(hf, "rope_interleave", True):  # vLLM and megatron's MLA rotate interleaved pairs only
        problems.append("rope_interleave=false")
    return problems


def gemma3_text_problems(hf: PreTrainedConfig) -> list[str]:
    """What of a Gemma 3 text config the trainer's layers (trainer/gemma3.py) do not compute as HF does."""
    problems = []
    if hf.hidden_activation != "gelu_pytorch_tanh":  # vLLM's Gemma 3 takes this one only too
        problems.append(f"hidden_activation {hf.hidden_activation!r} (only gelu_pytorch_tanh)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):  # Gemma 2's; null in Gemma 3's
        if getattr(hf, key, None) is not None:
            problems.append(f"{key} {getattr(hf, key)}")
    if getattr(hf, "use_bidirectional_attention", False):  # EmbeddingGemma's: not a causal LM
        problems.append("use_bidirectional_attention=true")
    if getattr(hf, "attention_bias", False):
        problems.append("attention_bias=true")
    if not getattr(hf, "tie_word_embeddings", True):
        problems.append("tie_word_embeddings=false")
    if set(hf.layer_types) - {"sliding_attention", "full_attention"}:
        problems.append(f"layer_types {sorted(set(hf.layer_types))}")
    local = rope_parameters(hf, "sliding_attention")
    if local.get("rope_type", "default") != "default" or local.get("partial_rotary_factor", 1.0) != 1.0:
        # a sliding layer's rope is built from its base alone (trainer/gemma3.py)
        problems.append(f"sliding-attention rope {local}")
    return problems


def glm4_moe_problems(hf: PreTrainedConfig) -> list[str]:
    """What of a GLM-4.5 config HF, vLLM and the trainer (mbridge's bridge, megatron's router) do not
    all compute alike (docs/models.md)."""
    problems = sigmoid_router_problems(hf)
    if (hf.n_shared_experts or 0) < 1:  # the bridge maps one shared expert's weights
        problems.append(f"n_shared_experts {hf.n_shared_experts}")
    if getattr(hf, "tie_word_embeddings", False):  # vLLM's GLM-4.5 always builds its own lm_head
        problems.append("tie_word_embeddings=true")
    return problems


def model_problem(model_path: str, tp_size: int = 1) -> str | None:
    """Why the megatron trainer cannot load the HF checkpoint at `model_path` exactly, in one
    line (an unsupported model type, a feature); None if it can."""
    from transformers import AutoConfig, PreTrainedConfig

    raw, _ = PreTrainedConfig.get_config_dict(model_path)  # the type first: AutoConfig may not know it
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = f" ({UNSUPPORTED_WHY[model_type]})" if model_type in UNSUPPORTED_WHY else ""
        return (f"model type {model_type!r} is not supported by the megatron trainer{why}; supported: "
                f"{', '.join(DENSE_MODEL_TYPES)} (dense), "
                f"{', '.join(t for t in MOE_MODEL_TYPES if t not in HYBRID_MODEL_TYPES)} (mixture of experts), "
                f"{', '.join(HYBRID_MODEL_TYPES)} (linear + full attention); see docs/models.md")
    from huggingface_hub.errors import StrictDataclassError

    try:
        hf = AutoConfig.from_pretrained(model_path)
    except (StrictDataclassError, TypeError, ValueError) as e:  # transformers 5 checks each key's type
        message = " ".join(str(e).split()) or type(e).__name__
        return f"its config.json does not load in transformers {transformers_version()}: {message}"
    problems = model_config_problems(hf, tp_size)
    if problems:
        return f"{model_type} with {'; '.join(problems)} is not supported by the megatron trainer (see docs/models.md)"
    return None


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def trainable_model_problems(c: Config) -> list[str]:
    """For commands that train: model.path, if a local checkpoint, is one the trainer loads (a Hub
    id is checked by the trainer once downloaded; the simulated trainer loads none)."""
    path = c.model.path
    if c.trainer.backend != "megatron" or not os.path.isfile(os.path.join(path, "config.json")):
        return []
    problem = model_problem(path, c.trainer.tensor_parallel_size)
    if problem:
        return [f"model.path={path!r}: {problem}"]
    model_type = checkpoint_model_type(path)
    return own_layer_model_problems(c, model_type) if model_type in OWN_LAYER_MODEL_TYPES else []


def own_layer_model_problems(c: Config, model_type: str) -> list[str]:
    """What of a run with a model of asyncrl's own layers (Qwen3.5's text models, Gemma 3's) is not
    built yet (docs/models.md)."""
    problems = []
    if c.trainer.pipeline_parallel_size > 1:
        problems.append(f"trainer.pipeline_parallel_size={c.trainer.pipeline_parallel_size}: {model_type}'s "
                        "layer spec is built for one pipeline stage")
    if model_type not in HYBRID_MODEL_TYPES:
        return problems
    if c.trainer.lora.rank:
        problems.append(f"trainer.lora.rank={c.trainer.lora.rank}: LoRA is not built for {model_type}'s "
                        "gated-DeltaNet layers")
    if c.engine.backend == "vllm" and c.cluster.device == "cpu" and c.engine.tensor_parallel_size > 1:
        problems.append(f"engine.tensor_parallel_size={c.engine.tensor_parallel_size}: {model_type} on vLLM-CPU "
                        "is served and checked on one engine rank (asyncrl's fp32 gated-DeltaNet core)")
    return problems


def checkpoint_model_type(path: str) -> str | None:
    """The model_type in a checkpoint directory's config.json (None: not a readable local one)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def vocab_size(path: str) -> int | None:
    """The vocab_size in a checkpoint directory's config.json (None: not a readable local one)."""
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return None


def reward_model_problem(path: str, process: bool = False) -> str | None:
    """Why the checkpoint at `path` cannot serve as a reward model (reward.model.path), or with
    `process` as a process reward model (reward.prm.path), in one line: it must be a sequence
    (token) classifier with one output. None if it can (or is not a readable local one)."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    head, what = ("TokenClassification", "process reward model") if process else ("SequenceClassification",
                                                                              "reward model")
    classes = [a for a in raw.get("architectures") or [] if a.endswith(f"For{head}")]
    labels = raw.get("num_labels", len(raw.get("id2label") or {}) or 2)
    if not classes:
        kind = "token" if process else "sequence"
        return (f"its architectures {raw.get('architectures')} hold no {kind} classifier "
                f"(a {what} is a *For{head} checkpoint)")
    if labels != 1:
        return f"it has {labels} outputs; a {what} has one score (num_labels=1)"
    return None

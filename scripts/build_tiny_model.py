"""Build a tiny, random-initialised Hugging Face checkpoint of one model family, offline.

    python scripts/build_tiny_model.py --arch qwen3 --out /tmp/tiny_qwen3 [--seed 0]

Each family carries the features of its real configs that change the conversion to megatron
(docs/models.md): qwen2 — grouped-query attention (4 heads over 2 KV heads), QKV bias,
untied output layer; qwen3 — QK-norm, no attention bias, an explicit head_dim (64, so
heads x head_dim != hidden), untied; llama — llama3 rope scaling, grouped-query attention,
untied; mistral — Llama's architecture under its own model_type, a sliding window on every layer
(Mistral-7B-v0.1's), GQA, untied;
qwen3_moe — 8 experts, top-2, top-k probabilities renormalised, QK-norm; mixtral — 8 experts,
top-2 (always renormalised), HF's block_sparse_moe names; qwen2_moe — 8 routed experts, top-2 NOT
renormalised (Qwen1.5/Qwen2-MoE's setting), a shared expert (MLP 128) behind its sigmoid gate,
QKV bias; deepseek_v3 — multi-head latent attention, a dense first layer, then 8 routed experts
in 2 groups chosen by sigmoid score plus a correction bias, and an ungated shared expert;
glm4_moe — DeepSeek-V3's router and shared expert under GQA attention with QKV bias, QK-norm and
rope on half of each head (head_dim 64), a dense first layer;
qwen3_5 (text: `Qwen3_5ForCausalLM`, model_type qwen3_5_text) — Qwen3.5's hybrid: three gated-
DeltaNet linear-attention layers to one gated full-attention layer (2 key / 4 value heads of 128,
the head size vLLM-CPU's kernel takes; a short convolution of 4), zero-centred norms, rope on a
quarter of each head; qwen3_5_moe (`Qwen3_5MoeForCausalLM`, qwen3_5_moe_text) — one DeltaNet and one
gated-attention layer, each with qwen2_moe's experts (top-2 renormalised, a gated shared expert).
gemma3_text — Gemma 3's text model: a sliding-window layer and a global one, four zero-centred norms
a layer, a rope base per kind of layer, GELU-tanh, scaled and tied embeddings.
All: hidden 128, 2 layers (deepseek_v3, glm4_moe: 3, the first dense; qwen3_5: 4), MLP
256 (experts 64), fp32 safetensors (~1.5-4.4 MB), built in seconds.

The config.json is shaped as the family's published checkpoints are (written by transformers 4):
`rope_theta` at the top level with `rope_scaling` beside it (null for plain rope), `torch_dtype`,
no `layer_types` (Gemma 3's: `rope_local_base_freq` and `sliding_window_pattern`, as gemma-3-1b-it's);
Mixtral's, Mistral's and DeepSeek-V3's without `head_dim` (HF derives it), Qwen2's
with Qwen2.5's unused `sliding_window` (`use_sliding_window: false`).

The weights are random, not trained, and deliberately not HF's init: every weight is drawn at
a scale where attention is far from uniform (so rope errors show in the logits), and norm
weights and biases are drawn too (HF starts them at 1 and 0, which would hide one that is
never loaded). The tokenizer is recipes/arith/base_model's (257 tokens: 256 bytes and EOS),
copied; the model's vocab_size is 320, the next multiple of 64, so tensor parallelism up to
64 splits it evenly. The 63 extra rows are real rows of the checkpoint: HF, megatron and vLLM
all compute logits for them, so logprobs agree; no text ever encodes to them.
Same --arch and --seed: the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "recipes" / "arith" / "base_model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
ARCHS = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe",
         "qwen3_5", "qwen3_5_moe", "gemma3_text")
VOCAB_MULTIPLE = 64
# What each tiny checkpoint carries that changes the conversion (docs/models.md's table, written by
# scripts/models_table.py from these and the measurements)
FEATURES = {
    "qwen2": "GQA 4 heads / 2 KV heads, head_dim 32, QKV bias, untied",
    "qwen3": "QK-norm, no attention bias, head_dim 64 (heads x head_dim = 256 != hidden 128), GQA, untied",
    "llama": "llama3 rope scaling (factor 8, low/high_freq_factor 1/4, original context 64), GQA, untied",
    "mistral": "Llama's layers under `model_type: mistral` (mbridge's LLaMA bridge), Mistral-7B-v0.1's sliding "
               "window on every layer (16 tokens), GQA, head_dim 32, untied",
    "qwen3_moe": "8 experts, top-2, norm_topk_prob, QK-norm, GQA, untied",
    "mixtral": "8 experts, top-2 renormalised (softmax of the top-2 logits), HF's `block_sparse_moe` names, GQA, "
               "untied",
    "qwen2_moe": "8 experts, top-2 of the full softmax (`norm_topk_prob: false`), a shared expert (MLP 128) scaled "
                 "by sigmoid(`shared_expert_gate`), QKV bias, GQA, untied",
    "deepseek_v3": "multi-head latent attention: 4 heads, queries through a rank-64 latent with its norm, keys and "
                   "values from one 512-wide latent with its norm plus one 64-wide rope key shared by the heads "
                   "(rope on interleaved pairs), q/k head dim 32 + 64, v head dim 32; 3 layers, the first dense "
                   "(`first_k_dense_replace: 1`, MLP 256), then 8 routed experts in 2 groups, top-2 within the "
                   "best group by sigmoid score plus a per-expert correction bias (drawn, not 0), renormalised "
                   "and scaled by `routed_scaling_factor` 2.5; one ungated shared expert (MLP 64); untied",
    "glm4_moe": "QKV bias, QK-norm, rope on 32 of each head's 64 dims (`partial_rotary_factor` 0.5, NeoX halves), "
                "GQA; 3 layers, the first dense (MLP 256), then 8 routed experts in 2 groups, top-2 within the best "
                "group by sigmoid score plus a per-expert correction bias (drawn), renormalised and scaled by "
                "`routed_scaling_factor` 2.5; one ungated shared expert (MLP 64); untied",
    "qwen3_5": "`qwen3_5_text`, Qwen3.5's hybrid: layers 0-2 gated DeltaNet (2 key / 4 value heads of 128, a "
               "causal convolution of 4, per-head decay `A_log` and `dt_bias`, a gated output norm), layer 3 gated "
               "full attention (4 heads / 2 KV heads of 32, each head's output scaled by sigmoid of its gate from "
               "`q_proj`, QK-norm), rope on 8 of each head's 32 dims (`partial_rotary_factor` 0.25), every norm "
               "zero-centred (x (1 + w)), untied",
    "qwen3_5_moe": "`qwen3_5_moe_text`, Qwen3.5-MoE's hybrid: layer 0 gated DeltaNet, layer 1 gated full "
                   "attention (as `qwen3_5`'s), each with 8 routed experts of 64, top-2 renormalised, and a shared "
                   "expert (MLP 128) behind its sigmoid gate",
    "gemma3_text": "Gemma 3's text model: layer 0 local attention (a sliding window of 16 tokens, rope base 1e4), "
                   "layer 1 global (rope base 1e6, linear scaling factor 8), four zero-centred norms a layer (input, "
                   "attention output, pre- and post-MLP), QK-norm, scores scaled by `query_pre_attn_scalar` 48 ** -0.5 "
                   "(head_dim 64), GELU-tanh, embeddings scaled by sqrt(hidden), tied, GQA",
}


def tiny_config(arch: str, vocab_size: int, eos_id: int) -> PreTrainedConfig:
    """The family's config at the tiny size, with the features named in the module docstring."""
    common = dict(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    if arch == "qwen2":  # QKV bias is built into Qwen2's attention (no flag)
        return Qwen2Config(**common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen3":  # q_norm / k_norm over each head; no attention bias
        return Qwen3Config(**common, head_dim=64, attention_bias=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "llama":
        # Llama 3.1's scaling with a short original context (64 instead of 8192): at the test's
        # sequence lengths low and medium frequencies are both rescaled, so a rope that ignores
        # the scaling, or scales it with Llama 3.1's fixed constants, gives other logits.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**common, head_dim=32, attention_bias=False, mlp_bias=False, rope_parameters=rope)
    if arch == "qwen3_moe":
        # Qwen3-30B-A3B's layout at the tiny size: every layer sparse, 8 experts, top-2 with the
        # top-k probabilities renormalised, QK-norm, untied.
        return Qwen3MoeConfig(**common, head_dim=32, attention_bias=False, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], router_aux_loss_coef=0.001,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "mistral":
        # Mistral-7B-v0.1's layout: a sliding window on every layer (4096 there; here shorter than the
        # tests' rows, so it changes the logits)
        return MistralConfig(**common, head_dim=32, sliding_window=16,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "mixtral":
        # Mixtral-8x7B's layout: every layer sparse, 8 experts, top-2, softmax over the top-2's logits.
        return MixtralConfig(**{**common, "intermediate_size": 64}, head_dim=32, num_local_experts=8,
                             num_experts_per_tok=2, sliding_window=None, router_aux_loss_coef=0.001,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "qwen2_moe":
        # Qwen1.5-MoE / Qwen2-57B-A14B's layout: routed experts whose top-k probabilities are the
        # full softmax's (not renormalised), plus one shared expert every token goes through,
        # scaled by sigmoid(shared_expert_gate(x)); QKV bias.
        return Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                              shared_expert_intermediate_size=128, norm_topk_prob=False, qkv_bias=True,
                              decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                              router_aux_loss_coef=0.001,
                              rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if arch == "deepseek_v3":
        # DeepSeek-V3's layout at the tiny size: multi-head latent attention (queries through a
        # low-rank q_a/q_b pair with its norm, keys and values from a 512-wide latent plus a 64-wide
        # shared rope key: vLLM-CPU's MLA kernel takes only 512 + 64), rope on interleaved pairs;
        # a dense first layer (MLP 256), then 2 sparse ones: 8 routed experts in 2 groups, top-2 from
        # the best group, sigmoid scores plus a per-expert correction bias for the choice,
        # renormalised and scaled by routed_scaling_factor; one ungated shared expert. No
        # multi-token-prediction layer.
        common = {**common, "num_hidden_layers": 3}
        return DeepseekV3Config(**{k: v for k, v in common.items() if k != "num_key_value_heads"},
                                num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
                                qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                                n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                moe_intermediate_size=64, n_shared_experts=1, routed_scaling_factor=2.5,
                                norm_topk_prob=True, first_k_dense_replace=1, num_mtp_layers=0,
                                rope_interleave=True, attention_bias=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                # DeepSeek's own config keys, which HF's class ignores (it always
                                # routes so) and vLLM reads (without them: softmax, no bias)
                                topk_method="noaux_tc", scoring_func="sigmoid")
    if arch == "glm4_moe":
        # GLM-4.5's layout at the tiny size: QKV bias, QK-norm, rope on the first half of each head (NeoX),
        # head_dim 64 (4 x 64 = 256 != hidden 128, as 96 x 128 != 5120); a dense first layer, then 8 routed
        # experts in 2 groups, top-2 within the best group by sigmoid score plus a correction bias,
        # renormalised and scaled by 2.5; one ungated shared expert (MLP 64); untied; no MTP layer.
        return Glm4MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=64, attention_bias=True,
                             use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                             moe_intermediate_size=64, n_shared_experts=1, routed_scaling_factor=2.5,
                             norm_topk_prob=True, first_k_dense_replace=1, num_mtp_layers=0,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                              "partial_rotary_factor": 0.5})
    if arch == "qwen3_5":
        # Qwen3.5's text layers at the tiny size: linear attention in three layers of four, gated
        # full attention (q_proj twice as wide: each head's query, then its output gate) in the
        # fourth; rope on 8 of each head's 32 dims
        return Qwen3_5TextConfig(**{**common, "num_hidden_layers": 4}, head_dim=32,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"],
                                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                 linear_value_head_dim=128, linear_conv_kernel_dim=4, attention_bias=False,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                  "partial_rotary_factor": 0.25})
    if arch == "qwen3_5_moe":
        # Qwen3.5-MoE's layers, one of each kind: every layer's MLP sparse (softmax top-k, always
        # renormalised) beside a shared expert scaled by sigmoid(shared_expert_gate(x))
        return Qwen3_5MoeTextConfig(**common, head_dim=32, layer_types=["linear_attention", "full_attention"],
                                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                                    linear_value_head_dim=128, linear_conv_kernel_dim=4, attention_bias=False,
                                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                    shared_expert_intermediate_size=128, router_aux_loss_coef=0.001,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                     "partial_rotary_factor": 0.25})
    if arch == "gemma3_text":
        # Gemma 3's text layers at the tiny size: a local (sliding-window) layer, then a global one (the
        # published models' 5:1 in two layers); the window shorter than the tests' sequences; the query
        # scale not head_dim's (as Gemma 3 27B's); tied embeddings, as every Gemma's
        return Gemma3TextConfig(**{**common, "tie_word_embeddings": True}, head_dim=64, query_pre_attn_scalar=48,
                                sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                hidden_activation="gelu_pytorch_tanh", attention_bias=False,
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                    "rope_theta": 1000000.0}})
    raise ValueError(f"--arch {arch!r}: one of {ARCHS}")


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Draw every parameter from `seed`, in name order: linear weights N(0, 1/fan_in), the
    embedding N(0, 1), norm weights 1 + N(0, 0.2^2), biases (and DeepSeek's router correction
    bias) N(0, 0.2^2); gated DeltaNet's convolution N(0, 1/kernel), its decay rates A = exp(A_log)
    log-uniform in [0.5, 4] and its dt_bias N(0, 0.2^2)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("A_log"):
            p.copy_(math.log(0.5) + math.log(8.0) * torch.rand(p.shape, generator=gen))
        elif name.endswith("dt_bias"):
            p.copy_(0.2 * noise)
        elif name.endswith("conv1d.weight"):
            p.copy_(noise / math.sqrt(p.shape[-1]))
        elif "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif name.endswith(".bias"):
            p.copy_(0.2 * noise)
        elif "embed_tokens" in name:
            # a tied embedding (Gemma's) is also the output layer: at N(0, 1/hidden) its logits stay
            # of the untied models' size (Gemma scales the input side back up by sqrt(hidden))
            p.copy_(noise / math.sqrt(p.shape[1]) if getattr(model.config, "tie_word_embeddings", False) else noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    # DeepSeek-V3's expert-choice correction bias is a buffer (HF starts it at 0, which would hide
    # one never loaded); its own generator keeps the other families' bytes as they were.
    gen = torch.Generator().manual_seed(seed + 1)
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.2 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


WITHOUT_HEAD_DIM = ("mistral", "mixtral")


def published_style(arch: str, raw: dict) -> dict:
    """The config.json transformers 5 writes, reshaped as the family's published ones (module
    docstring); Qwen3.5's were published by transformers 5: as written."""
    if arch.startswith("qwen3_5"):
        return raw
    raw = dict(raw)
    if arch == "gemma3_text":  # gemma-3-1b-it's keys: a rope base per kind of layer, a pattern for the kinds
        rope = raw.pop("rope_parameters")
        full = dict(rope["full_attention"])
        raw.update(rope_theta=full.pop("rope_theta"), rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
                   rope_scaling=full, sliding_window_pattern=len(raw.pop("layer_types")),
                   torch_dtype=raw.pop("dtype", "float32"))
        raw.pop("_sliding_window_pattern", None)  # transformers 5's private copy of the pattern (its default)
        return raw
    rope = dict(raw.pop("rope_parameters", None) or {})
    raw["rope_theta"] = rope.pop("rope_theta", 10000.0)
    raw["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    raw["torch_dtype"] = raw.pop("dtype", "float32")
    raw.pop("layer_types", None)
    if arch in WITHOUT_HEAD_DIM:
        assert raw["head_dim"] == raw["hidden_size"] // raw["num_attention_heads"], arch
        del raw["head_dim"]
    if arch == "deepseek_v3":  # its config has the latent attention's dims only; HF sets head_dim from them
        assert raw.pop("head_dim") == raw["qk_rope_head_dim"]
    if arch == "qwen2":  # Qwen2.5's: a window that its use_sliding_window flag leaves unused
        raw.update(sliding_window=4096, use_sliding_window=False, max_window_layers=1)
    return raw


def build(arch: str, out: str | Path, seed: int = 0) -> Path:
    """Write the tiny `arch` checkpoint with its tokenizer into `out`; returns `out`."""
    out = Path(out)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER_DIR)
    vocab_size = math.ceil(len(tokenizer) / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config = tiny_config(arch, vocab_size, tokenizer.eos_token_id)
    torch.manual_seed(seed)  # HF's own init runs first; randomise() then replaces every value
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomise(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    config_file = out / "config.json"
    config_file.write_text(json.dumps(published_style(arch, json.loads(config_file.read_text())), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", required=True, choices=ARCHS)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = build(args.arch, args.out, args.seed)
    n = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.arch}: {out} ({n / 1e6:.2f} MB of weights)")


if __name__ == "__main__":
    main()

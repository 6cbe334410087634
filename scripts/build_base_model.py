"""Build the tiny base policy that the CPU recipes start from, offline and from a seed.

    python scripts/build_base_model.py                       # -> recipes/arith/base_model
    python scripts/build_base_model.py --out /tmp/m --max-steps 50   # a quick smoke build
    python scripts/build_base_model.py --recipe chain_sum_cot --batch-size 32 --max-steps 900 --keep-final \
        --out build/chain_sum_cot_worked     # its first stage
    python scripts/build_base_model.py --init-from DIR --direct-fraction 0.8 ...  # a second stage

1. Train a character-level (byte-level BPE with no merges) tokenizer.
2. Build a Qwen2 causal LM small enough for a laptop CPU (hidden 128, 4 layers,
   4 heads of 32: vLLM-CPU's attention needs head_dim >= 32) — an architecture
   vLLM, transformers and megatron-core all load.
3. Supervised warm-up on the recipe's train problems (loss on the answer only, or on the
   recipe's worked solution when its module defines `sft_target(problem) -> str`).
   With --direct-fraction F, each target is instead, with probability F, the recipe's
   `direct_answer(problem)`; with --init-from, training continues from a built model (its
   tokenizer and weights). Together they make a two-stage base: one that learned to work
   problems out, then to answer directly most of the time.
4. Every --eval-every steps, measure greedy accuracy and pass@8 on a selection split
   (its own seed, disjoint from the held-out split) and keep the checkpoint where
   pass@8 - greedy is largest while greedy stays within [--min-greedy, --max-greedy]:
   RL mostly sharpens what the base can already sample, so that gap is its headroom.
5. Save it in Hugging Face format with build_info.json (the measured accuracies on the
   held-out split and the exact settings), so `asyncrl eval` can be checked against it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncrl.config import compose  # noqa: E402
from asyncrl.reward.recipe_hooks import load_recipe_hooks  # noqa: E402
from asyncrl.tasks import Problem, TaskSource, score_answer  # noqa: E402

EOS = "<|endoftext|>"
SELECTION_SEED = 7  # the split used to pick the checkpoint; never the held-out one


def build_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per character, any text encodable."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=len(alphabet) + 1, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=512)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, hidden: int = 128, layers: int = 4,
                experts: int = 0, hybrid: bool = False) -> PreTrainedModel:
    """A dense Qwen2 (tied embeddings, like Qwen2.5-0.5B), or with `experts` a Qwen3-MoE (every
    layer sparse, top-2 with renormalised probabilities, QK-norm, untied, like Qwen3-30B-A3B)
    whose two active experts together are as wide as the dense MLP, or with `hybrid` Qwen3.5's text
    model (every 4th layer gated attention, the others gated DeltaNet with as many heads of 32 as
    the attention, rope on a quarter of each head, tied like the small Qwen3.5s)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=512,  # > the 257 tokens; a multiple of 128 so megatron needs no vocab padding up to TP=4
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
    )
    if hybrid:
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            **common, intermediate_size=4 * hidden, tie_word_embeddings=True, attention_bias=False,
            layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
            linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
            linear_num_key_heads=hidden // 32, linear_num_value_heads=hidden // 32,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))
    if not experts:
        return Qwen2ForCausalLM(Qwen2Config(**common, intermediate_size=4 * hidden, tie_word_embeddings=True))
    # The router's load-balancing loss during warm-up (router_aux_loss_coef) keeps every expert
    # in use; RL then trains without it, as verl and slime do.
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **common, tie_word_embeddings=False, num_experts=experts, num_experts_per_tok=2,
        moe_intermediate_size=2 * hidden, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.01))


def make_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem],
               target: Callable[[Problem], str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt + target + EOS; labels only on the target and EOS."""
    rows = []
    for p in problems:
        prompt = tokenizer.encode(p.prompt)
        answer = tokenizer.encode(target(p)) + [tokenizer.eos_token_id]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@torch.no_grad()
def accuracy(model, tokenizer, problems: list[Problem], extract_answer, k: int,
             max_new_tokens: int, seed: int) -> tuple[float, float]:
    """(greedy accuracy, pass@k with k samples at temperature 1) using HF generate."""
    model.eval()
    tokenizer.padding_side = "left"
    greedy_hits, passk_hits = 0, 0
    torch.manual_seed(seed)
    for start in range(0, len(problems), 128):
        chunk = problems[start:start + 128]
        enc = tokenizer([p.prompt for p in chunk], return_tensors="pt", padding=True)
        common = dict(max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
        greedy = model.generate(**enc, do_sample=False, **common)
        sampled = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                 num_return_sequences=k, **common)
        width = enc["input_ids"].shape[1]
        for i, p in enumerate(chunk):
            text = tokenizer.decode(greedy[i, width:], skip_special_tokens=True)
            greedy_hits += score_answer(p, extract_answer(text)) >= 1.0
            samples = tokenizer.batch_decode(sampled[i * k:(i + 1) * k, width:], skip_special_tokens=True)
            passk_hits += any(score_answer(p, extract_answer(s)) >= 1.0 for s in samples)
    model.train()
    return greedy_hits / len(problems), passk_hits / len(problems)


def _build_info(model_dir: str | None) -> dict | None:
    """The build_info.json of the model a build continued from (None for a new model)."""
    if model_dir is None:
        return None
    path = Path(model_dir) / "build_info.json"
    return json.loads(path.read_text()) if path.exists() else {"path": str(model_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. data.tasks.0.params.max_digits=1")
    parser.add_argument("--recipe", default="arith", help="recipe whose data and prompt template to use")
    parser.add_argument("--out", default=None, help="output directory (default: the recipe's model.path)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--selection-size", type=int, default=300)
    parser.add_argument("--heldout-size", type=int, default=0,
                        help="held-out problems to measure the chosen checkpoint on (default: all)")
    parser.add_argument("--min-greedy", type=float, default=0.15)
    parser.add_argument("--max-greedy", type=float, default=0.50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-final", action="store_true",
                        help="keep the last step's checkpoint (the schedule run to its end) instead of selecting one")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size (heads of 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=0, help="0: dense Qwen2; N: Qwen3-MoE with N experts, top-2")
    parser.add_argument("--hybrid", action="store_true",
                        help="Qwen3.5's text model: gated DeltaNet layers and every 4th one gated attention")
    parser.add_argument("--init-from", default=None,
                        help="continue from this built model (tokenizer and weights) instead of a new one")
    parser.add_argument("--direct-fraction", type=float, default=0.0,
                        help="probability that a target is the recipe's direct_answer instead of its sft_target")
    args = parser.parse_args()
    if args.hidden % 32:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 32 (heads of 32)")
    if not 0.0 <= args.direct_fraction <= 1.0:
        parser.error(f"--direct-fraction {args.direct_fraction}: must be in [0, 1]")
    if args.hybrid and args.experts:
        parser.error("--hybrid with --experts: Qwen3.5's MoE layout is not built")
    if args.keep_final:  # one evaluation, at the end, and that checkpoint is kept
        args.eval_every, args.min_greedy, args.max_greedy = args.max_steps, 0.0, 1.0

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    cfg = compose([f"recipe={args.recipe}", *args.overrides])
    data_cfg = OmegaConf.to_object(cfg.data)
    out = Path(args.out or cfg.model.path)
    hooks = load_recipe_hooks(cfg.recipe.module)
    extract_answer = hooks.extract_answer
    rng = random.Random(args.seed)  # draws the batches and the mix of targets
    def target(problem: Problem) -> str:  # what the model learns to write: a worked solution, or the bare answer
        if args.direct_fraction and rng.random() < args.direct_fraction:
            return hooks.direct_answer(problem)
        return hooks.sft_target(problem)

    max_new_tokens = cfg.rollout.max_new_tokens

    # 1. data and tokenizer
    source = TaskSource(data_cfg)
    selection = source.generate_split("selection", SELECTION_SEED, args.selection_size)
    train = source.train
    # 2. model
    if args.init_from:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.init_from)
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        args.hidden, args.layers = model.config.hidden_size, model.config.num_hidden_layers
        args.experts = getattr(model.config, "num_experts", 0)
        args.hybrid = model.config.model_type == "qwen3_5_text"
    else:
        tokenizer = build_tokenizer([p.prompt + hooks.sft_target(p) + hooks.direct_answer(p) for p in train[:2000]])
        model = build_model(tokenizer, args.seed, args.hidden, args.layers, args.experts, args.hybrid)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; {len(train)} train problems", flush=True)

    # 3. supervised warm-up, 4. checkpoint selection
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    def lr_factor(step: int) -> float:  # 100 warm-up steps, then cosine to 0 at --max-steps
        return min(1.0, (step + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(step, args.max_steps) / args.max_steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    best = None  # (gap, step, greedy, passk, state_dict)
    t0 = time.time()
    model.train()
    for step in range(1, args.max_steps + 1):
        batch = make_batch(tokenizer, rng.sample(train, args.batch_size), target)
        if args.experts:  # adds the router's load-balancing loss (not in generate: HF's breaks with a cache)
            batch["output_router_logits"] = True
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % args.eval_every and step != args.max_steps:
            continue
        greedy, passk = accuracy(model, tokenizer, selection, extract_answer, 8, max_new_tokens, args.seed)
        gap = passk - greedy
        eligible = args.min_greedy <= greedy <= args.max_greedy
        print(f"step {step:5d}  loss {loss.item():.3f}  greedy {greedy:.1%}  pass@8 {passk:.1%}  "
              f"gap {gap:.1%}{'  (eligible)' if eligible else ''}  {time.time() - t0:.0f}s", flush=True)
        if eligible and (best is None or gap > best[0]):
            best = (gap, step, greedy, passk, {k: v.clone() for k, v in model.state_dict().items()})
        if greedy > args.max_greedy:
            break
    if best is None:
        sys.exit(f"no checkpoint had greedy accuracy in [{args.min_greedy}, {args.max_greedy}]; "
                 "change --max-steps or --lr")

    # 5. save the chosen checkpoint and measure it on the held-out split
    _, step, sel_greedy, sel_passk, state = best
    model.load_state_dict(state)
    heldout = source.heldout[: args.heldout_size or None]
    heldout_greedy, heldout_passk = accuracy(model, tokenizer, heldout, extract_answer, 8,
                                             max_new_tokens, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.padding_side = "right"
    tokenizer.save_pretrained(out)
    info = {
        "recipe": args.recipe, "overrides": args.overrides, "seed": args.seed, "selected_step": step,
        "max_steps": args.max_steps, "batch_size": args.batch_size, "lr": args.lr,
        "hidden": args.hidden, "layers": args.layers, "experts": args.experts, "hybrid": args.hybrid,
        "keep_final": args.keep_final,
        "parameters": n_params,
        "direct_fraction": args.direct_fraction, "init_from": _build_info(args.init_from),
        "selection": {"size": len(selection), "greedy": sel_greedy, "pass@8": sel_passk},
        "heldout": {"size": len(heldout), "greedy": heldout_greedy, "pass@8": heldout_passk},
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved step {step} to {out}: held-out greedy {heldout_greedy:.1%}, pass@8 {heldout_passk:.1%}")


if __name__ == "__main__":
    main()

"""Build a reward model for `reward.model.path`: the base model's transformer with a one-output
score head (`*ForSequenceClassification`, num_labels=1), saved with its tokenizer; with `--process`
a process reward model for `reward.prm.path` (`*ForTokenClassification`, num_labels=1: a score at
every token, read at each step's end), its head random (seeded).

    python scripts/build_reward_model.py --base recipes/arith/base_model --out build/arith_reward_model \
        --train-steps 300

With `--train-steps` it learns from the recipe's problems (binary cross-entropy on the right direct
and worked answers against wrong ones of the same forms) to score a right worked solution above a
wrong one (89.5 % of held-out pairs after 300 steps; a bare direct answer it cannot check: 43.5 %,
docs/algorithms.md). Without, the head is random (seeded): a reward model for plumbing tests.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def build(base: Path, out: Path, train_steps: int = 0, seed: int = 0, lr: float = 3e-4, batch: int = 32,
          process: bool = False) -> Path:
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(base, num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    head = AutoModelForTokenClassification if process else AutoModelForSequenceClassification
    model = head.from_pretrained(base, config=config, dtype=torch.float32)
    if train_steps and process:
        raise ValueError("--train-steps trains an outcome reward model only")
    if train_steps:
        _train(model, tokenizer, train_steps, seed, lr, batch)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _pairs(split: str, n: int, rng: random.Random) -> list[dict[str, tuple[str, str]]]:
    """For n arith problems of `split`: (right, wrong) texts of each form, "direct" and "worked" out,
    the wrong answer off by 1-3."""
    sys.path.insert(0, str(REPO))
    from asyncrl.run_config import load_config
    from asyncrl.tasks import TaskSource
    from recipes.arith import direct_answer, sft_target

    pairs = []
    for p in getattr(TaskSource(load_config(["recipe=arith"]).data), split)[:n]:
        wrong = str(int(p.answer) + rng.choice([-3, -2, -1, 1, 2, 3]))
        worked = sft_target(p)
        pairs.append({"direct": (p.prompt + direct_answer(p), p.prompt + f"Answer: {wrong}"),
                      "worked": (p.prompt + worked, p.prompt + worked.rpartition("Answer:")[0] + f"Answer: {wrong}")})
    return pairs


def _labelled(seed: int) -> list[tuple[str, float]]:
    """arith training problems with right answers (1) and wrong ones (0), direct and worked out."""
    rng = random.Random(seed)
    samples = [(text, label) for pair in _pairs("train", 2000, rng) for right, wrong in pair.values()
               for text, label in ((right, 1.0), (wrong, 0.0))]
    rng.shuffle(samples)
    return samples


def ranking(path: Path, n: int = 200, seed: int = 1) -> dict[str, float]:
    """The share of n held-out problems whose right answer the model at `path` scores above the
    wrong one, per form."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    pairs = _pairs("heldout", n, random.Random(seed))
    wins = dict.fromkeys(pairs[0], 0)
    for pair in pairs:
        for form, texts in pair.items():
            with torch.no_grad():
                right, wrong = model(**tokenizer(list(texts), return_tensors="pt", padding=True)).logits[:, 0]
            wins[form] += int(right > wrong)
    return {form: won / len(pairs) for form, won in wins.items()}


def _train(model, tokenizer, steps: int, seed: int, lr: float, batch: int) -> None:
    samples = _labelled(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for step in range(steps):
        chunk = [samples[(step * batch + i) % len(samples)] for i in range(batch)]
        enc = tokenizer([t for t, _ in chunk], return_tensors="pt", padding=True)
        logits = model(**enc).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.tensor([y for _, y in chunk]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, default=REPO / "recipes" / "arith" / "base_model")
    ap.add_argument("--out", type=Path, default=REPO / "build" / "arith_reward_model")
    ap.add_argument("--train-steps", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--process", action="store_true", help="a process reward model (a token classifier)")
    ap.add_argument("--evaluate", type=Path, help="build nothing: how often the reward model at this path "
                    "ranks a held-out right answer above a wrong one (a JSON line)")
    args = ap.parse_args()
    if args.evaluate:
        print(json.dumps({"reward_model": str(args.evaluate), "right_above_wrong": ranking(args.evaluate)}))
    else:
        print(build(args.base, args.out, args.train_steps, args.seed, process=args.process))


if __name__ == "__main__":
    main()

"""Teach the tiny arith base model the calculator call format by supervised fine-tuning.

With the tool:    3 + 4 - 2 =\\n<tool:calculator>3 + 4 - 2</tool><result>5</result>Answer: 5<eos>
Without it:       3 + 4 - 2 =\\nAnswer: 5<eos>
`tool_fraction` of the demonstrations use the tool. Deterministic from its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.run_config import load_config
from asyncrl.tasks import Problem, TaskSource
from recipes.arith import direct_answer


def demonstration(problem: Problem, with_tool: bool) -> str:
    if not with_tool:
        return direct_answer(problem)
    expression = problem.entry["metadata"]["expression"]
    return f"<tool:calculator>{expression}</tool><result>{problem.answer}</result>" + direct_answer(problem)


def build_tool_model(out: Path, steps: int = 200, seed: int = 0, tool_fraction: float = 1.0,
                     lr: float = 1e-3) -> Path:
    """Fine-tune the arith base model for `steps` batches of 32 demonstrations; save to `out`."""
    torch.manual_seed(seed)
    cfg = load_config(["recipe=arith"])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    train = TaskSource(cfg.data).train
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        rows = []
        for p in rng.sample(train, 32):
            ids_p = tok.encode(p.prompt)
            ids_a = tok.encode(demonstration(p, rng.random() < tool_fraction)) + [tok.eos_token_id]
            rows.append((ids_p + ids_a, [-100] * len(ids_p) + ids_a))
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [tok.pad_token_id] * (width - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    Path(out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return Path(out)

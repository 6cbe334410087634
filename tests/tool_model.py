"""A copy of the tiny base model taught to call the calculator, for tool-loop tests.

    Calculate 3 + 4 - 2.\nAnswer: <tool:calculator>3 + 4 - 2</tool><result>5</result>5<eos>

A short supervised fine-tune (the model only has to copy the expression, then the
result), deterministic from its seed.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import load_config
from asyncrl.tasks import TaskSource


def tool_demo(problem) -> tuple[str, str]:
    expression = problem.entry["metadata"]["expression"]
    return problem.prompt, f"<tool:calculator>{expression}</tool><result>{problem.answer}</result>{problem.answer}"


def build_tool_model(out: Path, steps: int = 200, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    cfg = load_config([])
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path)
    train = TaskSource(cfg.data).train
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = random.Random(seed)
    model.train()
    for _ in range(steps):
        rows = []
        for p in rng.sample(train, 32):
            prompt, answer = tool_demo(p)
            ids_p, ids_a = tok.encode(prompt), tok.encode(answer) + [tok.eos_token_id]
            rows.append((ids_p + ids_a, [-100] * len(ids_p) + ids_a))
        width = max(len(r[0]) for r in rows)
        ids = torch.tensor([r[0] + [tok.pad_token_id] * (width - len(r[0])) for r in rows])
        labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys
    import time
    t0 = time.time()
    out = build_tool_model(Path(sys.argv[1]))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    cfg = load_config([])
    for p in TaskSource(cfg.data).heldout[:5]:
        ids = tok(p.prompt, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=40, do_sample=False, pad_token_id=tok.pad_token_id)
        print(repr(tok.decode(gen[0, ids["input_ids"].shape[1]:])))
    print(f"{time.time() - t0:.0f}s")

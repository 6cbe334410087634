"""Writes word_problems.jsonl: short +/- word problems with one-digit numbers (seeded, offline).

    python recipes/multi_task/make_word_problems.py      # rewrites the committed file
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Ana", "Li", "Sam", "Mia", "Ravi", "Eva", "Omar"]
THINGS = ["apples", "pens", "cards", "coins", "books", "shells"]
ADD = "{name} has {a} {things} and gets {b} more. How many {things} does {name} have?"
SUB = "{name} has {a} {things} and gives away {b}. How many {things} does {name} have left?"


def make(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        name, things = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if rng.random() < 0.5:
            rows.append({"question": ADD.format(name=name, things=things, a=a, b=b), "answer": str(a + b)})
        else:
            a, b = max(a, b), min(a, b)
            rows.append({"question": SUB.format(name=name, things=things, a=a, b=b), "answer": str(a - b)})
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("word_problems.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in make(1500)))
    print(f"wrote {out}")

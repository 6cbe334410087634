"""arith recipe: reasoning-gym arithmetic for the tiny base model — `make demo`.

Data: the `data` section of config.yaml (reasoning-gym's basic_arithmetic: +/- over 3-4
one-digit terms, with parentheses and unary minus; fixed seeds; a 500-problem held-out
split), prompted with the bare expression: "( -9 - 8 ) + 6 =\\n". Reward: reasoning-gym's
scorer on the text after the last "Answer:".

The model may answer in one of two ways:
    directly:       "Answer: -11"
    worked out:     "-17 + 6 = -11 Answer: -11"   (one operation per step, innermost group first)
The base model (recipes/arith/base_model, built in two stages by scripts/build_base_model.py,
commands in config.yaml) first learned to work every problem out, then to answer directly
on 80 % of its demonstrations. It now answers directly almost always (greedy: always), and
its direct answers are mostly wrong while its worked ones are mostly right. What RL has to
find is that working it out pays.
"""

from __future__ import annotations

from asyncrl.tasks import Problem

OPENERS = ("(", "-(")  # reasoning-gym writes a negated group as "-( ... )"


def extract_answer(response: str) -> str:
    """The text after the last "Answer:" (empty when the model never answered)."""
    head, sep, tail = response.rpartition("Answer:")
    return tail.strip() if sep else ""


def sft_target(problem: Problem) -> str:
    """The worked solution: each reduction step of the expression, then the answer."""
    steps = reduction_steps(problem.entry["metadata"]["expression"])
    assert steps[-1] == problem.answer, (problem.question, steps)
    return " = ".join(steps) + f" Answer: {problem.answer}"


def direct_answer(problem: Problem) -> str:
    return f"Answer: {problem.answer}"


def reduction_steps(expression: str) -> list[str]:
    """The expression after each single operation, innermost group first, left to right:
    "( -9 - 8 ) + 6" -> ["-17 + 6", "-11"]. Tokens are space-separated, as reasoning-gym
    writes them; a group left holding one number loses its parentheses in the same step."""
    tokens = expression.split()
    steps = []
    while len(tokens) > 1:
        if ")" in tokens:  # the innermost group: the last opener before the first ")"
            close = tokens.index(")")
            start = max(i for i in range(close) if tokens[i] in OPENERS)
            tokens = tokens[:start + 1] + _apply_first(tokens[start + 1:close]) + tokens[close:]
        else:
            tokens = _apply_first(tokens)
        tokens = _unwrap_numbers(tokens)
        steps.append(" ".join(tokens))
    return steps


def _apply_first(tokens: list[str]) -> list[str]:
    """["-9", "-", "8", "+", "1"] -> ["-17", "+", "1"]; a lone number is left as it is."""
    if len(tokens) < 3:
        return tokens
    a, op, b = int(tokens[0]), tokens[1], int(tokens[2])
    return [str(a + b if op == "+" else a - b)] + tokens[3:]


def _unwrap_numbers(tokens: list[str]) -> list[str]:
    """["-(", "4", ")", "+", "1"] -> ["-4", "+", "1"], until no group holds a single number."""
    i = 0
    while i + 2 < len(tokens):
        if tokens[i] in OPENERS and tokens[i + 2] == ")":
            value = -int(tokens[i + 1]) if tokens[i] == "-(" else int(tokens[i + 1])
            tokens = tokens[:i] + [str(value)] + tokens[i + 3:]
            i = 0
        else:
            i += 1
    return tokens

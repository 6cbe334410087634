"""chain_sum_cot recipe: reasoning-gym chain_sum with 2-12 one-digit terms, answered directly
or with a worked chain of running sums, whose length varies about sixfold with the term count.

It is the long-tailed task of `asyncrl bench sync-vs-async`: a synchronous step waits for
its longest responses while the engine's batch empties; the asynchronous one keeps it full.

A worked response: "4 +1=5 +7=12 -7=5 Answer: 5" — the first term, then each operator and
term with the running sum, then the answer; a direct one: "Answer: 5". Base model:
recipes/chain_sum_cot/base_model, supervised first on `sft_target`, then mostly on
`direct_answer` (conf/recipe/chain_sum_cot.yaml has the commands; docs/base_model.md): it
answers directly, and RL teaches it to work the sums out.
"""

from __future__ import annotations

from asyncrl.tasks import Problem


def extract_answer(response: str) -> str:
    """The text after the last "Answer:" (empty when the model never answered)."""
    head, sep, tail = response.rpartition("Answer:")
    return tail.strip() if sep else ""


def sft_target(problem: Problem) -> str:
    """The worked solution the base model is trained to write, from the problem's expression."""
    tokens = problem.entry["metadata"]["expression"].split()  # "4 + 1 - 7" -> ["4", "+", "1", "-", "7"]
    total = int(tokens[0])
    steps = [tokens[0]]
    for op, term in zip(tokens[1::2], tokens[2::2]):
        total = total + int(term) if op == "+" else total - int(term)
        steps.append(f"{op}{term}={total}")
    assert str(total) == problem.answer, (problem.question, total)
    return " ".join(steps) + f" Answer: {total}"


def direct_answer(problem: Problem) -> str:
    """The bare answer: what the second stage of the base model's build mostly demonstrates."""
    return f"Answer: {problem.answer}"

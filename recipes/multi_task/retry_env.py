"""A multi-turn, reward-only environment: arithmetic with one retry.

The model answers; a wrong first answer gets the reply "Wrong. Answer: " and a second
turn. The reward is the last answer's correctness, so a model that fixes its answer
is rewarded too. Hooks for `type: reward_only` (see asyncrl/agents/reward_only.py).
"""

from __future__ import annotations

import functools

import reasoning_gym

from asyncrl.tasks import Problem, answers_match

RETRY = "\nWrong. Answer: "
PARAMS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}


@functools.cache
def _rows(split: str) -> list[dict]:
    size, seed = (2000, 11) if split == "train" else (200, 12)
    return [{"question": e["question"], "answer": str(e["answer"])}
            for e in reasoning_gym.create_dataset("basic_arithmetic", size=size, seed=seed, **PARAMS)]


def problems(split: str) -> list[dict]:
    return _rows(split)


def _answers(response: str) -> list[str]:
    """The model's answer in each turn: the first line after each "Answer: "."""
    return [part.split("\n", 1)[0].strip() for part in response.split(RETRY)]


def reward(problem: Problem, response: str) -> float:
    return float(answers_match(_answers(response)[-1], problem.answer))


def observe(problem: Problem, response: str, turn: int) -> str | None:
    if answers_match(_answers(response)[-1], problem.answer):
        return None
    return RETRY

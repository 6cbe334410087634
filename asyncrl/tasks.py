"""Offline task source: reasoning-gym generators as train and held-out problem splits.

reasoning-gym generates problems procedurally from a seed and scores answers itself,
so nothing is downloaded. A `TaskSource` mixes the configured tasks by weight; the
held-out split comes from its own seed, and any train problem whose question also
occurs in the held-out split is dropped, so held-out accuracy measures generalisation.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import reasoning_gym

from asyncrl.config.schema import DataConfig, TaskConfig

logger = logging.getLogger(__name__)


@dataclass
class Problem:
    """One task instance: the prompt shown to the model and what scoring needs.

    The prompt is `prompt` (text), or, when `messages` is set, a conversation (OpenAI chat
    messages: role system / user / assistant / tool, content, tool_calls) rendered with the
    model's chat template, offering `tools` (OpenAI function schemas) to the model.
    """

    prompt_id: str  # unique and stable: "<split>/<task>/<index>"
    task: str
    question: str
    prompt: str  # the question formatted with the recipe's prompt template
    answer: str
    entry: dict[str, Any] = field(repr=False, default_factory=dict)  # reasoning-gym's item, for its scorer
    agent_loop: str = ""  # the loop for this row; empty: the agent's (or rollout.agent_loop)
    env_id: str = ""  # the agent (environment) the problem belongs to: its reward, its loop
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    # A verl-layout row's `data_source` and `extra_info`, for a verl-signature reward function
    # (asyncrl/reward/reward_function.py); empty otherwise.
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)


class TaskSource:
    """The configured reasoning-gym tasks, split into train and held-out problems."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.heldout: list[Problem] = self._generate("heldout", cfg.heldout_seed, cfg.heldout_size)
        self._heldout_questions = {p.question for p in self.heldout}

    @functools.cached_property
    def train(self) -> list[Problem]:
        """Built on first use: evaluation needs only the held-out split."""
        return self.generate_split("train", self.cfg.train_seed, self.cfg.train_size)

    def generate_split(self, split: str, seed: int, size: int) -> list[Problem]:
        """`size` problems from `seed`, with every question of the held-out split removed."""
        problems = [p for p in self._generate(split, seed, size) if p.question not in self._heldout_questions]
        if len(problems) < size:
            logger.info("%s split: dropped %d problems that also occur in the held-out split",
                        split, size - len(problems))
        return problems

    def _generate(self, split: str, seed: int, size: int) -> list[Problem]:
        problems: list[Problem] = []
        for task, count in zip(self.cfg.tasks, _split_by_weight(size, self.cfg.tasks)):
            if count == 0:
                continue
            # Each task gets its own seed so that adding a task does not change the others' problems.
            task_seed = seed * 1_000_003 + _stable_hash(task.name)
            dataset = reasoning_gym.create_dataset(task.name, size=count, seed=task_seed, **task.params)
            for i, entry in enumerate(dataset):
                problems.append(Problem(
                    prompt_id=f"{split}/{task.name}/{i}",
                    task=task.name,
                    question=entry["question"],
                    prompt=format_prompt(self.cfg.prompt_template, task.name, entry),
                    answer=str(entry["answer"]),
                    entry=entry,
                ))
        return problems


def format_prompt(template: str, task: str, entry: dict[str, Any]) -> str:
    """The template with {question} and any field of the task's metadata (chain_sum: {expression})."""
    fields = {**entry.get("metadata", {}), "question": entry["question"]}
    try:
        return template.format(**fields)
    except KeyError as e:
        raise ValueError(f"prompt_template {template!r}: {e} is not a field of task {task!r} "
                         f"(fields: {', '.join(sorted(fields))})") from None


def score_answer(problem: Problem, answer_text: str) -> float:
    """A reasoning-gym problem: the task's own scorer (1.0 correct, 0.0 wrong, some tasks give
    partial credit). A problem from a file: 1.0 when the answer matches the reference."""
    if not problem.task:
        return float(answers_match(answer_text, problem.answer))
    return float(_scorer(problem.task)(answer_text.strip(), problem.entry))


def answers_match(answer: str, reference: str) -> bool:
    """Equal as numbers when both are numbers ("1,000" == "1000.0"), else as stripped strings."""
    a, r = answer.strip().rstrip("."), reference.strip().rstrip(".")
    try:
        return float(a.replace(",", "")) == float(r.replace(",", ""))
    except ValueError:
        return a == r


@functools.cache
def _scorer(task: str) -> Callable[[str, dict[str, Any]], float]:
    return reasoning_gym.get_score_answer_fn(task)


def _split_by_weight(total: int, tasks: list[TaskConfig]) -> list[int]:
    """Largest-remainder split of `total` problems over tasks in proportion to their weights."""
    weight_sum = sum(t.weight for t in tasks)
    exact = [total * t.weight / weight_sum for t in tasks]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(tasks)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _stable_hash(text: str) -> int:
    """A hash that, unlike hash(), is the same in every process."""
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % 1_000_003
    return h

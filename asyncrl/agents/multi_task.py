"""Weighted multi-task: several agents in one run.

Weights are normalised over the training agents (weight > 0); weight-0 agents take part
in evaluation only. The training groups of each block of B prompts (one train step's
worth) are split by largest remainder, with at least one group per weighted agent, and
each agent's problems are drawn in a seeded shuffle, epoch after epoch.
"""

from __future__ import annotations

import asyncio
import functools
import random
from dataclasses import replace
from typing import Any

from asyncrl.agents.api import Agent, EvaluationResponse
from asyncrl.inference.protocol import InferenceInterface
from asyncrl.tasks import Problem


def allocate_groups(total: int, weights: dict[str, float]) -> dict[str, int]:
    """Split `total` groups over the envs with weight > 0: at least one each, the rest in
    proportion to the weights by largest remainder (ties: the order given)."""
    weighted = {k: w for k, w in weights.items() if w > 0}
    if not weighted:
        raise ValueError("no env has a weight > 0: nothing to train on")
    if total < len(weighted):
        raise ValueError(f"{total} groups cannot give each of the {len(weighted)} weighted envs at least one")
    norm = sum(weighted.values())
    exact = {k: total * w / norm for k, w in weighted.items()}
    counts = {k: max(1, int(x)) for k, x in exact.items()}
    left = total - sum(counts.values())
    order = sorted(weighted, key=lambda k: exact[k] - int(exact[k]), reverse=True)
    i = 0
    while left > 0:  # largest remainders first
        counts[order[i % len(order)]] += 1
        left, i = left - 1, i + 1
    while left < 0:  # the at-least-one rule overshot: take back from the largest shares above one
        k = max((k for k in counts if counts[k] > 1), key=lambda k: counts[k] - exact[k])
        counts[k] -= 1
        left += 1
    return counts


class WeightedMultiTask:
    """The run's agents by env id (duplicates rejected), their normalised training weights,
    and a resumable stream of training problems."""

    def __init__(self, agents: list[Agent], block_size: int, seed: int = 0):
        self.agents: dict[str, Agent] = {}
        for agent in agents:
            if agent.env_id in self.agents:
                raise ValueError(f"duplicate env_id {agent.env_id!r}: each agent needs its own")
            self.agents[agent.env_id] = agent
        self.train_agents = [a for a in agents if a.weight > 0]
        if not self.train_agents:
            raise ValueError("every agent has weight 0 (evaluation only): give at least one a weight > 0")
        total = sum(a.weight for a in self.train_agents)
        self.weights = {a.env_id: a.weight / total for a in self.train_agents}
        self.block_size = block_size
        self.seed = seed
        self._cursors = {a.env_id: [0, 0] for a in self.train_agents}  # env -> [epoch, position]
        self._orders: dict[str, list[int]] = {}
        self._block: list[Problem] = []

    def __getitem__(self, env_id: str) -> Agent:
        try:
            return self.agents[env_id]
        except KeyError:
            raise KeyError(f"unknown env_id {env_id!r}; this run has {', '.join(self.agents)}") from None

    def agent_for(self, problem: Problem) -> Agent:
        """The problem's agent; a problem without an env id belongs to a run's only agent."""
        if not problem.env_id and len(self.agents) == 1:
            return next(iter(self.agents.values()))
        return self[problem.env_id]

    async def evaluate(self, problems: list[Problem], inference: InferenceInterface, n_samples: int,
                       temperature: float, pass_k: list[int]) -> list[EvaluationResponse]:
        """Each agent's pass@k evaluation of its problems, all at once."""
        by_env: dict[str, list[Problem]] = {}
        for p in problems:
            by_env.setdefault(self.agent_for(p).env_id, []).append(p)
        return list(await asyncio.gather(*[self[env].evaluate(ps, inference, n_samples, temperature, pass_k)
                                           for env, ps in by_env.items()]))

    def heldout(self, per_env: int) -> list[Problem]:
        """The first `per_env` held-out problems of every agent, evaluation-only ones included."""
        return [p for a in self.agents.values() for p in a.problems("heldout")[:per_env]]

    # -- the training stream -------------------------------------------------------------

    def next_problem(self) -> Problem:
        if not self._block:
            self._block = self._new_block()
        return self._block.pop(0)

    def _new_block(self) -> list[Problem]:
        counts = allocate_groups(self.block_size, self.weights)
        per_env = {env: [self._draw(env) for _ in range(n)] for env, n in counts.items()}
        block = []
        while any(per_env.values()):  # interleave, so a partial block is mixed too
            for problems in per_env.values():
                if problems:
                    block.append(problems.pop(0))
        return block

    def _draw(self, env_id: str) -> Problem:
        problems = self.agents[env_id].problems("train")
        if not problems:
            raise ValueError(f"env {env_id!r} has no training problems")
        cursor = self._cursors[env_id]
        if cursor[1] == len(problems):
            cursor[0], cursor[1] = cursor[0] + 1, 0
            self._orders.pop(env_id, None)
        p = problems[self._order(env_id, cursor[0], len(problems))[cursor[1]]]
        cursor[1] += 1
        # Each admission of a problem is its own prompt in the ledger.
        return p if cursor[0] == 0 else replace(p, prompt_id=f"{p.prompt_id}#e{cursor[0]}")

    def _order(self, env_id: str, epoch: int, n: int) -> list[int]:
        if env_id not in self._orders:
            order = list(range(n))
            random.Random(f"{self.seed}/{env_id}/{epoch}").shuffle(order)
            self._orders[env_id] = order
        return self._orders[env_id]

    def problem_by_id(self, prompt_id: str) -> Problem:
        """A training problem by its stream id ("<id>" or "<id>#e<epoch>")."""
        base, _, epoch = prompt_id.partition("#e")
        if base not in self._by_id:
            raise KeyError(f"no training problem {base!r} in envs {', '.join(self.weights)}")
        return self._by_id[base] if not epoch else replace(self._by_id[base], prompt_id=prompt_id)

    @functools.cached_property
    def _by_id(self) -> dict[str, Problem]:  # only resume needs it
        return {p.prompt_id: p for a in self.train_agents for p in a.problems("train")}

    def state(self) -> dict[str, Any]:
        return {"cursors": {k: list(v) for k, v in self._cursors.items()},
                "block": [p.prompt_id for p in self._block]}

    def restore(self, state: dict[str, Any]) -> None:
        for env_id, cursor in state["cursors"].items():
            if env_id in self._cursors:
                self._cursors[env_id] = list(cursor)
        self._orders.clear()
        self._block = [self.problem_by_id(i) for i in state["block"]]

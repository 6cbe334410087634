"""Trajectory groups for trainer tests: real prompts through the real tokenizer, fixed responses."""

from __future__ import annotations

import random

from asyncrl.types import Segment, Trajectory, TrajectoryGroup


def make_groups(tokenizer, n_groups: int = 4, n: int = 4, seed: int = 0, version: int = 0) -> list[TrajectoryGroup]:
    """Arithmetic prompts with short digit responses; rewards alternate within each group."""
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        a, b, c = rng.randint(0, 9), rng.randint(0, 9), rng.randint(0, 9)
        prompt = tokenizer.encode(f"Calculate {a} + {b} - {c}.\nAnswer: ")
        trajs = []
        for i in range(n):
            answer = tokenizer.encode(str(rng.randint(-9, 18)))
            logprobs = [-rng.uniform(0.5, 3.0) for _ in answer]
            trajs.append(Trajectory(prompt_id=f"p{seed}-{g}", group_id=f"g{seed}-{g}", prompt_token_ids=prompt,
                                    segments=[Segment.from_policy(answer, logprobs, version)],
                                    reward=float(i % 2)))
        groups.append(TrajectoryGroup(f"g{seed}-{g}", f"p{seed}-{g}", trajs))
    return groups

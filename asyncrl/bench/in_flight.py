"""Requests kept in flight on an engine while a benchmark times a pause or a weight sync."""

from __future__ import annotations

import time
from typing import Any

import ray

from asyncrl.types import SamplingSpec


def start_long_requests(engine: Any, prompt_ids: list[int], n: int, max_model_len: int, tag: str,
                        timeout_s: float = 60.0) -> list[Any]:
    """n requests that would run to `max_model_len`, returned once the engine has all of them
    outstanding (and a little later, so that they are decoding): their Ray refs."""
    long = SamplingSpec(max_new_tokens=max_model_len - len(prompt_ids), ignore_eos=True)
    refs = [engine.generate.remote(prompt_ids, long, f"{tag}-{i}") for i in range(n)]
    deadline = time.monotonic() + timeout_s
    while (outstanding := ray.get(engine.num_outstanding.remote())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{tag}: {outstanding} of {n} requests outstanding on the engine after {timeout_s:g} s")
        time.sleep(0.005)
    time.sleep(0.02)
    return refs

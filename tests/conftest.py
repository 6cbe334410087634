"""Shared test helpers. Tests that start vLLM, Ray or megatron-core are marked `slow`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASE_MODEL = REPO / "recipes" / "arith" / "base_model"
ASYNCRL = [sys.executable, "-m", "asyncrl.cli"]

# Tests never reach a model hub or wandb's servers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `asyncrl ARGS` in a subprocess (vLLM needs its own process: it spawns workers)."""
    return subprocess.run([*ASYNCRL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def base_model() -> Path:
    if not (BASE_MODEL / "config.json").is_file():
        pytest.fail(f"{BASE_MODEL} is missing; build it with `python scripts/build_base_model.py`")
    return BASE_MODEL


@contextlib.contextmanager
def ray_engines(model_path: str | Path, count: int = 1, stream_outputs: list[bool] | None = None,
                model_in_engine_core: list[bool] | None = None) -> Iterator[list]:
    """`count` started EngineActors on `model_path` in a fresh local Ray cluster (shut down after);
    `stream_outputs[i]` is engine i's setting (default: all stream, as with pause_mode=keep), and
    `model_in_engine_core[i]` its engine.cpu_model_in_engine_core (default: the config's)."""
    import ray

    from asyncrl import actors
    from asyncrl.run_config import load_config

    cfg = load_config([f"model.path={model_path}"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        streams = stream_outputs or [True] * count
        in_core = model_in_engine_core or [cfg.engine.cpu_model_in_engine_core] * count
        handles = []
        for i in range(count):  # each engine with its own settings, named engine-<i>
            one = replace(cfg, engine=replace(cfg.engine, num_engines=1, cpu_model_in_engine_core=in_core[i]))
            handles.append(actors.create_engine(one, i, stream=streams[i]))
        infos = actors.start_engines(handles)
        assert all(info.start_s > 0 and info.rss_gib > 0 for info in infos)
        for info, x in zip(infos, in_core):  # the model in the engine core, or in a worker process of its own
            assert info.model_in_engine_core == x, info
        yield handles
        ray.get([h.shutdown.remote() for h in handles])
    finally:
        ray.shutdown()


def assert_same_greedy(resumed: list[int], reference: list[int], prompt: list[int], model_path: str | Path,
                       tie_nats: float = 1e-3) -> int | None:
    """Greedy token ids of a resumed run equal the uninterrupted run's, except where the model
    is indifferent: a resumed request recomputes the prefix in one prefill instead of token by
    token, and those float sums differ in the last bits, which can flip a near-tie. The first
    differing token is accepted only if, by Hugging Face on the common prefix, both tokens lie
    within `tie_nats` of the best one (a real resume bug, a lost or doubled token, differs at a
    confident position). Returns that index, or None if the runs are equal."""
    if resumed == reference:
        return None
    i = next((k for k, (a, b) in enumerate(zip(resumed, reference)) if a != b), None)
    assert i is not None, f"one run is a prefix of the other ({len(resumed)} vs {len(reference)} tokens)"
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + reference[:i]])).logits[0, -1].log_softmax(-1)
    best = float(logprobs.max())
    gaps = {tok: best - float(logprobs[tok]) for tok in (resumed[i], reference[i])}
    assert max(gaps.values()) < tie_nats, f"runs differ at token {i} where the model is not indifferent: {gaps}"
    return i

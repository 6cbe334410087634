"""Shared test helpers. Tests that start vLLM, Ray or megatron-core are marked `slow`."""

from __future__ import annotations

import os
import subprocess
import sys
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

"""Shared test helpers. Tests that start vLLM, Ray or megatron-core are marked `slow`."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
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


# -- the attack suite: every test marked `attack` is one attack; it held when the test passed --------

_ATTACKS = {"tried": 0, "held": 0, "through": []}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "attack" not in report.keywords or not (report.when == "call" or report.when == "setup" and report.failed):
        return
    _ATTACKS["tried"] += 1
    if report.passed:
        _ATTACKS["held"] += 1
    else:
        _ATTACKS["through"].append(report.nodeid)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _ATTACKS["tried"]:
        terminalreporter.write_line(f"{_ATTACKS['tried']} attacks tried, {_ATTACKS['held']} held")
        for nodeid in _ATTACKS["through"]:
            terminalreporter.write_line(f"  got through: {nodeid}")


# -- how `make test` spreads the suite over pytest-xdist workers (-n 2 --dist loadgroup) ------------
# A group runs in one worker, in collection order: by default a module (its module-scoped engines
# start once); the modules on the session's base engines share one group; a test marked `alone`
# (an end-to-end run in subprocesses, sharing nothing) is a group of its own, so such runs spread
# over the workers. Groups with slow tests are handed out first: the long runs start early and
# the quick tests fill the gaps at the end (the Makefile keeps this order: --no-loadscope-reorder).

BASE_ENGINE_MODULES = ("test_engine_vllm", "test_rollout_worker")
_GROUP = pytest.StashKey[str]()


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_groups = set()
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        if item.get_closest_marker("alone"):
            group = re.sub(r"\W", "_", item.nodeid)  # xdist reads the group after the last "@"
        elif module in BASE_ENGINE_MODULES:
            group = "base_engines"
        else:
            group = module
        item.add_marker(pytest.mark.xdist_group(group))
        item.stash[_GROUP] = group
        if "slow" in item.keywords:
            slow_groups.add(group)
    items.sort(key=lambda item: item.stash[_GROUP] not in slow_groups)  # stable: a group keeps its order


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `asyncrl ARGS` in a subprocess (vLLM needs its own process: it spawns workers)."""
    return subprocess.run([*ASYNCRL, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def base_model() -> Path:
    if not (BASE_MODEL / "config.json").is_file():
        pytest.fail(f"{BASE_MODEL} is missing; build it with `python scripts/build_base_model.py`")
    return BASE_MODEL


def _build_reward_model(base_model: Path, out: Path, process: bool) -> Path:
    spec = importlib.util.spec_from_file_location("build_reward_model", REPO / "scripts" / "build_reward_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(base_model, out, seed=0, process=process)


@pytest.fixture(scope="session")
def reward_model(base_model, tmp_path_factory) -> Path:
    """A reward model (reward.model.path): the base model's transformer with a seeded random score
    head (scripts/build_reward_model.py; ~3 s)."""
    return _build_reward_model(base_model, tmp_path_factory.mktemp("reward_model") / "reward_model", False)


@pytest.fixture(scope="session")
def process_reward_model(base_model, tmp_path_factory) -> Path:
    """A process reward model (reward.prm.path): the base model's transformer with a seeded random
    score head at every token."""
    return _build_reward_model(base_model, tmp_path_factory.mktemp("prm") / "prm", True)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for every test that drives actors from this process (the
    subprocess runs start their own). Its CPUs are logical: tests size nothing by them."""
    import ray

    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@contextlib.contextmanager
def ray_engines(model_path: str | Path, count: int = 1, stream_outputs: list[bool] | None = None,
                model_in_engine_core: list[bool] | None = None, first_id: int = 0,
                overrides: tuple[str, ...] = ()) -> Iterator[list]:
    """`count` started EngineActors on `model_path` in the session's Ray cluster (the
    `ray_cluster` fixture), killed after; `stream_outputs[i]` is engine i's setting (default:
    all stream, as with pause_mode=keep), and `model_in_engine_core[i]` its
    engine.cpu_model_in_engine_core (default: the config's); `overrides` of the config (e.g. a
    recipe, for its engine settings). Engines are named engine-<first_id + i>: live engines of
    one cluster need names of their own."""
    import ray

    from asyncrl import actors
    from asyncrl.run_config import load_config

    assert ray.is_initialized(), "ray_engines needs the ray_cluster fixture"
    cfg = load_config([*overrides, f"model.path={model_path}"])
    streams = stream_outputs or [True] * count
    in_core = model_in_engine_core or [cfg.engine.cpu_model_in_engine_core] * count
    handles = []
    try:
        for i in range(count):  # each engine with its own settings
            one = replace(cfg, engine=replace(cfg.engine, num_engines=1, cpu_model_in_engine_core=in_core[i]))
            handles.append(actors.create_engine(one, first_id + i, stream=streams[i]))
        infos = actors.start_engines(handles)
        assert all(info.start_s > 0 and info.rss_gib > 0 for info in infos)
        for info, x in zip(infos, in_core):  # the model in the engine core, or in a worker process of its own
            assert info.model_in_engine_core == x, info
        yield handles
    finally:
        kill_actors(handles, shutdown=True)


def kill_actors(handles: list, shutdown: bool = False) -> None:
    """Stop these actors (an engine's `shutdown` first: vLLM's processes exit with it)."""
    import ray

    if shutdown:
        try:
            ray.get([h.shutdown.remote() for h in handles], timeout=60)
        except Exception:  # a dead actor cannot shut down; it is killed below either way
            pass
    for h in handles:
        ray.kill(h)


@pytest.fixture(scope="session")
def base_engines(ray_cluster, base_model) -> Iterator[list]:
    """Two engines on the arith base model, shared by the modules that test engines and
    workers on it: engine 0 streams per-token outputs (as with pause_mode=keep) and runs its
    model in a vLLM worker process; engine 1 sends one output a request (pause_mode=abort)
    and runs its model in vLLM's engine-core process (engine.cpu_model_in_engine_core), so
    tests on both cover both executors. Tests that load other weights put the base ones back."""
    with ray_engines(base_model, 2, stream_outputs=[True, False], model_in_engine_core=[False, True],
                     first_id=100) as handles:
        yield handles


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

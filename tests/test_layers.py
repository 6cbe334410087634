"""The dependency direction of DESIGN.md, checked on every import in the code (lazy ones
inside functions included): the bottom imports nothing above it, agent loops see only the
bottom, actors never import one another, and only the top knows how actors are built."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

# Plain data, typed messages, config, RL math, the inference protocol and request channel,
# the collective helpers, metrics and logging, the task data, user reward functions.
BOTTOM = ("asyncrl.types", "asyncrl.messages", "asyncrl.config", "asyncrl.algorithm", "asyncrl.inference",
          "asyncrl.sync.collective", "asyncrl.sync.group_store", "asyncrl.sync.shared_buckets", "asyncrl.metrics",
          "asyncrl.monitoring",
          "asyncrl.cpu_cores", "asyncrl.tasks", "asyncrl.recipe_hooks", "asyncrl.reward_function", "asyncrl.clock",
          "asyncrl.lognormal")
AGENT_LOOPS = ("agent_loops",)
# Each actor's folder, and what (besides the bottom) it may use. Agents and agent loops are
# libraries the rollout workers run, not actors of their own.
ACTORS = {
    "asyncrl.engine": (),
    "asyncrl.trainer": (),
    "asyncrl.queue": (),
    "asyncrl.agents": AGENT_LOOPS,
    "asyncrl.rollout": ("asyncrl.agents", *AGENT_LOOPS),
}
# Only these know how actors are built and coordinated.
TOP = ("asyncrl.actors", "asyncrl.driver", "asyncrl.control", "asyncrl.sync.weight_sync", "asyncrl.evaluation",
       "asyncrl.evaluate", "asyncrl.run_config", "asyncrl.train", "asyncrl.serve_env", "asyncrl.cli", "asyncrl.bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from asyncrl import actors` imports asyncrl.actors
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in ("asyncrl", "agent_loops")}


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _code_modules() -> dict[str, set[str]]:
    files = [*(REPO / "asyncrl").rglob("*.py"), *(REPO / "agent_loops").rglob("*.py")]
    return {_module_name(f): _imports(f) for f in files}


def _known(name: str, modules: dict[str, set[str]]) -> bool:
    """`from asyncrl.x import y` names a module only when asyncrl.x.y is one."""
    return name in modules


def allowed(importer: str, imported: str) -> bool:
    if imported == "asyncrl":  # the package itself holds nothing
        return True
    if _within(importer, TOP):
        return True
    if _within(importer, BOTTOM):
        return _within(imported, BOTTOM)
    if _within(importer, AGENT_LOOPS):
        return _within(imported, BOTTOM + AGENT_LOOPS)
    for folder, extra in ACTORS.items():
        if _within(importer, (folder,)):
            return _within(imported, BOTTOM + (folder,) + extra)
    raise AssertionError(f"{importer} is in no layer of tests/test_layers.py: place it")


def test_every_import_follows_the_dependency_direction():
    modules = _code_modules()
    crossings = sorted(f"{importer} imports {imported}" for importer, names in modules.items() for imported in names
                       if _known(imported, modules) and not allowed(importer, imported))
    assert not crossings, "\n".join(crossings)


def test_the_checker_sees_a_crossing():
    assert not allowed("asyncrl.agents.api", "asyncrl.engine.engine_actor")
    assert not allowed("asyncrl.config.validate", "agent_loops")
    assert not allowed("agent_loops.base", "asyncrl.rollout.router")
    assert not allowed("asyncrl.engine.engine_actor", "asyncrl.actors")
    assert allowed("asyncrl.rollout.worker", "asyncrl.agents.api")
    assert allowed("asyncrl.driver", "asyncrl.actors")
    assert allowed("asyncrl.control.engine_pool", "asyncrl.actors")
    assert not allowed("asyncrl.rollout.worker", "asyncrl.control.worker_pool")
    modules = _code_modules()
    assert "asyncrl.actors" in modules["asyncrl.driver"]

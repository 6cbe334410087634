"""The dependency direction of DESIGN.md, checked on every import in the code (lazy ones
inside functions included): the bottom imports nothing above it, agent loops see only the
bottom, actors never import one another, and only the top knows how actors are built."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

from tests.conftest import REPO

# Plain data, typed messages, config, RL math, the inference protocol and request channel, the
# actors' declared interfaces, the weight-sync transports, metrics and logging, the task data, the
# reward code (rule rewards, user reward functions, recipes' scorers, the served models' table and
# clients), torch's private calls, the model operations the engine and the trainer both run.
BOTTOM = ("asyncrl.types", "asyncrl.messages", "asyncrl.config", "asyncrl.algorithm", "asyncrl.inference",
          "asyncrl.interfaces", "asyncrl.sync", "asyncrl.metrics",
          "asyncrl.monitoring",
          "asyncrl.cpu_cores", "asyncrl.tasks", "asyncrl.reward", "asyncrl.clock",
          "asyncrl.lognormal", "asyncrl.torch_compat", "asyncrl.ops")
AGENT_LOOPS = ("agent_loops",)
# Each actor's folder, and what (besides the bottom) it may use. Agents and agent loops are
# libraries the rollout workers run, not actors of their own.
ACTORS = {
    "asyncrl.engine": (),
    "asyncrl.trainer": (),
    "asyncrl.queue": (),
    "asyncrl.run_control": (),  # the run's mailbox and the `asyncrl scale` / `asyncrl stop` that write to it
    "asyncrl.agents": AGENT_LOOPS,
    "asyncrl.rollout": ("asyncrl.agents", *AGENT_LOOPS),
}
# Only these know how actors are built and coordinated.
TOP = ("asyncrl.actors", "asyncrl.driver", "asyncrl.control", "asyncrl.evaluation", "asyncrl.evaluate",
       "asyncrl.run_config", "asyncrl.train", "asyncrl.serve_env", "asyncrl.cli", "asyncrl.bench")


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
    assert not allowed("asyncrl.run_control", "asyncrl.actors")  # the mailbox builds no actor
    assert allowed("asyncrl.rollout.worker", "asyncrl.agents.api")
    assert allowed("asyncrl.rollout.worker", "asyncrl.reward.services")  # the served models' table and clients
    assert not allowed("asyncrl.reward.clients", "asyncrl.engine.reward_model")  # a client knows the interface only
    assert allowed("asyncrl.driver", "asyncrl.actors")
    assert allowed("asyncrl.control.engine_pool", "asyncrl.actors")
    assert not allowed("asyncrl.rollout.worker", "asyncrl.control.worker_pool")
    # The weight sync coordinates the trainer and the engines: control, above both; its transports
    # and the interfaces every actor may name are below them.
    assert not allowed("asyncrl.sync.collective", "asyncrl.control.weight_sync")
    assert allowed("asyncrl.control.weight_sync", "asyncrl.trainer.trainer_group")
    assert allowed("asyncrl.rollout.router", "asyncrl.interfaces")
    assert allowed("asyncrl.trainer.trainer_group", "asyncrl.interfaces")
    assert not allowed("asyncrl.interfaces", "asyncrl.engine.engine_actor")
    modules = _code_modules()
    assert "asyncrl.actors" in modules["asyncrl.driver"]


# Each actor and control class gets the config sections it reads (or small typed settings made
# in one place), never the whole run config; the pools build actors through asyncrl/actors.py,
# which alone takes the whole config, and keep it for that.
GIVEN_SECTIONS = [
    "asyncrl.engine.engine_actor:EngineActor", "asyncrl.engine.sim_engine:SimEngine",
    "asyncrl.queue.message_queue:MessageQueue", "asyncrl.rollout.worker:RolloutWorker",
    "asyncrl.trainer.trainer_rank:TrainerRank", "asyncrl.trainer.sim_trainer:SimTrainerRank",
    "asyncrl.run_control:RunControl", "asyncrl.engine.reward_model:RewardModelActor",
    "asyncrl.agents.api:Agent", "asyncrl.agents.dataset:DatasetAgent",
    "asyncrl.agents.remote:RemoteAgent", "asyncrl.agents.reward_only:RewardOnlyAgent",
    "asyncrl.control.prompts:Prompts", "asyncrl.control.periodic_eval:PeriodicEvaluation",
    "asyncrl.control.supervisor:Supervisor", "asyncrl.control.elastic:Elastic",
    "asyncrl.evaluation:PendingEvaluation",
]


def test_no_actor_or_control_class_takes_the_whole_config():
    taking = []
    for ref in GIVEN_SECTIONS:
        module, name = ref.split(":")
        init = getattr(importlib.import_module(module), name).__init__
        annotations = [str(p.annotation) for p in inspect.signature(init).parameters.values()]
        if any(re.search(r"(?<![\w.])Config\b", a) for a in annotations):
            taking.append(ref)
    assert taking == []
    # every class actors.py makes an actor of is in the list (a new actor is checked too)
    made = set(re.findall(r"ray\.remote\((\w+)\)", (REPO / "asyncrl" / "actors.py").read_text()))
    listed = {ref.split(":")[1] for ref in GIVEN_SECTIONS}
    assert made - {"engine_class", "rank_class"} <= listed, made - listed


def test_no_function_is_over_100_lines():
    """A function longer than a screenful or two is several steps waiting for names."""
    long = []
    for f in (REPO / "asyncrl").rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{f.relative_to(REPO)}:{node.lineno} {node.name}")
    assert long == []


def test_served_models_are_named_only_in_their_room():
    """A served model is one row of asyncrl/reward/services.py (its section in config/): no other
    code names one, so adding one touches no other file (verl's data layout has a `reward_model`
    column of its own: agents/dataset.py reads it)."""
    from asyncrl.reward.services import SERVICES

    names = {spec.name for spec in SERVICES}
    room = ("asyncrl/reward/", "asyncrl/config/")
    found = []
    for f in sorted((REPO / "asyncrl").rglob("*.py")):
        where = str(f.relative_to(REPO))
        if where.startswith(room):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{where}:{node.lineno} {node.value!r}")
    assert [x for x in found if not (x.startswith("asyncrl/agents/dataset.py") and "'reward_model'" in x)] == []

"""The private vLLM, mbridge, megatron-core, torch and uvicorn APIs that asyncrl reaches into (listed by
its compat modules) still exist, and the installed versions are the ones those modules
were checked against: an upgrade fails here until someone re-reads them.

The libraries are imported in a fresh interpreter (no engine, Ray or trainer starts):
importing vLLM edits os.environ, and a megatron_cpu patch applied in this process would
hide the original it replaced."""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl import torch_compat
from asyncrl.agents import uvicorn_compat
from asyncrl.engine import vllm_compat
from asyncrl.trainer import mbridge_compat, megatron_cpu

REPO = Path(__file__).resolve().parents[1]
COMPAT_MODULES = [vllm_compat, mbridge_compat, megatron_cpu, uvicorn_compat, torch_compat]

NAMES = [(m.__name__, module, path) for m in COMPAT_MODULES for module, path in m.PRIVATE_NAMES]
FACTS = [(m.__name__, module, path, text) for m in COMPAT_MODULES for module, path, text in m.SOURCE_FACTS]
REPLACEMENTS = [(module, path, f.__name__) for module, path, f in megatron_cpu.REPLACEMENTS]


def resolve(module: str, path: str):
    obj = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def exists(module: str, path: str) -> bool:
    resolve(module, path)  # raises where it does not
    return True


def _check(fn) -> str:
    """"" where `fn()` holds, else what went wrong."""
    try:
        return "" if fn() else "no"
    except Exception as e:  # an import or lookup that fails is the finding
        return f"{type(e).__name__}: {e}"


def probe() -> dict:
    """Run in the fresh interpreter: every check's outcome, keyed as the tests look them up."""
    names = {f"{module}:{path}": _check(lambda m=module, p=path: exists(m, p))
             for _, module, path in NAMES}
    facts = {f"{module}:{path}:{text}": _check(lambda m=module, p=path, t=text: t in inspect.getsource(resolve(m, p)))
             for _, module, path, text in FACTS}
    replacements = {}
    for module, path, name in REPLACEMENTS:
        def same_parameters(m=module, p=path, name=name):
            ours = inspect.signature(getattr(megatron_cpu, name)).parameters
            return list(inspect.signature(resolve(m, p)).parameters) == list(ours)
        replacements[f"{module}:{path}"] = _check(same_parameters)
    logger = _check(lambda: resolve(vllm_compat.RELOAD_LOGGER, "logger").name == vllm_compat.RELOAD_LOGGER)
    return {"names": names, "facts": facts, "replacements": replacements, "logger": logger}


@pytest.fixture(scope="module")
def probed() -> dict:
    code = "import json; from tests.test_compat import probe; print('PROBE' + json.dumps(probe()))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE")]
    assert out.returncode == 0 and lines, f"the probe failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("PROBE"))


@pytest.mark.parametrize("compat", COMPAT_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_installed_versions_are_the_checked_ones(compat):
    for dist, checked in compat.CHECKED_VERSIONS.items():
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            top = dist.split("-")[0]
            others = importlib.metadata.packages_distributions().get(top, [])
            installed = "not installed" + (f"; `{top}` comes from {', '.join(others)}" if others else "")
        assert installed == checked, (
            f"{compat.__name__} was checked against {dist} {checked}, but {dist} here is {installed}. "
            f"Re-read every private API it lists against the installed source, then update its CHECKED_VERSIONS.")


@pytest.mark.parametrize("owner,module,path", NAMES, ids=[f"{m}:{p}" for _, m, p in NAMES])
def test_private_name_exists(probed, owner, module, path):
    error = probed["names"][f"{module}:{path}"]
    assert not error, f"{owner} uses {module}.{path}, which the installed version lacks ({error})"


@pytest.mark.parametrize("owner,module,path,text", FACTS, ids=[f"{m}:{p}:{t[:40]}" for _, m, p, t in FACTS])
def test_source_fact_holds(probed, owner, module, path, text):
    error = probed["facts"][f"{module}:{path}:{text}"]
    assert not error, (f"{owner} relies on {module}{':' + path if path else ''} containing {text!r}, "
                       f"which the installed version does not ({error})")


@pytest.mark.parametrize("module,path,name", REPLACEMENTS, ids=[f"{m}:{p}" for m, p, _ in REPLACEMENTS])
def test_replacement_takes_the_original_parameters(probed, module, path, name):
    error = probed["replacements"][f"{module}:{path}"]
    assert not error, f"megatron_cpu.{name} replaces {module}.{path}, whose parameters differ now ({error})"


def test_reload_logger_is_the_reload_modules(probed):
    assert not probed["logger"], f"vllm_compat.RELOAD_LOGGER is not the reload module's logger ({probed['logger']})"

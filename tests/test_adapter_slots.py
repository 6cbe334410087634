"""An engine's LoRA adapter slots (asyncrl/engine/adapter_slots.py) on their own, without vLLM:
which adapter a request gets, which requests leave the window, when an adapter may be removed.
tests/test_weight_sync.py runs the same rules through a real engine."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from asyncrl.engine.adapter_slots import AdapterSlots, lora_id

CHECKPOINT = {"model.layers.0.mlp.up_proj.weight": ((16, 8), torch.float32),
              "model.norm.weight": ((8,), torch.float32)}
ADAPTER = {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": (4, 8),
           "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight": (16, 4)}


@pytest.fixture
def slots(monkeypatch) -> AdapterSlots:
    """Slots of a LoRA engine keeping two versions' adapters, with vLLM's LoRARequest as a tuple."""
    fake = types.ModuleType("vllm.lora.request")
    fake.LoRARequest = lambda name, int_id, path: (name, int_id, path)
    monkeypatch.setitem(sys.modules, "vllm.lora.request", fake)
    slots = AdapterSlots(rank=4, versions=2)
    slots.expect({"r": 4}, CHECKPOINT, ADAPTER, engine_id=0)
    return slots


def test_an_adapter_that_does_not_fit_the_checkpoint_or_the_engine_is_refused():
    with pytest.raises(ValueError, match=r"lora_A.weight: shape \(4, 8\), expected \(8, 8\)"):
        AdapterSlots(rank=4).expect({"r": 8}, CHECKPOINT, ADAPTER, engine_id=0)
    with pytest.raises(ValueError, match="adapts no linear weight"):
        AdapterSlots(rank=4).expect({"r": 4}, CHECKPOINT, {"base_model.model.model.norm.lora_A.weight": (4, 8)}, 0)
    with pytest.raises(ValueError, match="the trainer sends whole weights but this engine was started with LoRA"):
        AdapterSlots(rank=4).expect(None, CHECKPOINT, {}, engine_id=0)
    with pytest.raises(ValueError, match="the trainer sends an adapter but this engine was started without LoRA"):
        AdapterSlots(rank=0).expect({"r": 4}, CHECKPOINT, ADAPTER, engine_id=0)
    AdapterSlots(rank=0).expect(None, CHECKPOINT, {}, engine_id=0)  # whole weights: the engine checks them


def test_a_request_keeps_its_adapter_and_an_adapter_is_removed_once_unused(slots):
    assert slots.begin("base", 0) is None  # before the first sync: the base model
    slots.use(1)
    assert slots.begin("a", 1) == ("asyncrl-policy-v1", lora_id(1), "/asyncrl/in-memory/v1")
    slots.use(2)
    assert slots.begin("b", 2)[1] == lora_id(2)
    assert slots.retire(current=2) == []  # "a" still generates on version 1's adapter
    slots.use(3)
    assert slots.outside_window(3) == ["base", "a"]  # two versions kept: 2 and 3
    slots.end("base", 0)
    slots.end("a", 1)
    assert slots.retire(current=3) == [lora_id(1)]  # the base model is never removed
    slots.end("b", 2)
    assert slots.retire(current=3) == [lora_id(2)] and slots.retire(current=3) == []


def test_an_engine_without_lora_tracks_no_request():
    slots = AdapterSlots()
    assert not slots.enabled and slots.begin("a", 0) is None
    slots.end("a", 0)
    assert slots.outside_window(5) == [] and slots.retire(current=5) == []

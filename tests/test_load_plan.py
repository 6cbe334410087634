"""LoadPlan: record the copies a model's load_weights makes, replay them for later loads.

The models here are small torch modules whose `load_weights` follow vLLM's loader patterns
(a fused q/k/v weight filled slice by slice, a tensor-parallel half, vocabulary padding);
the real vLLM model is covered by test_weight_sync."""

from __future__ import annotations

import torch

from asyncrl.engine.load_plan import LoadPlan


class FusedModel(torch.nn.Module):
    """qkv = [q; k; v] along rows, like vLLM's QKVParallelLinear; `tp_half` keeps the second
    half of a tensor's columns (a tensor-parallel rank 1 of 2); `emb` pads the vocabulary."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
        self.tp_half = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(5, 4), requires_grad=False)
        self.calls = 0

    def load_weights(self, weights):
        self.calls += 1
        rows = {"q": 0, "k": 4, "v": 5}
        for name, w in weights:
            if name in rows:
                self.qkv.data.narrow(0, rows[name], w.shape[0]).copy_(w)
            elif name == "tp_half":
                self.tp_half.data.copy_(w.narrow(1, 2, 2))
            elif name == "emb":
                self.emb.data[:3].copy_(w)
                self.emb.data[3:].fill_(0)
            # other names (e.g. a tied lm_head) are skipped, as vLLM's loaders do


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (4, 4), "k": (1, 4), "v": (1, 4), "tp_half": (3, 4), "emb": (3, 4), "lm_head": (3, 4)}
    return {n: torch.randn(*s, generator=g) for n, s in shapes.items()}


def test_replay_puts_every_tensor_where_load_weights_put_it():
    model = FusedModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    assert plan is not None and model.calls == 1
    assert plan.specs == {"q": (4, 4), "k": (1, 4), "v": (1, 4), "tp_half": (3, 4), "emb": (3, 4), "lm_head": (3, 4)}

    new = checkpoint(1)
    reference = FusedModel()
    reference.load_weights(new.items())
    plan.replay(new.items())
    assert model.calls == 1  # the replay did not call load_weights
    for name in ("qkv", "tp_half", "emb"):
        assert torch.equal(getattr(model, name), getattr(reference, name)), name
    # By hand: rows 0-3 of qkv are q, row 4 is k, row 5 is v; tp_half is columns 2-3.
    assert torch.equal(model.qkv, torch.cat([new["q"], new["k"], new["v"]]))
    assert torch.equal(model.tp_half, new["tp_half"][:, 2:])
    assert torch.equal(model.emb[:3], new["emb"]) and not model.emb[3:].any()
    assert plan.in_place(model)


def test_replay_from_views_of_a_bucket_in_another_dtype():
    """Received tensors are views into a byte bucket (offsets > 0) and may come as float64."""
    model = FusedModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    new = checkpoint(2)
    bucket = torch.cat([torch.zeros(3, dtype=torch.float64)] + [t.double().flatten() for t in new.values()])
    views, offset = [], 3
    for name, t in new.items():
        views.append((name, bucket[offset:offset + t.numel()].view(t.shape)))
        offset += t.numel()
    plan.replay(views)
    assert torch.equal(model.qkv, torch.cat([new["q"], new["k"], new["v"]]))
    assert torch.equal(model.tp_half, new["tp_half"][:, 2:])


def test_destinations_are_whole_unchanged_copies_into_contiguous_views():
    model = FusedModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    views = plan.destinations({n: torch.float32 for n in plan.specs})
    # q, k, v: whole, into row slices of qkv (contiguous); tp_half: only columns 2-3 of it;
    # emb: whole, into the first 3 rows; lm_head: never loaded.
    assert sorted(views) == ["emb", "k", "q", "v"]
    assert views["k"].data_ptr() == model.qkv[4].data_ptr() and views["k"].shape == (1, 4)
    assert plan.destinations({n: torch.bfloat16 for n in plan.specs}) == {}  # travels in another dtype
    # Received there, a tensor needs no replay: the parameter already holds it.
    new = checkpoint(3)
    views["q"].copy_(new["q"])
    assert torch.equal(model.qkv[:4], new["q"])


class OverwritingModel(FusedModel):
    """Writes the first row of qkv twice (q's, then k's): the later copy must win."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":
                self.qkv.data[:4].copy_(w)
            elif name == "k":
                self.qkv.data[:1].copy_(w)


def test_copies_into_the_same_memory_are_replayed_in_order():
    assert LoadPlan.capture(FusedModel(), checkpoint(0).items()).disjoint  # q, k, v rows side by side
    model = OverwritingModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    assert not plan.disjoint
    new = checkpoint(4)
    plan.replay(new.items())
    assert torch.equal(model.qkv[0], new["k"][0]) and torch.equal(model.qkv[1:4], new["q"][1:])


class ScalingModel(FusedModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data.copy_(w.narrow(1, 2, 2) * 2)  # computed from the checkpoint: not a copy


class AssigningModel(FusedModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data = w.narrow(1, 2, 2)  # the parameter becomes the checkpoint tensor


class AddingModel(FusedModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data.add_(w.narrow(1, 2, 2))


class SettingModel(FusedModel):
    """Writes tp_half by item assignment, as vLLM's gated-DeltaNet convolution loader does."""

    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data[1:, :] = w.narrow(1, 2, 2)[1:]
                self.tp_half.data[0] = w[0, 2:]


class SettingComputedModel(FusedModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data[:, :] = w.narrow(1, 2, 2) + 1  # computed: not a copy


class SettingBroadcastModel(FusedModel):
    def load_weights(self, weights):
        for name, w in weights:
            if name == "tp_half":
                self.tp_half.data[:] = w[0, 2:]  # one row into every row: not one copy of its shape


def test_item_assignment_of_a_checkpoint_view_is_a_copy():
    model = SettingModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    assert plan is not None and [c.size for c in plan.copies["tp_half"]] == [(2, 2), (2,)]
    new = checkpoint(5)
    plan.replay(new.items())
    assert torch.equal(model.tp_half, new["tp_half"][:, 2:])


def test_loads_a_replay_could_not_repeat_give_no_plan():
    for cls in (ScalingModel, AssigningModel, AddingModel, SettingComputedModel, SettingBroadcastModel):
        model = cls()
        assert LoadPlan.capture(model, checkpoint(0).items()) is None, cls.__name__
        assert model.tp_half.abs().sum() > 0, cls.__name__  # the load itself still happened


def test_a_moved_parameter_is_detected():
    model = FusedModel()
    plan = LoadPlan.capture(model, checkpoint(0).items())
    model.qkv = torch.nn.Parameter(model.qkv.detach().clone(), requires_grad=False)  # e.g. post-load processing
    assert not plan.in_place(model)

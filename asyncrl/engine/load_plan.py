"""The direct load's fast path: replay the copies the model's own `load_weights` made.

vLLM's `model.load_weights` maps checkpoint names onto parameters (fused q/k/v and
gate/up, tensor-parallel slices, tied embeddings) in Python, tensor by tensor: ~5 ms for
the tiny model's 50 tensors, more than the copies themselves. All it leaves behind are
`copy_` calls from a view of each checkpoint tensor into a view of a parameter (or item
assignments `param[index] = view`, the same copy: Qwen3.5's convolution loader).
`LoadPlan.capture` runs one `load_weights` while a TorchFunctionMode records those copies;
`LoadPlan.replay` then makes only them, for tensors with the same names and shapes
(`specs`), contiguous, in the same or another dtype. `LoadPlan.destinations` names the
parameter views a tensor can be received into directly, with no copy at all.

A capture that sees a parameter written any other way (from a tensor computed out of a
checkpoint tensor, or by an in-place op other than a constant fill) yields no plan, and
the caller goes on loading with `load_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from asyncrl.torch_compat import foreach_copy

logger = logging.getLogger(__name__)

# In-place ops a loader may apply to a parameter without reading the checkpoint (vocabulary padding).
CONSTANT_WRITES = {"fill_", "zero_"}
IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__"}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _model_storages(model: torch.nn.Module) -> set[int]:
    return {_storage(t) for t in (*model.parameters(), *model.buffers()) if t.numel()}


def _byte_span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, last byte + 1) of the memory a view may touch."""
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size)
    start = t.storage_offset() * t.element_size()
    return _storage(t), start, start + (last + 1) * t.element_size()


def _disjoint(views: list[torch.Tensor]) -> bool:
    spans = sorted(_byte_span(v) for v in views if v.numel())
    return all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:]))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass
class _Copy:
    dst: torch.Tensor  # a view of a model parameter
    size: tuple[int, ...]  # the source: this view of the checkpoint tensor (elements, not bytes)
    stride: tuple[int, ...]
    offset: int


class _CopyRecorder(TorchFunctionMode):
    """Records every write into the model's parameters while `load_weights` runs."""

    def __init__(self, model_storages: set[int]):
        super().__init__()
        self.model_storages = model_storages
        self.sources: dict[int, tuple[str, torch.Tensor]] = {}  # storage -> (name, checkpoint tensor)
        self.copies: dict[str, list[_Copy]] = {}
        self.unexplained: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.startswith("_")) or name in IN_PLACE_DUNDERS:  # writes into args[0]
            dst = args[0]
            if isinstance(dst, torch.Tensor) and _storage(dst) in self.model_storages:
                if name == "__setitem__":  # `param[index] = loaded` (vLLM's mamba conv loader)
                    self._record_setitem(dst, args[1], args[2])
                else:
                    self._record(name, dst, args[1] if len(args) > 1 else None)
        return out

    def _record_setitem(self, dst: torch.Tensor, index, src) -> None:
        """A copy into `dst[index]` where that is a view of the parameter (basic indexing) of the
        source's shape (no broadcast); otherwise unexplained. (Inside the mode: not recorded.)"""
        view = dst[index]
        if isinstance(src, torch.Tensor) and _storage(view) == _storage(dst) and view.shape == src.shape:
            self._record("copy_", view, src)
        else:
            self._record("__setitem__", dst, src)

    def _record(self, op: str, dst: torch.Tensor, src) -> None:
        if op in CONSTANT_WRITES:
            return
        source = self.sources.get(_storage(src)) if op == "copy_" and isinstance(src, torch.Tensor) else None
        if source is None:
            self.unexplained.append(f"{op} into a {tuple(dst.shape)} parameter view")
            return
        name, base = source
        self.copies.setdefault(name, []).append(
            _Copy(dst, tuple(src.shape), tuple(src.stride()), src.storage_offset() - base.storage_offset()))

    def watch(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Hand `tensors` to the loader, each in a storage of its own, so that a copy's source names it."""
        for name, tensor in tensors:
            own = tensor.contiguous().clone()
            self.sources[_storage(own)] = (name, own)
            yield name, own


@dataclass
class LoadPlan:
    specs: dict[str, tuple[int, ...]]  # the checkpoint tensors it was captured from: name -> shape
    copies: dict[str, list[_Copy]]
    storages: set[int]  # the parameter storages it writes into
    disjoint: bool = True  # no two copies write the same memory: they may run at once (replay)

    @classmethod
    def capture(cls, model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> LoadPlan | None:
        """Load `tensors` with `model.load_weights` (the load happens either way) and record
        it; None where a parameter was written in a way a replay could not repeat."""
        before = _model_storages(model)
        recorder = _CopyRecorder(before)
        with recorder:
            model.load_weights(recorder.watch(tensors))
        if _model_storages(model) != before:  # e.g. `param.data = loaded_weight`: nothing to copy next time
            recorder.unexplained.append("a parameter replaced by another tensor")
        if recorder.unexplained:
            logger.warning("weight loads stay on model.load_weights: it wrote %d parameter view(s) other than "
                           "by copying a checkpoint tensor (first: %s)", len(recorder.unexplained),
                           recorder.unexplained[0])
            return None
        specs = {name: tuple(t.shape) for name, t in recorder.sources.values()}
        storages = {_storage(c.dst) for cs in recorder.copies.values() for c in cs}
        disjoint = _disjoint([c.dst for cs in recorder.copies.values() for c in cs])
        return cls(specs, recorder.copies, storages, disjoint)

    def in_place(self, model: torch.nn.Module) -> bool:
        """Whether the parameters it writes still live where they did (post-load
        processing could have replaced one). Call after restoring any packed-away weights."""
        return self.storages <= _model_storages(model)

    def destinations(self, dtypes: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
        """Parameter views that a tensor can be received straight into, by name: where the
        captured load copied the whole tensor, unchanged, into one contiguous view of the
        same shape and of the dtype it travels in (`dtypes`), starting on an 8-byte boundary
        (the receiver's checksum reads it as 64-bit words)."""
        views = {}
        for name, copies in self.copies.items():
            shape = self.specs[name]
            if len(copies) != 1 or name not in dtypes:
                continue
            c = copies[0]
            whole = c.size == shape and c.offset == 0 and c.stride == _contiguous_strides(shape)
            dst = c.dst
            if (whole and tuple(dst.shape) == shape and dst.is_contiguous() and dst.dtype == dtypes[name]
                    and dst.storage_offset() * dst.element_size() % 8 == 0):
                views[name] = dst
        return views

    def replay(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each tensor where the captured load put it. Tensors must be contiguous. The
        copies go in one foreach copy (a copy_ each costs more in dispatch than the tiny
        model's copies themselves), which may run them at once: in order where the captured
        load wrote some memory twice."""
        dsts, srcs = [], []
        for name, tensor in tensors:
            for c in self.copies.get(name, ()):
                dsts.append(c.dst)
                srcs.append(tensor.as_strided(c.size, c.stride, tensor.storage_offset() + c.offset))
        if not self.disjoint:
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)
        elif dsts:
            foreach_copy(dsts, srcs)

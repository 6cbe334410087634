"""The weight-sync benchmark's baseline: buffers broadcast from trainer rank 0 to every
vLLM worker through the same group a weight sync uses, with no model on either side.

`RawReceiveExtension` is the vLLM worker extension the benchmark's engines load (it runs
inside vLLM's worker process, so this module imports nothing heavy).
"""

from __future__ import annotations

import torch

from asyncrl.engine import vllm_compat
from asyncrl.engine.worker_extension import WeightLoaderExtension
from asyncrl.sync.collective import broadcast_all


def raw_sizes(total_bytes: int, bucket_bytes: int) -> list[int]:
    """`total_bytes` cut into buffers of `bucket_bytes` (the last one shorter)."""
    full, rest = divmod(total_bytes, bucket_bytes)
    return [bucket_bytes] * full + ([rest] if rest else [])


class RawBroadcast:
    """Buffers of the given sizes broadcast all at once. The buffers for each list of sizes
    are allocated and touched once and kept, so that no allocation or page fault is timed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: dict[tuple[int, ...], list[torch.Tensor]] = {}

    def run(self, group, sizes: list[int]) -> None:
        key = tuple(sizes)
        if key not in self.buffers:
            self.buffers[key] = [torch.zeros(n, dtype=torch.uint8, device=self.device) for n in sizes]
        broadcast_all(group, self.buffers[key])


class RawReceiveExtension(WeightLoaderExtension):
    """The weight loader plus a raw receive (called by name through collective_rpc)."""

    _asyncrl_raw: RawBroadcast | None = None

    def asyncrl_receive_raw(self, sizes: list[int]) -> None:
        if self._asyncrl_raw is None:
            self._asyncrl_raw = RawBroadcast(vllm_compat.worker_device(self))
        self._asyncrl_raw.run(self._asyncrl_group, sizes)

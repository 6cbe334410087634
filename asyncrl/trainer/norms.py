"""The zero-centred RMSNorm of Qwen3.5's and Gemma 3's checkpoints, op for op as HF computes it:
megatron-core 0.16.1's torch norms refuse zero-centred weights (only Transformer Engine's take them)."""

from __future__ import annotations

from typing import Any

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """rms_norm(x) * (1 + weight) in fp32 (HF's Qwen3_5RMSNorm, Gemma3RMSNorm), weight starting at 0;
    megatron's norm interface (config, hidden_size, eps)."""

    def __init__(self, config: Any = None, hidden_size: int = 0, eps: float = 1e-6, **kwargs: Any):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

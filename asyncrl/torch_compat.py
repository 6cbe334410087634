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
]
SOURCE_FACTS: list[tuple[str, str, str]] = []  # a built-in: no source to read


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """`dst.copy_(src)` for each pair, in one call: a copy_ each costs more in dispatch than a small
    model's copies themselves. Private: torch 2.13 has no public foreach API."""
    torch._foreach_copy_(dsts, srcs)

"""The names, shapes and dtypes of a checkpoint's tensors, and what in a weight update differs
from them. An engine checks every update against its checkpoint before vLLM sees it, because a
failed reload leaves vLLM dead.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import torch

TensorSpecs = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)

# Tied embeddings: checkpoints may or may not store lm_head.weight; vLLM ties it either way.
TIED_OPTIONAL = {"lm_head.weight"}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def checkpoint_tensor_specs(model_path: str) -> TensorSpecs:
    """name -> (shape, dtype) of every tensor in the checkpoint, from the safetensors headers."""
    specs = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_path}")
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, meta in header.items():
            if name != "__metadata__":
                specs[name] = (tuple(meta["shape"]), _SAFETENSORS_DTYPES.get(meta["dtype"], torch.float32))
    return specs


def weight_problems(expected: TensorSpecs, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """How whole weights of these names and shapes differ from the checkpoint (empty: they match)."""
    missing = sorted(set(expected) - set(shapes) - TIED_OPTIONAL)
    unknown = sorted(set(shapes) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unknown:
        problems.append(f"unknown {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")
    problems += [f"{name}: shape {tuple(shape)}, expected {expected[name][0]}"
                 for name, shape in shapes.items() if name in expected and tuple(shape) != expected[name][0]]
    return problems


def adapter_problems(expected: TensorSpecs, shapes: dict[str, tuple[int, ...]], rank: int) -> list[str]:
    """How a PEFT adapter of these names and shapes does not fit the checkpoint: each tensor must
    adapt a linear weight of it, lora_A [rank, in], lora_B [out, rank] (empty: it fits)."""
    problems = []
    for name, shape in shapes.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", name)
        base = expected.get(f"{m.group(1)}.weight") if m else None
        if base is None or len(base[0]) != 2:
            problems.append(f"{name}: adapts no linear weight of the checkpoint")
            continue
        out, inp = base[0]
        want = (rank, inp) if m.group(2) == "A" else (out, rank)
        if tuple(shape) != want:
            problems.append(f"{name}: shape {tuple(shape)}, expected {want}")
    return problems

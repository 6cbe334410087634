"""One train step of a random tiny Qwen3 (asyncrl/bench/trainer.py) per recompute setting, in
this process, for tests/test_trainer_scale.py: prints one JSON line, a list with each step's loss
and gradient norm, the lengths of the packed rows it trained, a digest of the weights after it, and
the largest tensor made during the step
that has two dimensions at least as long as the packed row (an [L, L] attention mask or scores), and
how many times each op ran.

    python -m tests.trainer_scale_probe --recompute none selective full --seq-len 256 --n 8
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class SquareWatch(TorchDispatchMode):
    """Records the largest tensor any op returns whose two longest dimensions are both >= `length`,
    and how many times each op ran (recomputation runs forward ops again during the backward)."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.largest, self.op = length, 0, None
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.calls[name] = self.calls.get(name, 0) + 1
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                a, b = sorted(t.shape)[-2:]
                if b >= self.length and a >= self.length and t.numel() > self.largest:
                    self.largest, self.op = t.numel(), str(func)
        return out


def step(path: str, recompute: str, seq_len: int, n: int) -> dict:
    from megatron.core import parallel_state as mpu

    from asyncrl.bench.config import SHAPES
    from asyncrl.bench.trainer import synthetic_groups
    from asyncrl.run_config import load_config
    from asyncrl.sync.group_store import new_group_secret
    from asyncrl.trainer.settings import TrainerSettings
    from asyncrl.trainer.trainer_rank import TrainerRank

    row = seq_len * n  # one micro-batch holds every trajectory
    cfg = load_config(["recipe=arith", f"model.path={path}", "model.tokenizer_path=''",
                       f"trainer.recompute={recompute}", f"trainer.max_tokens_per_micro_batch={row}"])
    rank = TrainerRank(TrainerSettings.of(cfg), 0, 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rank.setup("127.0.0.1", port, new_group_secret())  # rank 0 of 1 binds its world's store itself
    groups = synthetic_groups(1, n, seq_len, SHAPES["tiny"]["vocab_size"])
    rows = []  # the packed rows the step trained, as the trainer built them
    packed = rank._packed_updates

    def recorded(samples):
        updates = packed(samples)
        rows.extend(b.input_ids.shape[-1] for update in updates for b in update)
        return updates

    rank._packed_updates = recorded
    watch = SquareWatch(row)
    with watch:
        metrics = rank.train_step(groups, 0).metrics
    digest = {name: float(t.double().abs().sum()) for name, t in rank._export()}
    rank.shutdown()
    mpu.destroy_model_parallel()  # the next step builds its model from scratch in this process
    return {"recompute": recompute, "loss": metrics["train/loss"], "grad_norm": metrics["train/grad_norm"],
            "rows": rows, "square_numel": watch.largest, "square_op": watch.op, "weights": digest, "calls": watch.calls}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recompute", nargs="+", default=["none"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()

    from asyncrl.bench.trainer import build_random_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_random_model("tiny", tmp, args.seq_len))
        steps = [step(path, mode, args.seq_len, args.n) for mode in args.recompute]
    print(json.dumps(steps))


if __name__ == "__main__":
    main()

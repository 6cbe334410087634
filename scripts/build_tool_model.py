"""Build recipes/arith_tool/base_model: the arith base model taught the calculator call
format on `--tool-fraction` of its demonstrations (see recipes/arith_tool/tool_sft.py).

    .venv/bin/python scripts/build_tool_model.py                 # ~12 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from recipes.arith_tool.tool_sft import build_tool_model

OUT = Path(__file__).resolve().parents[1] / "recipes" / "arith_tool" / "base_model"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool-fraction", type=float, default=0.5, help="of the markup demonstrations")
    parser.add_argument("--chat-tool-fraction", type=float, default=0.4, help="of the chat demonstrations")
    args = parser.parse_args()
    t0 = time.time()
    out = build_tool_model(Path(args.out), steps=args.steps, seed=args.seed, tool_fraction=args.tool_fraction,
                           chat_tool_fraction=args.chat_tool_fraction)
    info = {"from": "recipes/arith/base_model", "steps": args.steps, "seed": args.seed,
            "tool_fraction": args.tool_fraction, "chat_tool_fraction": args.chat_tool_fraction,
            "build_seconds": round(time.time() - t0, 1)}
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"saved {out} in {info['build_seconds']}s; evaluate it with: asyncrl eval recipe=arith_tool")


if __name__ == "__main__":
    main()

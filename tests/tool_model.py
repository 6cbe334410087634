"""A copy of the tiny base model that always calls the calculator, for tool-loop tests:

    3 + 4 - 2 =\\n<tool:calculator>3 + 4 - 2</tool><result>5</result>Answer: 5<eos>
"""

from __future__ import annotations

from pathlib import Path

from recipes.arith_tool.tool_sft import build_tool_model as _build


def build_tool_model(out: Path, steps: int = 200, seed: int = 0) -> Path:
    return _build(out, steps=steps, seed=seed, tool_fraction=1.0)

"""Run the model-family matrix (tests/test_model_families.py: every family and layout `make test`
checks) and write docs/models.md's tables from what it measured, so no figure there is typed.

    python scripts/models_table.py           # the tables (markdown), then the figures as one JSON line
    python scripts/models_table.py --write   # also replaces the tables in docs/models.md

The matrix prints, per case, the largest |logit - HF| (two rows packed into one, and the second
row alone) and, for each layout but TP 1, the largest |weight - TP 1's weight| after one Adam
step on the same batch; this reads those lines. The features of each tiny checkpoint are
scripts/build_tiny_model.py's FEATURES. ~4 min on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "models.md"
START, END = "<!-- tables: scripts/models_table.py -->", "<!-- end of tables -->"
NUMBER = r"([-+.\de]+)"
LOGITS = re.compile(rf"^(\w+) (\w+): max \|logit - HF\| = {NUMBER} packed, {NUMBER} alone")
STEP = re.compile(rf"^(\w+) (\w+) vs tp1: max \|weight diff\| after one step = {NUMBER}")
# Layouts the suite leaves out for a family, and why (tests/test_model_families.py SKIPPED)
NOT_RUN = {("qwen2", "tp2"): "the suite runs qwen2's TP 2 on the base model: test_trainer_megatron.py",
           ("mistral", "tp2"): "llama's bridge and layers, whose TP 2 the suite runs"}


def _tiny_model_module():
    spec = importlib.util.spec_from_file_location("build_tiny_model", REPO / "scripts" / "build_tiny_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure() -> dict[str, dict[str, dict[str, float]]]:
    """{arch: {layout: {"logits": ..., "alone": ..., "step": ...}}} from one run of the matrix."""
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/test_model_families.py", "-s", "-q", "-p",
                           "no:randomly", "-k", "logits_equal_hf or one_train_step_moves_every_weight"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the matrix failed:\n{done.stdout[-4000:]}")
    figures: dict[str, dict[str, dict[str, float]]] = {}
    for line in done.stdout.splitlines():
        if m := LOGITS.match(line.strip()):
            figures.setdefault(m[1], {}).setdefault(m[2], {}).update(logits=float(m[3]), alone=float(m[4]))
        elif m := STEP.match(line.strip()):
            figures.setdefault(m[1], {}).setdefault(m[2], {})["step"] = float(m[3])
    return figures


def _number(x: float | None) -> str:
    if x is None:
        return "–"
    return "0 (bit-exact)" if x == 0 else re.sub(r"e([+-])0*(\d)", r"e\1\2", f"{x:.1e}").replace("e+", "e")


def tables(figures: dict[str, dict[str, dict[str, float]]], features: dict[str, str]) -> str:
    rows = ["| family | features of the tiny checkpoint | max abs logit diff vs HF, TP 1 (packed; the second "
            "row alone) | TP 2: logits; weights after one step vs TP 1 |", "|---|---|---|---|"]
    for arch, text in features.items():
        tp1, tp2 = figures.get(arch, {}).get("tp1", {}), figures.get(arch, {}).get("tp2")
        first = f"{_number(tp1.get('logits'))}; {_number(tp1.get('alone'))}" if tp1 else "–"
        second = f"{_number(tp2.get('logits'))}; {_number(tp2.get('step'))}" if tp2 else \
            f"– ({NOT_RUN.get((arch, 'tp2'), 'not run')})"
        rows.append(f"| `{arch}` | {text} | {first} | {second} |")
    rows += ["", "| family | PP 2: weights after one step vs TP 1 | DP 2 | EP 2 (DP 2, 4 experts a rank) |",
             "|---|---:|---:|---:|"]
    for arch, layouts in figures.items():
        if {"pp2", "dp2", "ep2"} & set(layouts):
            rows.append(f"| `{arch}` | " + " | ".join(_number(layouts.get(k, {}).get("step"))
                                                      for k in ("pp2", "dp2", "ep2")) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the tables in {DOC.relative_to(REPO)}")
    args = parser.parse_args()
    figures = measure()
    text = tables(figures, _tiny_model_module().FEATURES)
    print(text)
    if args.write:
        doc = DOC.read_text()
        if START not in doc or END not in doc:
            raise SystemExit(f"{DOC}: no {START} ... {END} markers")
        head, rest = doc.split(START, 1)
        DOC.write_text(f"{head}{START}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

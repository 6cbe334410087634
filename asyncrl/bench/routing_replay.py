"""`asyncrl bench routing-replay`: rollout routing replay (R3) against none, x staleness, on the
real stack with an MoE model.

    asyncrl bench routing-replay recipe=arith_moe                         # none | r3 x k in {0, 2, 4}
    asyncrl bench routing-replay recipe=arith_moe "bench.staleness=[0,2]" "bench.seeds=[1,2]"

For each seed, k in `bench.staleness` and routing replay in (none, r3): the recipe trains
`bench.steps` steps with the staleness held at exactly k (as the staleness bench's controlled
runs: max_staleness = policy_lag = k, no partial rollout), evaluating greedily every
`bench.eval_every` steps. Reported per run: the held-out accuracy curve and its final value and
area, mean mismatch KL(mu || pi), clipped share, and mean `moe/router_agreement` (the share of
(token, layer) pairs whose trainer top-k equals the engine's: without replay in the trainer's
own forward, with replay given the engine's routes at the layers below; docs/moe.md). Writes
`runs.json` and `table.md` into the run directory; the last line is a JSON object.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asyncrl.bench.config import BenchConfig
from asyncrl.bench.staleness import Arm, arm_config, run_figures
from asyncrl.config import Config
from asyncrl.monitoring.run_log import read_metrics

logger = logging.getLogger(__name__)

REPLAYS = ("none", "r3")


def run_routing_replay_bench(cfg: Config, bench: BenchConfig) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig

    from asyncrl.config import validate
    from asyncrl.driver import run_training

    root = Path(cfg.run.output_dir or HydraConfig.get().runtime.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    grid = [(seed, k, replay) for seed in bench.seeds for k in bench.staleness for replay in REPLAYS]
    results: list[dict[str, Any]] = []
    for i, (seed, k, replay) in enumerate(grid, 1):
        name = f"{replay}_k{k}_s{seed}"
        logger.info("routing-replay bench: run %d of %d, %s", i, len(grid), name)
        arm = Arm("controlled", cfg.algorithm.loss.type, k, seed)
        run_cfg = arm_config(cfg, bench, arm, root / name)
        run_cfg = replace(run_cfg, algorithm=replace(run_cfg.algorithm, routing_replay=replay))
        summary = run_training(validate(asdict(run_cfg)), root / name)
        records = [r for r in read_metrics(root / name) if "moe/router_agreement" in r]
        agreement = statistics.fmean(r["moe/router_agreement"] for r in records) if records else None
        results.append({"routing_replay": replay, "staleness": k, "seed": seed, **run_figures(root / name),
                        "router_agreement": agreement, "base_accuracy": summary["base_accuracy"],
                        "final_accuracy": summary["final_accuracy"], "wall_s": summary["wall_s"]})
        (root / "runs.json").write_text(json.dumps(results, indent=1) + "\n")
        (root / "table.md").write_text(markdown_table(results, bench))
    final = {replay: {k: _mean(results, replay, k, "final_accuracy") for k in bench.staleness} for replay in REPLAYS}
    agreement = {replay: {k: _mean(results, replay, k, "router_agreement") for k in bench.staleness}
                 for replay in REPLAYS}
    return {"bench": "routing_replay", "recipe": cfg.recipe.name, "steps": bench.steps, "seeds": bench.seeds,
            "final_accuracy": final, "router_agreement": agreement, "table": str(root / "table.md"),
            "runs": str(root)}


def _mean(results: list[dict[str, Any]], replay: str, k: int, figure: str) -> float | None:
    values = [r[figure] for r in results
              if r["routing_replay"] == replay and r["staleness"] == k and r[figure] is not None]
    return statistics.fmean(values) if values else None


def markdown_table(results: list[dict[str, Any]], bench: BenchConfig) -> str:
    """One row per (routing replay, k), means over seeds."""
    lines = ["| routing replay | k | final accuracy | area under curve | router agreement | mismatch KL | clipped |\n",
             "|---|---:|---:|---:|---:|---:|---:|\n"]
    for k in sorted({r["staleness"] for r in results}):
        for replay in REPLAYS:
            if _mean(results, replay, k, "final_accuracy") is None:
                continue

            def cell(figure: str, fmt: str, replay: str = replay, k: int = k) -> str:
                v = _mean(results, replay, k, figure)
                return "" if v is None else format(v, fmt)

            lines.append(f"| {replay} | {k} | {cell('final_accuracy', '.1%')} | {cell('auc', '.1%')} | "
                         f"{cell('router_agreement', '.4f')} | {cell('mismatch_kl', '.2e')} | "
                         f"{cell('clip_fraction', '.4f')} |\n")
    seeds = len({r["seed"] for r in results})
    lines.append(f"\n{len(results)} runs, {seeds} seed(s), {bench.steps} steps each.\n")
    return "".join(lines)

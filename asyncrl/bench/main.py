"""`asyncrl bench NAME [recipe=...] [key=value ...] [bench.key=value ...]`: benchmarks that
print their figures as one JSON object on the last line. Each compares against its
baseline in the same run.

    rollout       the rollout path (worker -> agent loop -> engine actor) vs raw vLLM
    chat          the chat endpoint (sessions, the `openai` client) vs the token endpoint, multi-turn
    weight-sync   a full weight sync (pause -> broadcast -> load -> resume) vs a raw broadcast
    sync-vs-async the same recipe trained synchronously and asynchronously for equal wall time
    faults        a run that loses an engine, a rollout worker, a trainer rank, then is killed and resumed
    elastic       a run whose engines are grown and shrunk while it trains (`asyncrl scale`)
    staleness     learning at staleness held exactly at k, per loss, against synchronous training
    routing-replay  MoE rollout routing replay (r3) against none, at staleness held at k
    simulate      a scenario on simulated backends, colocated sync vs async (`asyncrl simulate SCENARIO`)
    calibrate     this machine's engine, trainer and sync measured into a scenario (`asyncrl calibrate RECIPE`)
    trainer       the trainer alone on a random model of a given shape: tokens/s, MFU against the device's
                  matmul peak, peak memory, host share, weight staging (no Ray, no engines)

`bench.*` settings are the benchmarks' own (asyncrl/bench/config.py); the rest is the
training config, composed and validated as `asyncrl train` does.
"""

from __future__ import annotations

import importlib
import json
import sys

import hydra
from omegaconf import DictConfig

from asyncrl.bench.config import BenchConfig, parse_bench_config, split_bench_overrides
from asyncrl.config import CONF_DIR, ConfigError
from asyncrl.run_config import validate_or_exit, validate_shown_config

BENCHMARKS = {
    "rollout": "asyncrl.bench.rollout:run_rollout_bench",
    "chat": "asyncrl.bench.chat:run_chat_bench",
    "weight-sync": "asyncrl.bench.weight_sync:run_weight_sync_bench",
    "sync-vs-async": "asyncrl.bench.sync_vs_async:run_sync_vs_async_bench",
    "faults": "asyncrl.bench.faults:run_faults_bench",
    "elastic": "asyncrl.bench.elastic:run_elastic_bench",
    "staleness": "asyncrl.bench.staleness:run_staleness_bench",
    "routing-replay": "asyncrl.bench.routing_replay:run_routing_replay_bench",
    "simulate": "asyncrl.bench.simulate:run_simulate_bench",
    "calibrate": "asyncrl.bench.calibrate:run_calibrate_bench",
    "trainer": "asyncrl.bench.trainer:run_trainer_bench",
}
_selected: list[tuple[str, BenchConfig]] = []


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(dict_cfg: DictConfig) -> None:
    cfg = validate_or_exit(dict_cfg, trains=True)
    name, bench = _selected[0]
    module, func = BENCHMARKS[name].split(":")
    try:
        result = getattr(importlib.import_module(module), func)(cfg, bench)
    except ConfigError as e:  # what a bench refuses of the config once it is composed
        print(f"asyncrl bench {name}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(json.dumps(result), flush=True)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        print(f"usage: asyncrl bench {{{','.join(BENCHMARKS)}}} [recipe=NAME] [key=value ...] [bench.key=value ...]",
              file=sys.stderr)
        raise SystemExit(2)
    bench_args, rest = split_bench_overrides(sys.argv[2:])
    try:
        bench = parse_bench_config(bench_args)
    except ConfigError as e:
        print(f"asyncrl bench: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    _selected.append((sys.argv[1], bench))
    sys.argv = [f"{sys.argv[0]} {sys.argv[1]}", *rest]
    validate_shown_config("config", trains=True)
    _hydra_main()

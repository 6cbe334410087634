"""The `asyncrl` command: a thin dispatcher to the Hydra apps.

    asyncrl train recipe=arith [key=value ...]    # python -m asyncrl.train ...
    asyncrl eval recipe=arith [key=value ...]     # python -m asyncrl.evaluate ...
    asyncrl plot RUN_DIR                          # plots.png from a run's metrics.jsonl
    asyncrl scale RUN_DIR --engines N             # grow or shrink a running job's engines
    asyncrl stop RUN_DIR                          # end a running job after its current step
    asyncrl serve-env --config FILE --port 8765   # agents over HTTP for remote rollouts
    asyncrl simulate SCENARIO [key=value ...]     # asyncrl bench simulate recipe=SCENARIO ...
    asyncrl calibrate RECIPE [key=value ...]      # asyncrl bench calibrate recipe=RECIPE ...
    asyncrl text-model SRC DST                    # a Qwen3.5 / Gemma 3 VL checkpoint's text model

Everything after the subcommand goes to Hydra, so its flags work too:
`--cfg job` prints the resolved config (validated first), `--help` lists the config groups.
"""

from __future__ import annotations

import faulthandler
import importlib
import signal
import sys

COMMANDS = {
    "train": ("asyncrl.train", "train a policy with a recipe"),
    "eval": ("asyncrl.evaluate", "held-out accuracy of a policy: `asyncrl eval [CHECKPOINT] recipe=...`"),
    "plot": ("asyncrl.monitoring.plot", "PNG curves of a run: `asyncrl plot RUN_DIR`"),
    "scale": ("asyncrl.run_control:scale_main",
              "grow or shrink a running job's engines: `asyncrl scale RUN_DIR --engines N`"),
    "stop": ("asyncrl.run_control:stop_main", "end a running job after its step: `asyncrl stop RUN_DIR`"),
    "serve-env": ("asyncrl.serve_env", "host agents over HTTP: `asyncrl serve-env --config FILE --port N`"),
    "bench": ("asyncrl.bench.main", "benchmarks: `asyncrl bench rollout | weight-sync | sync-vs-async | ...`"),
    "simulate": ("asyncrl.bench.main", "a scenario on simulated backends: `asyncrl simulate sim_math7b_128gpu`"),
    "calibrate": ("asyncrl.bench.main", "measure this machine into a scenario: `asyncrl calibrate chain_sum_cot`"),
    "text-model": ("asyncrl.config.text_model",
                   "the text model of a vision-language checkpoint: `asyncrl text-model SRC DST` (Qwen3.5, Gemma 3)"),
}
# `asyncrl simulate SCENARIO ...` = `asyncrl bench simulate recipe=SCENARIO ...`; likewise calibrate.
RECIPE_BENCHES = {"simulate": "SCENARIO: conf/recipe/sim_*.yaml", "calibrate": "RECIPE: conf/recipe/*.yaml"}


def usage() -> str:
    lines = ["usage: asyncrl COMMAND [recipe=NAME] [key=value ...] [hydra flags]", "", "commands:"]
    lines += [f"  {name:<10}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "e.g. asyncrl train recipe=arith algorithm.max_staleness=2",
              "     asyncrl train recipe=arith --cfg job      # print the resolved config",
              "     asyncrl train --help                      # config groups and options"]
    return "\n".join(lines)


def main() -> None:
    # `kill -USR1 PID` prints every thread's stack to stderr: where a run that seems stuck waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        print(usage())
        return
    command = sys.argv[1]
    if command not in COMMANDS:
        print(f"asyncrl: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    module, _ = COMMANDS[command]
    if command in RECIPE_BENCHES:
        if len(sys.argv) < 3 or "=" in sys.argv[2]:
            what = RECIPE_BENCHES[command]
            print(f"usage: asyncrl {command} {what.split(':')[0]} [key=value ...]  ({what})", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = ["asyncrl", "bench", command, f"recipe={sys.argv[2]}", *sys.argv[3:]]
        command = "bench"
    sys.argv = [f"asyncrl {command}", *sys.argv[2:]]
    module, _, function = module.partition(":")
    getattr(importlib.import_module(module), function or "main")()


if __name__ == "__main__":
    main()

"""Where the CPU goes while something runs: every INTERVAL seconds, one JSON line with the
processes that used the most CPU in that window (in cores: 1.0 = one core busy), named by
their process title (ray::TrainerRank, VLLM::EngineCore, ...). Linux only; stops on Ctrl-C.

    python scripts/cpu_by_process.py --interval 10 --out cpu.jsonl &
    asyncrl bench sync-vs-async recipe=chain_sum_cot; kill %1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from process_census import read_processes  # noqa: E402 (beside this script, not a package)


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """pid -> (process title, user + system CPU seconds so far)."""
    return {pid: (" ".join(cmdline)[:60], cpu) for (pid, _), (cmdline, cpu) in read_processes().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds per window")
    parser.add_argument("--out", default="-", help="JSONL file to append to; - for stdout")
    parser.add_argument("--top", type=int, default=8, help="processes listed per window")
    args = parser.parse_args()
    sink = open(args.out, "a") if args.out != "-" else None  # noqa: SIM115 (open for the whole run)
    before = cpu_seconds()
    try:
        while True:
            time.sleep(args.interval)
            now = cpu_seconds()
            used = sorted(((cpu - before.get(pid, (title, 0.0))[1]) / args.interval, title)
                          for pid, (title, cpu) in now.items())
            line = json.dumps({"time": time.strftime("%H:%M:%S"),
                               "cores": [[round(c, 2), t] for c, t in reversed(used[-args.top:]) if c >= 0.02]})
            print(line, file=sink, flush=True)
            before = now
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

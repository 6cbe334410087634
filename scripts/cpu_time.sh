#!/usr/bin/env bash
# Run a command and report its wall time and the machine's CPU time over it (user + system of every
# process, from /proc/stat: Ray's and vLLM's processes are not children that `time` would count).
#   bash scripts/cpu_time.sh make test
# Measures the whole machine: run it on an otherwise idle one. Prints a final JSON line, with the
# processes the command started by kind, their starts and CPU seconds (scripts/process_census.py).
set -uo pipefail
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
ticks=$(getconf CLK_TCK)
census=$(mktemp)
python3 "$(dirname "$0")/process_census.py" "$census" & poller=$!
until [ -s "$census" ]; do sleep 0.05; done
b0=$(busy); t0=$(date +%s.%N)
"$@"; rc=$?
b1=$(busy); t1=$(date +%s.%N)
kill -TERM $poller; wait $poller
python3 - "$b0" "$b1" "$t0" "$t1" "$ticks" "$rc" "$(nproc)" "$census" <<'PY'
import json, sys
b0, b1, t0, t1, hz, rc, cores = map(float, sys.argv[1:8])
cpu, wall = (b1 - b0) / hz, t1 - t0
with open(sys.argv[8]) as f:
    processes = json.load(f)
print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cpu_min": round(cpu / 60, 1),
                  "busy": round(cpu / (wall * cores), 3), "cores": int(cores), "rc": int(rc),
                  "processes": processes}))
PY
rm -f "$census"
exit $rc

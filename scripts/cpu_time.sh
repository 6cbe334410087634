#!/usr/bin/env bash
# Run a command and report its wall time and the machine's CPU time over it (user + system of every
# process, from /proc/stat: Ray's and vLLM's processes are not children that `time` would count).
#   bash scripts/cpu_time.sh make test
# Measures the whole machine: run it on an otherwise idle one. Prints a final JSON line.
set -uo pipefail
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
ticks=$(getconf CLK_TCK)
b0=$(busy); t0=$(date +%s.%N)
"$@"; rc=$?
b1=$(busy); t1=$(date +%s.%N)
python3 - "$b0" "$b1" "$t0" "$t1" "$ticks" "$rc" "$(nproc)" <<'PY'
import json, sys
b0, b1, t0, t1, hz, rc, cores = map(float, sys.argv[1:])
cpu, wall = (b1 - b0) / hz, t1 - t0
print(json.dumps({"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "cpu_min": round(cpu / 60, 1),
                  "busy": round(cpu / (wall * cores), 3), "cores": int(cores), "rc": int(rc)}))
PY
exit $rc

#!/bin/bash
# On a lent GPU machine, what is left of issue 49 split in one call (~6 minutes on an H100):
# 1. whether torch's own profiler, with no auditor, leaves a per-step cost after its window
#    (bench_window_after.py: a window as the audit makes it against a run without one);
# 2. each per-step part's cost inside one audited process, one part out at a time
#    (bench_steady_parts.py --toggle 25:rotate), with the window moved to step 1000.
# Logs go to $OUT (default /tmp/out). Carry .whl/, the wheels gpu_steady.sh installs (no network there).
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"
timeout 200 python3 bench/bench_window_after.py --device cuda --steps 1500 --at 700 --width 600 --rounds 3 \
  --cpus 2,3 2>&1 | tee "$out/window_after.log"
FIRST=300 LAST=2000 W1=300:1000 W2=1000:2000 timeout 330 bash bench/gpu_steady.sh 2 2000 proxy \
  --toggle 25:rotate --window-at 1000

#!/usr/bin/env bash
# The live part of the heads' after.sh scripts: head H (name N) against the default head in one interleaved run per
# temperature on the default (fastest) path, all 80 MT-bench first turns, 128 new tokens; results in folder O.
# Run it on a quiet machine (the benchmarks are timed).   bash docs/bench/issue10/live.sh H N O
# EXTRA_HEADS="N2=H2,..." adds heads to the same runs (v12: the control head beside the new one). BASE=PATH: the head
# "eagle" runs with (default: the default head; v10 to v12 ran against v9, the default until 2026-12-07).
set -euo pipefail
cd "$(dirname "$0")/../../.."
H=$1; N=$2; O=$3
# a quiet cost table first (the benchmarks' tree policy reads it from the cache), kept with the results
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
for T in 0 1; do
  .venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 --temperature $T \
    ${BASE:+--head $BASE} --heads "$N=$H${EXTRA_HEADS:+,$EXTRA_HEADS}" --json $O/mt80-T$T.json --report $O/mt80-T$T
done
.venv/bin/python docs/bench/issue10/v9/summary.py $O/mt80-T0.json $O/mt80-T1.json | tee $O/summary.txt

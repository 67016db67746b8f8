#!/usr/bin/env bash
# Sampled rounds (T > 0) with the rejection sampling and the head's catch-up inside the verification call, against
# the separate catch-up call and host-side rejection sampling, in one interleaved run on the 80 MT-bench first
# turns at T = 1, 128 tokens, plain decoding the baseline; default head, default (compiled) path. Run it on a quiet
# machine: it is timed. About 10 minutes here.
#   bash docs/bench/issue9/sampled-fused/run.sh [OUT_DIR]        (T0=1: then the same turns at T = 0 too)
set -euo pipefail
O=${1:-docs/bench/issue9/sampled-fused}
mkdir -p $O
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle,eagle-unfused --max-new-tokens 128 \
  --temperature 1 --no-progress --json $O/mt80-T1.json --report $O/mt80-T1 > $O/mt80-T1.txt
.venv/bin/python docs/bench/issue9/summary.py $O/calibrate.json $O/mt80-T1.json | tee $O/summary.txt
if [ "${T0:-0}" = 1 ]; then
  .venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 \
    --temperature 0 --no-progress --json $O/mt80-T0.json --report $O/mt80-T0 > $O/mt80-T0.txt
  .venv/bin/python docs/bench/issue9/summary.py $O/calibrate.json $O/mt80-T0.json | tail -4 | tee -a $O/summary.txt
fi

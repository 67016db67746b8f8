#!/usr/bin/env bash
# Thirty-third session's reference runs: the 80 MT-bench first turns, 128 tokens, default (compiled) path and head,
# plain decoding the baseline, methods interleaved in one run. T = 1: EAGLE with the n-gram chain now riding beside
# the sampled drafts, and without it (eagle-nongram); T = 0: EAGLE. Run it on a quiet machine: it is timed.
#   bash docs/bench/issue9/s33/run.sh [OUT_DIR]
set -euo pipefail
O=${1:-docs/bench/issue9/s33}
mkdir -p $O
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle,eagle-nongram --max-new-tokens 128 \
  --temperature 1 --no-progress --json $O/mt80-T1.json --report $O/mt80-T1 > $O/mt80-T1.txt
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 \
  --temperature 0 --no-progress --json $O/mt80-T0.json --report $O/mt80-T0 > $O/mt80-T0.txt
.venv/bin/python docs/bench/issue9/summary.py $O/calibrate.json $O/mt80-T1.json $O/mt80-T0.json | tee $O/summary.txt

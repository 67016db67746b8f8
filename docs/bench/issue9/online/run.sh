#!/usr/bin/env bash
# The tree policy sized by the cost table corrected online (eagle-online) against the table alone (eagle; when these
# files were recorded online was the default: their "eagle" is eagle-online and "eagle-table" the table alone), at T = 0 and
# T = 1 (there also the separate catch-up with host-side rejection sampling), each an interleaved run on the 80
# MT-bench first turns, 128 tokens, plain decoding the baseline; default head, default (compiled) path. Run it
# on a quiet machine: it is timed. About 20 minutes here.
#   bash docs/bench/issue9/online/run.sh [OUT_DIR]
set -euo pipefail
O=${1:-docs/bench/issue9/online}
S=docs/bench/issue9/summary.py
mkdir -p $O
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle-online,eagle --max-new-tokens 128 \
  --temperature 0 --no-progress --json $O/mt80-T0.json --report $O/mt80-T0 > $O/mt80-T0.txt
.venv/bin/python $S $O/calibrate.json $O/mt80-T0.json | tee $O/summary.txt
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle-online,eagle,eagle-unfused \
  --max-new-tokens 128 --temperature 1 --no-progress --json $O/mt80-T1.json --report $O/mt80-T1 > $O/mt80-T1.txt
.venv/bin/python $S $O/calibrate.json $O/mt80-T1.json | tail -6 | tee -a $O/summary.txt

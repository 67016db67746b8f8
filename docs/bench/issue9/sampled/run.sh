#!/usr/bin/env bash
# Sampled drafts (T > 0) against top-k drafts, in one interleaved run on the 80 MT-bench first turns at T = 1
# (plain decoding the baseline; the issue's "20 questions at T = 1" are the run's first 20, read by
# docs/bench/issue10/v9/summary.py), then T = 0 again (vanilla vs eagle) to show greedy decoding did not
# slow down (its graphs gained the draw inputs). Default head, default (compiled) path. Run it on a quiet
# machine: it is timed. About 20 minutes here, the first compile included.
#   bash docs/bench/issue9/sampled/run.sh
set -euo pipefail
O=docs/bench/issue9/sampled
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle-sampled,eagle-topk --max-new-tokens 128 \
  --temperature 1 --json $O/mt80-T1.json --report $O/mt80-T1
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 \
  --temperature 0 --json $O/mt80-T0.json --report $O/mt80-T0
.venv/bin/python docs/bench/issue10/v9/summary.py $O/mt80-T1.json $O/mt80-T0.json | tee $O/summary.txt

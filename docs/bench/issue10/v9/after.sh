#!/usr/bin/env bash
# After v9.sh has finished (its last step and its held-out evaluation): v9 scored offline on the four texts of
# "Where the benchmark's gap comes from" (docs/training.md), then benchmarked live against v6 (the default head)
# and v8 in one interleaved run per setting, on the default (fastest) path. Run it on a quiet machine: the
# benchmarks are timed. About 25 minutes here.
#   bash docs/bench/issue10/v9/after.sh
set -euo pipefail
H=${H:-runs/v9/head-v9/head}
O=docs/bench/issue10/v9
[ -f $H/config.json ] || { echo "no finished v9 head at $H: run docs/bench/issue10/v9/v9.sh first" >&2; exit 1; }
# the texts a fresh checkout lacks (kept under the ignored runs/), then offline: held-out, first answers' first 128 tokens, MT-bench answers written at T = 0 and at T = 1
bash $O/texts.sh
bash $O/first-turn-pilot/eval.sh $H v9 | tee $O/eval-v9-texts.txt
cp runs/s24/first/ev/*-v9.json $O/
# a quiet cost table first (the benchmarks' tree policy reads it from the cache), kept with the results
.venv/bin/eaglespec calibrate --reps 31 --json > $O/calibrate.json
HEADS="v8=heads/smollm2-135m-instruct-v8,v9=$H"
for T in 0 1; do
  .venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --methods vanilla,eagle --max-new-tokens 128 --temperature $T \
    --heads $HEADS --json $O/mt80-T$T.json --report $O/mt80-T$T
done
.venv/bin/eaglespec bench --dataset mt_bench --max-turns 1 --limit 20 --methods vanilla,eagle --max-new-tokens 128 --temperature 1 \
  --heads $HEADS --json $O/mt20-T1.json --report $O/mt20-T1

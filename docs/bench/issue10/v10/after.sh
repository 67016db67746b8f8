#!/usr/bin/env bash
# After v10.sh: v10 scored offline beside v9 (eval.sh, the same texts), then benchmarked live against v9 (the
# default head) in one interleaved run per temperature on the default (fastest) path: all 80 MT-bench first turns,
# 128 new tokens. Run it on a quiet machine (the benchmarks are timed); about 25 minutes here.
#   bash docs/bench/issue10/v10/after.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
H=${H:-runs/v10/head-v10/head}
O=docs/bench/issue10/v10
[ -f $H/config.json ] || { echo "no finished v10 head at $H: run docs/bench/issue10/v10/v10.sh first" >&2; exit 1; }
bash docs/bench/issue10/v9/texts.sh
[ -f runs/s24/first/ev/self128-v9.json ] || bash $O/eval.sh heads/smollm2-135m-instruct-v9 v9 | tee $O/eval-v9.txt
bash $O/eval.sh $H v10 | tee $O/eval-v10.txt
mkdir -p $O/texts && cp runs/s24/first/ev/*-v9.json runs/s24/first/ev/*-v10.json $O/texts/
BASE=heads/smollm2-135m-instruct-v9 bash docs/bench/issue10/live.sh $H v10 $O

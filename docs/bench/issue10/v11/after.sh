#!/usr/bin/env bash
# After v11.sh: v11 scored offline on v10's six texts (docs/bench/issue10/v10/eval.sh; v9's and v10's scores on them are
# committed in docs/bench/issue10/v10/texts/) plus 40 held-out exchanges of the self-tasks store, for v9 and v11; then
# benchmarked live against v9 (the default head) in one interleaved run per temperature on the default (fastest)
# path: all 80 MT-bench first turns, 128 new tokens. Run it on a quiet machine (the benchmarks are timed).
#   bash docs/bench/issue10/v11/after.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
H=${H:-runs/v11/head-v11/head}
O=docs/bench/issue10/v11
D=runs/s24/first/ev
[ -f $H/config.json ] || { echo "no finished v11 head at $H: run docs/bench/issue10/v11/v11.sh first" >&2; exit 1; }
bash docs/bench/issue10/v9/texts.sh
bash docs/bench/issue10/v10/eval.sh $H v11 | tee $O/eval-v11.txt
bash docs/bench/issue10/tasks-eval.sh heads/smollm2-135m-instruct-v9 v9 $O
bash docs/bench/issue10/tasks-eval.sh $H v11 $O
mkdir -p $O/texts && cp $D/*-v11.json $D/tasks*-v9.json $O/texts/
[ -n "${OFFLINE_ONLY:-}" ] && exit 0
BASE=heads/smollm2-135m-instruct-v9 bash docs/bench/issue10/live.sh $H v11 $O

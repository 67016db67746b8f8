#!/usr/bin/env bash
# After v13.sh: v13 scored offline on v10's six texts and the self-tasks held-out exchanges (v9's and v11's scores on
# the same texts are committed in docs/bench/issue10/v11/; v11 is scored again on the tasks to check that the held-out
# exchanges are the same ones now that the store has grown), then benchmarked live against v11 (the default head) in
# one interleaved run per temperature on the default (fastest) path: all 80 MT-bench first turns, 128 new tokens. Run
# it on a quiet machine (the benchmarks are timed).
#   bash docs/bench/issue10/v13/after.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
H=${H:-runs/v13/head-v13/head}
O=docs/bench/issue10/v13
D=runs/s24/first/ev
[ -f $H/config.json ] || { echo "no finished v13 head at $H: run docs/bench/issue10/v13/v13.sh first" >&2; exit 1; }
bash docs/bench/issue10/v9/texts.sh
bash docs/bench/issue10/v10/eval.sh $H v13 | tee $O/eval-v13.txt
bash docs/bench/issue10/tasks-eval.sh heads/smollm2-135m-instruct v11 $O
bash docs/bench/issue10/tasks-eval.sh $H v13 $O
mkdir -p $O/texts && cp $D/*-v13.json $O/texts/
[ -n "${OFFLINE_ONLY:-}" ] && exit 0
bash docs/bench/issue10/live.sh $H v13 $O

#!/usr/bin/env bash
# After v12.sh: v12 (two layers) scored offline on v10's six texts and the self-tasks held-out exchanges (v9's and v11's
# scores on the same texts are committed in docs/bench/issue10/v11/), then benchmarked live against v9 (the default
# head) and v11 (the one-layer control, same data and recipe) in one interleaved run per temperature on the default
# (fastest) path: all 80 MT-bench first turns, 128 new tokens. Run it on a quiet machine (the benchmarks are timed).
#   bash docs/bench/issue10/v12/after.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
H=${H:-runs/v12/head-v12b/head}  # v12: the run with --grown-lr 5e-4 (v12.sh's GROWN_LR)
O=docs/bench/issue10/v12
D=runs/s24/first/ev
[ -f $H/config.json ] || { echo "no finished v12 head at $H: run docs/bench/issue10/v12/v12.sh first" >&2; exit 1; }
bash docs/bench/issue10/v9/texts.sh
bash docs/bench/issue10/v10/eval.sh $H v12 | tee $O/eval-v12.txt
bash docs/bench/issue10/tasks-eval.sh $H v12 $O
mkdir -p $O/texts && cp $D/*-v12.json $O/texts/
[ -n "${OFFLINE_ONLY:-}" ] && exit 0
BASE=heads/smollm2-135m-instruct-v9 EXTRA_HEADS="v11=heads/smollm2-135m-instruct" bash docs/bench/issue10/live.sh $H v12 $O

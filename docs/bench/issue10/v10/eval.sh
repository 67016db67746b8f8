#!/usr/bin/env bash
# Head H (name N) scored offline on the texts of docs/training.md's v9 table (docs/bench/issue10/v9/first-turn-pilot/eval.sh:
# held-out regenerated conversations, their first answers' first 128 tokens, the target's MT-bench answers at T = 0
# and T = 1; `bash docs/bench/issue10/v9/texts.sh` rebuilds those a checkout lacks) and on 40 held-out conversations
# of the target's self-written store (whole answers, and their first 128 tokens). Results: runs/s24/first/ev/*-N.json.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
H=$1; N=$2; D=runs/s24/first/ev
bash docs/bench/issue10/v9/first-turn-pilot/eval.sh $H $N
.venv/bin/eaglespec evaluate --head $H --data corpora/smollm2-135m-instruct/self --max-len 1024 --eval-conversations 40 --json $D/self-$N.json 2>&1 | grep "^held-out"
.venv/bin/eaglespec evaluate --head $H --data corpora/smollm2-135m-instruct/self --max-len 1024 --eval-conversations 40 --answer-tokens 128 --json $D/self128-$N.json 2>&1 | grep "^held-out"

#!/usr/bin/env bash
# Head H (name N) scored on the 40 held-out exchanges of the task-steered store (whole answers, then their first 128
# tokens); the held-out lines are appended to O/eval-tasks.txt, the JSON goes to runs/s24/first/ev/tasks{,128}-N.json.
# Shared by the v11-v13 after.sh scripts.   bash docs/bench/issue10/tasks-eval.sh H N O
set -euo pipefail
cd "$(dirname "$0")/../../.."
H=$1; N=$2; O=$3; D=runs/s24/first/ev
for A in "" "--answer-tokens 128"; do
  .venv/bin/eaglespec evaluate --head $H --data corpora/smollm2-135m-instruct/self-tasks --max-len 1024 \
    --eval-conversations 40 $A --json $D/tasks${A:+128}-$N.json 2>&1 | grep "^held-out" | sed "s/^/$N /" | tee -a $O/eval-tasks.txt
done

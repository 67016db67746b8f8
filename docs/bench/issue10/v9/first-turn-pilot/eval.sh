#!/bin/bash
# evaluate head H (name N) on: held-out (standard 40), first-turn first-128 held-out, MT-bench T0 and T1 text
cd "$(dirname "$0")/../../../../.."
H=$1; N=$2; D=runs/s24/first/ev
mkdir -p $D
.venv/bin/eaglespec evaluate --head $H --data corpora/smollm2-135m-instruct/regen --max-len 1024 --eval-conversations 40 --json $D/heldout-$N.json 2>&1 | grep "^held-out"
.venv/bin/eaglespec evaluate --head $H --data runs/s24/first/regen-first-turn.jsonl --max-len 1024 --eval-conversations 40 --answer-tokens 128 --json $D/first128-$N.json 2>&1 | grep "^held-out"
.venv/bin/eaglespec evaluate --head $H --data runs/s21/mt80-regen-T0 --max-len 1024 --held-out 0.999 --eval-conversations 80 --json $D/mtT0-$N.json 2>&1 | grep "^held-out"
.venv/bin/eaglespec evaluate --head $H --data runs/s21/mt80-regen-T1 --max-len 1024 --held-out 0.999 --eval-conversations 80 --json $D/mtT1-$N.json 2>&1 | grep "^held-out"

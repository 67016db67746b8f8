#!/usr/bin/env bash
# v8: head v6 trained for one epoch over the whole regenerated corpus (shards 0-227: 5,993 conversations,
# 10,728 records, 8.25 M tokens), features computed in the loop in bf16 (no feature store: a store of this
# size would not survive between sessions). Tests the eighteenth session's hypothesis: fine-tuning only on
# each new slice forgets the old ones; one pass over all of it might not.
# Resumable: rerun this script unchanged after a kill or at the next session (the data file is rebuilt
# byte-identically from the committed shards; the checkpoint lives in OUT).
set -euo pipefail
OUT=${OUT:-runs/s20/head-v8}
mkdir -p runs/s20
DATA=runs/s20/regen-0-227.jsonl.gz
[ -f $DATA ] || for i in $(seq -f %05g 0 227); do cat corpora/smollm2-135m-instruct/regen/shard-$i.jsonl.gz; done > $DATA
# a new checkout: continue from the checkpoint committed at the end of the last session that ran this (the run
# finished in the twenty-first session and that folder is gone, so a new checkout now trains from the start)
KEPT=checkpoints/head-v8-s20
if [ ! -d $OUT/checkpoint ] && [ -d $KEPT/checkpoint ]; then mkdir -p $OUT && cp -r $KEPT/. $OUT/; fi
RESUME=$([ -d $OUT/checkpoint ] && echo --resume || true)
.venv/bin/eaglespec train --data $DATA --max-len 1024 --init-head heads/smollm2-135m-instruct-v6 --out $OUT \
  --epochs 1 --batch-tokens 4096 --lr 2e-4 --warmup-steps 20 --save-every 50 --eval-conversations 40 \
  --autocast bf16 $RESUME
# the standard held-out yardstick (the same 23,167 positions as every head since v3)
.venv/bin/eaglespec evaluate --head $OUT/head --data corpora/smollm2-135m-instruct/regen --max-len 1024 \
  --eval-conversations 40 --json docs/bench/issue10/v8-s20/eval-v8.json

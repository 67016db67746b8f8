#!/bin/bash
# issue 10: v7 = v6 fine-tuned 2 epochs on the regenerated shards it has not seen (156-195)
set -e
cd /work/main
E=.venv/bin/eaglespec
R=corpora/smollm2-135m-instruct/regen
[ -e runs/s18/regen-156-195.jsonl.gz ] || cat $R/shard-00{156..195}.jsonl.gz > runs/s18/regen-156-195.jsonl.gz
echo "== features $(date -u +%T)"
/usr/bin/time -v $E features --data runs/s18/regen-156-195.jsonl.gz --max-len 1024 --autocast bf16 --out runs/s18/feats-new --shard-size 50 2> runs/s18/v7-feats.time
echo "== train $(date -u +%T)"
/usr/bin/time -v $E train --features-dir runs/s18/feats-new --init-head heads/smollm2-135m-instruct-v6 --out runs/s18/head-v7 \
  --epochs 2 --batch-tokens 4096 --lr 2e-4 --warmup-steps 20 --save-every 50 --eval-conversations 40 --autocast bf16 2> runs/s18/v7-train.time
echo "== evaluate $(date -u +%T)"
$E evaluate --head runs/s18/head-v7/head --data $R --max-len 1024 --eval-conversations 40 --json runs/s18/eval-v7.json
$E evaluate --head heads/smollm2-135m-instruct-v6 --features-dir runs/s18/feats-new --eval-conversations 40 --json runs/s18/eval-v6-new.json
$E evaluate --head runs/s18/head-v7/head --features-dir runs/s18/feats-new --eval-conversations 40 --json runs/s18/eval-v7-new.json
echo "== done $(date -u +%T)"

#!/bin/bash
# the EAGLE-1 arm on the same store and schedule, two seeds (the held-out split fixed at seed 0)
cd /work/main
E=.venv/bin/eaglespec
R=corpora/smollm2-135m-instruct/regen
common="--max-conversations 500 --epochs 1 --batch-tokens 4096 --lr 6e-4 --warmup-steps 12 --save-every 50 --eval-conversations 8 --autocast bf16 --draft-vocab 8192"
for S in 0 1; do
  echo "== E1 seed $S $(date -u +%T)"
  /usr/bin/time -v $E train --features-dir runs/s19/feats3-500 --seed $S --split-seed 0 --out runs/s19/e1-s$S $common 2> runs/s19/e1-s$S.time | grep -v "^step"
  echo "== evaluate E1 seed $S $(date -u +%T)"
  $E evaluate --head runs/s19/e1-s$S/head --data $R --max-len 1024 --eval-conversations 40 --ttt-steps 4 --json runs/s19/eval-e1-s$S.json
done
echo "== done $(date -u +%T)"

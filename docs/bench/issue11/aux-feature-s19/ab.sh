#!/bin/bash
# issue 11: an auxiliary feature-regression term for EAGLE-3 (--eagle3-feature-weight W), from scratch on the
# first 500 regenerated conversations, one epoch, the eighteenth session's schedule (docs/bench/issue11/layers-ab-s18).
# Run as `ab.sh 10 1 0` (seed 0: its folders were named e3-w10, e3-w1, e3-w0, before the seed joined the name
# and --split-seed existed; with seed 0 the split is the same), then `SEED=1 ab.sh 0 1`.
cd /work/main
E=.venv/bin/eaglespec
R=corpora/smollm2-135m-instruct/regen
common="--max-conversations 500 --epochs 1 --batch-tokens 4096 --lr 6e-4 --warmup-steps 12 --save-every 50 --eval-conversations 8 --autocast bf16 --draft-vocab 8192"
S=${SEED:-0}
for w in "$@"; do
  echo "== E3 W=$w seed $S $(date -u +%T)"
  /usr/bin/time -v $E train --features-dir runs/s19/feats3-500 --arch eagle3 --ttt-steps 4 --eagle3-feature-weight $w \
      --seed $S --split-seed 0 --out runs/s19/e3-w$w-s$S $common 2> runs/s19/e3-w$w-s$S.time | grep -v "^step"
  echo "== evaluate W=$w $(date -u +%T)"
  $E evaluate --head runs/s19/e3-w$w-s$S/head --data $R --max-len 1024 --eval-conversations 40 --ttt-steps 4 --json runs/s19/eval-e3-w$w-s$S.json
done
echo "== done $(date -u +%T)"

#!/bin/bash
# issue 11: which target layers an EAGLE-3 head fuses. Same 500 regenerated conversations, same schedule, from scratch.
set -e
cd /work/main
E=.venv/bin/eaglespec
R=corpora/smollm2-135m-instruct/regen
common="--max-conversations 500 --epochs 1 --batch-tokens 4096 --lr 6e-4 --warmup-steps 12 --save-every 50 --eval-conversations 8 --autocast bf16 --draft-vocab 8192"
echo "== features 2,15,29 $(date -u +%T)"
/usr/bin/time -v $E features --data $R --max-conversations 500 --max-len 1024 --arch eagle3 --aux-layers 2,15,29 --autocast bf16 \
   --out runs/s18/feats3-l29-500 --shard-size 50 2> runs/s18/feats-l29.time
echo "== E3 official 2,15,27 $(date -u +%T)"
/usr/bin/time -v $E train --features-dir runs/s14/feats3-1000 --arch eagle3 --ttt-steps 4 --out runs/s18/e3-l27 $common 2> runs/s18/e3-l27.time
echo "== E3 2,15,29 $(date -u +%T)"
/usr/bin/time -v $E train --features-dir runs/s18/feats3-l29-500 --arch eagle3 --ttt-steps 4 --out runs/s18/e3-l29 $common 2> runs/s18/e3-l29.time
echo "== E1 $(date -u +%T)"
/usr/bin/time -v $E train --features-dir runs/s18/feats3-l29-500 --out runs/s18/e1 $common 2> runs/s18/e1.time
for h in e3-l27 e3-l29 e1; do
  echo "== evaluate $h $(date -u +%T)"
  $E evaluate --head runs/s18/$h/head --data $R --max-len 1024 --eval-conversations 40 --ttt-steps 4 --json runs/s18/eval-$h.json
done
echo "== done $(date -u +%T)"

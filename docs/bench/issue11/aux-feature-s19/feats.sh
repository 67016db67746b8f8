#!/bin/bash
cd /work/main
E=.venv/bin/eaglespec
R=corpora/smollm2-135m-instruct/regen
echo "== features 2,15,27 $(date -u +%T)"
/usr/bin/time -v $E features --data $R --max-conversations 500 --max-len 1024 --arch eagle3 --autocast bf16 \
   --out runs/s19/feats3-500 --shard-size 50 2> runs/s19/feats.time
echo "== done $(date -u +%T)"

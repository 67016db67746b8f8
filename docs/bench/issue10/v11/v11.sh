#!/usr/bin/env bash
# v11: the shipped head (v9) fine-tuned for one epoch on exchanges the target wrote itself with *forced openings*
# (`eaglespec regenerate --data self --openings tasks`: each question starts "Write a", "Extract", "Solve", ...), the
# next experiment after v10 (docs/training.md, "v10"): v10's generic self-written questions taught the head their own
# kind of text and not the benchmark's. Everything else as v10.sh (lr 1e-4, v9's draft vocabulary, bf16 features in
# the loop where the CPU has bf16), so v10 is the control for "which questions". The first S shards of the store are
# fixed into one data file, so a rerun trains on exactly the same records. Resumable: rerun unchanged.
#   eaglespec regenerate --data self --openings tasks --seed 1 --out corpora/smollm2-135m-instruct/self-tasks \
#     --max-conversations 4000 --mix "0:0.5,0.7:0.5" --max-new-tokens 512 --max-len 1024 --batch-size 32
#   S=80 bash docs/bench/issue10/v11/v11.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
S=${S:?set S, the number of shards of the self-tasks store to train on}
OUT=${OUT:-runs/v11/head-v11}
STORE=corpora/smollm2-135m-instruct/self-tasks
mkdir -p runs/v11
DATA=runs/v11/self-tasks-$S.jsonl.gz
if [ ! -f $DATA ]; then
  for i in $(seq 0 $((S - 1))); do f=$STORE/shard-$(printf %05d $i).jsonl.gz; [ -f $f ] || { echo "no $f" >&2; exit 1; }; cat $f; done > $DATA.tmp
  mv $DATA.tmp $DATA
fi
AUTOCAST=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo off)
RESUME=$([ -d $OUT/checkpoint ] && echo --resume || true)
.venv/bin/eaglespec train --data $DATA --max-len 1024 --init-head heads/smollm2-135m-instruct --out $OUT \
  --epochs 1 --batch-tokens 4096 --lr ${LR:-1e-4} --warmup-steps 20 --save-every 50 --eval-conversations 40 \
  --autocast $AUTOCAST $RESUME

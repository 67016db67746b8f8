#!/usr/bin/env bash
# v10: the shipped head (v9) fine-tuned for one epoch on questions and answers the target wrote itself
# (`eaglespec regenerate --data self`, docs/training.md "Prompts the target writes itself"): first exchanges, as in
# the benchmarks, on text that is entirely the target's. The first S shards of the growing store are fixed into one
# data file, so a rerun (after a kill, or at the next session) trains on exactly the same records. The reading skips
# repeated written questions and any that is a benchmark's (data.QuestionGuard). v9's draft vocabulary is kept.
# A lower learning rate than v9's 2e-4: a short fine-tune at 2e-4 first moves a head off its optimum (the
# twenty-fourth session's first-turn pilot), and this one is a few hundred steps.
# Resumable: rerun unchanged; the checkpoint lives in OUT.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
S=${S:?set S, the number of self-written shards to train on}
# STORE, RUN and TAG let a later fine-tune on another store reuse this recipe unchanged (v11.sh); EXTRA adds
# train options (v12.sh: --head-layers 2); FROM skips the store's first shards and INIT names the head to start from
# (v13.sh: v11 on the shards it never saw).
STORE=${STORE:-corpora/smollm2-135m-instruct/self}
RUN=${RUN:-runs/v10}
OUT=${OUT:-$RUN/head-v10}
mkdir -p $RUN
FROM=${FROM:-0}
DATA=$RUN/${TAG:-self}-$([ $FROM = 0 ] || echo $FROM-)$S.jsonl.gz
if [ ! -f $DATA ]; then
  for i in $(seq $FROM $((S - 1))); do f=$STORE/shard-$(printf %05d $i).jsonl.gz; [ -f $f ] || { echo "no $f" >&2; exit 1; }; cat $f; done > $DATA.tmp
  mv $DATA.tmp $DATA
fi
AUTOCAST=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo off)
RESUME=$([ -d $OUT/checkpoint ] && echo --resume || true)
.venv/bin/eaglespec train --data $DATA --max-len 1024 --init-head ${INIT:-heads/smollm2-135m-instruct-v9} --out $OUT \
  --epochs 1 --batch-tokens 4096 --lr ${LR:-1e-4} --warmup-steps 20 --save-every 50 --eval-conversations 40 \
  --autocast $AUTOCAST ${EXTRA:-} $RESUME

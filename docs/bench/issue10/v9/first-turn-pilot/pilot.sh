#!/bin/bash
# pilot: v8 fine-tuned on first turns only (the benchmark's condition), v9's schedule, stopped at step 150
cd /work/main
.venv/bin/eaglespec train --data runs/s24/first/regen-first-turn.jsonl --max-len 1024 --init-head heads/smollm2-135m-instruct-v8 \
  --draft-vocab 8192 --out runs/s24/first/head-first --epochs 1 --batch-tokens 4096 --lr 2e-4 --warmup-steps 20 \
  --save-every 50 --eval-conversations 40 --autocast bf16 "$@"

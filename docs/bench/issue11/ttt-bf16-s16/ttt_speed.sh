#!/bin/bash
# EAGLE-3 training step time before and after the step's CE and the target's argmax went bf16 under --autocast bf16,
# interleaved old/new twice, 6 steps each from heads/smollm2-135m-instruct-eagle3 on the 1,000-conversation store.
# Set up the old code first: git worktree add /tmp/old_es d2cd846. Stop other jobs while it runs.
cd "$(dirname "$0")/../../../.."
D=docs/bench/issue11/ttt-bf16-s16
for rep in 1 2; do for v in old new; do
  src=$PWD; [ $v = old ] && src=/tmp/old_es
  rm -rf runs/ts-$v-$rep
  timeout 400 .venv/bin/python $D/run_from.py $src train --features-dir runs/s14/feats3-1000 --arch eagle3 --ttt-steps 4 \
    --init-head heads/smollm2-135m-instruct-eagle3 --out runs/ts-$v-$rep --epochs 1 --max-steps 6 --batch-tokens 4096 --lr 1e-4 \
    --warmup-steps 1 --eval-conversations 1 --autocast bf16 --seed 3 > runs/ts-$v-$rep.log 2>&1
  echo $v $rep rc=$?
  cp runs/ts-$v-$rep/train_log.jsonl $D/train_log-$v-$rep.jsonl
done; done
.venv/bin/python - <<'P'
import json
for v in ("old", "new"):
    for rep in (1, 2):
        L = [json.loads(l) for l in open(f"docs/bench/issue11/ttt-bf16-s16/train_log-{v}-{rep}.jsonl")]
        dt = [b["time"] - a["time"] for a, b in zip(L, L[1:])]
        print(v, rep, "s/step, steps 2-6:", [round(x, 2) for x in dt], "sum", round(sum(dt), 1),
              "loss", [round(r["loss"], 4) for r in L])
P

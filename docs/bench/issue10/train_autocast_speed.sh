# Training speed with and without `--autocast bf16`, interleaved: fp32, bf16, fp32, bf16 (stop other jobs first).
# The small store (80 conversations in 121 records, 97,146 tokens) was made with:
#   eaglespec features --data corpora/smollm2-135m-instruct/regen --max-conversations 80 --max-len 1024 --eager \
#       --autocast bf16 --out runs/fstore
set -e
cd "$(dirname "$0")/../../.."
for rep in 1 2; do for mode in off bf16; do
  rm -rf runs/ts-$mode-$rep
  .venv/bin/eaglespec train --features-dir runs/fstore --init-head heads/smollm2-135m-instruct-v6 --out runs/ts-$mode-$rep \
    --epochs 1 --max-steps 14 --batch-tokens 4096 --lr 2e-4 --warmup-steps 2 --eval-conversations 2 --autocast $mode > runs/ts-$mode-$rep.log 2>&1
done; done
.venv/bin/python - <<'P'
import json
for mode in ("off","bf16"):
    for rep in (1,2):
        L=[json.loads(l) for l in open(f"runs/ts-{mode}-{rep}/train_log.jsonl")]
        a,b=L[3],L[-1]
        toks=sum(r["tokens"] for r in L[4:])
        print(mode,rep,len(L),"steps; steps 5..:",round(toks/(b["time"]-a["time"])),"tok/s; loss last",round(b["loss"],4), "top1", round(b["top1"] or 0,3))
P

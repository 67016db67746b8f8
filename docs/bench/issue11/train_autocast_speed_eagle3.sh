# EAGLE-3 training speed with and without `--autocast bf16`, interleaved (stop other jobs first). The store:
#   eaglespec features --data corpora/smollm2-135m-instruct/regen --max-conversations 24 --max-len 1024 --arch eagle3 \
#       --autocast bf16 --eager --out runs/fstore3 --shard-size 64
cd "$(dirname "$0")/../../.."
for rep in 1 2; do for mode in off bf16; do
  rm -rf runs/ts3-$mode-$rep
  timeout 300 .venv/bin/eaglespec train --features-dir runs/fstore3 --arch eagle3 --init-head heads/smollm2-135m-instruct-eagle3 --out runs/ts3-$mode-$rep \
    --epochs 1 --max-steps 5 --batch-tokens 4096 --lr 1e-4 --warmup-steps 1 --eval-conversations 1 --autocast $mode > runs/ts3-$mode-$rep.log 2>&1
  echo $mode $rep rc=$?
done; done
.venv/bin/python - <<'P'
import json
for mode in ("off","bf16"):
    for rep in (1,2):
        try: L=[json.loads(l) for l in open(f"runs/ts3-{mode}-{rep}/train_log.jsonl")]
        except Exception as e: print(mode,rep,e); continue
        dt=[b["time"]-a["time"] for a,b in zip(L,L[1:])]
        print(mode,rep,len(L),"steps; s/step after the first:",[round(x,1) for x in dt], "loss", [round(r["loss"],4) for r in L])
P

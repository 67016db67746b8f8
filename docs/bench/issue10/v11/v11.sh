#!/usr/bin/env bash
# v11: the shipped head (v9) fine-tuned for one epoch on exchanges the target wrote itself with *forced openings*
# (`eaglespec regenerate --data self --openings tasks`: each question starts "Write a", "Extract", "Solve", ...), the
# next experiment after v10 (docs/training.md, "v10"): v10's generic self-written questions taught the head their own
# kind of text and not the benchmark's. The recipe is v10.sh's, on the other store, so v10 is the control for "which
# questions". Resumable: rerun unchanged.
#   eaglespec regenerate --data self --openings tasks --seed 1 --out corpora/smollm2-135m-instruct/self-tasks \
#     --max-conversations 4000 --mix "0:0.5,0.7:0.5" --max-new-tokens 512 --max-len 1024 --batch-size 32
#   S=80 bash docs/bench/issue10/v11/v11.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
STORE=corpora/smollm2-135m-instruct/self-tasks RUN=runs/v11 TAG=self-tasks OUT=${OUT:-runs/v11/head-v11} \
  exec bash docs/bench/issue10/v10/v10.sh

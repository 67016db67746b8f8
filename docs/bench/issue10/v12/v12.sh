#!/usr/bin/env bash
# v12: a head of two layers. The shipped head (v9, one layer) grown to two (`train --head-layers 2`: the second layer
# starts as the identity, so training starts from what v9 drafts) and fine-tuned by v11's recipe on v11's data (one
# epoch on the 4,000 task-steered self-written exchanges, lr 1e-4): v11 is the control, so the difference is the
# second layer. Why: v9's training top-1 (0.71 over its last pass) equals its held-out top-1 (0.710): the one-layer
# head underfits, it does not overfit, so capacity may be what it lacks. Resumable: rerun unchanged.
# The first run (2026-12-07) left the new layer at v11's lr 1e-4, where it barely moved from the identity (its output
# projections' RMS 0.001 against layer 0's 0.03); v12b gives the new layer its own peak lr (--grown-lr 5e-4) and keeps
# 1e-4 for the rest, so the layers v11 trained are trained as v11 trained them.
#   S=80 bash docs/bench/issue10/v12/v12.sh                                              # v12: one lr
#   S=80 GROWN_LR=5e-4 OUT=runs/v12/head-v12b bash docs/bench/issue10/v12/v12.sh          # v12b
set -euo pipefail
cd "$(dirname "$0")/../../../.."
STORE=corpora/smollm2-135m-instruct/self-tasks RUN=runs/v12 TAG=self-tasks OUT=${OUT:-runs/v12/head-v12} \
  EXTRA="--head-layers 2${GROWN_LR:+ --grown-lr $GROWN_LR}" exec bash docs/bench/issue10/v10/v10.sh

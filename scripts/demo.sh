#!/usr/bin/env bash
# The main job on the default model: one prompt with plain decoding and with EAGLE, streamed,
# then tokens/s of each, the speed-up and tau.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/eaglespec generate --compare "${@:-Explain in a few sentences why the sky is blue.}"

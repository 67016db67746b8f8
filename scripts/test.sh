#!/usr/bin/env bash
# Set up and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers, whole files to each (-n 2 --dist loadfile): every test process already runs torch on one thread
# (tests/conftest.py), so the two cores are both used. On an AVX2-only machine the suite took 19.9 min in one
# process, at CI's 20-minute limit; set EAGLESPEC_TEST_WORKERS=0 for one process (e.g. to debug with -s).
W=${EAGLESPEC_TEST_WORKERS:-2}
XDIST=$([ "$W" = 0 ] || echo "-n $W --dist loadfile")
exec .venv/bin/python -m pytest -q -x --durations=15 $XDIST "$@"

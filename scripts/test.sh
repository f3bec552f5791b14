#!/usr/bin/env bash
# Set up the environment and the system tools (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$ROOT/scripts/system-deps.sh"        # sshd, pdsh, mpirun for tests/cli/test_launchers.py
cd "$ROOT"
# Two pytest-xdist workers, a test module each at a time (tests/conftest.py: the longest first):
# one's launcher imports, timeouts and single-process tests fill the other's idle core. `-n 0` for one process.
exec python -m pytest -n "${VDP_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"   # the 25 slowest: where the time goes

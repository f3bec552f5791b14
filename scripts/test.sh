#!/usr/bin/env bash
# Set up the environment and the system tools (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$ROOT/scripts/system-deps.sh"        # sshd, pdsh, mpirun for tests/cli/test_launchers.py
cd "$ROOT"
exec python -m pytest --durations=25 "$@"        # the 25 slowest: where the suite's time goes

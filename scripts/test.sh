#!/usr/bin/env bash
# Set up the environment and the system tools (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
source "$ROOT/scripts/system-deps.sh"        # sshd, pdsh, mpirun for tests/cli/test_launchers.py
cd "$ROOT"
# Two pytest-xdist workers, a test module each at a time (tests/conftest.py: the longest first):
# one's launcher imports, timeouts and single-process tests fill the other's idle core. `-n 0` for one process.
# One intra-op thread per process: the workers, the ranks they start and the commands fill the cores already, and
# OpenMP's threads spinning beside them on 2 cores cost CPU (the unit tier: 268 -> 159 CPU-s, 139 -> 83 s wall)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -n "${VDP_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"   # the 25 slowest: where the time goes

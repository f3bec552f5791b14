#!/usr/bin/env bash
# Set up the environment (first run only) and run the whole test suite.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest "$@"

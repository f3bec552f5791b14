#!/usr/bin/env bash
# Set up the environment (first run only) and write bench/report.md with its plots (about 5 minutes).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m bench "$@"

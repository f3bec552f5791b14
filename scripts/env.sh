#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install the pinned dependencies.
# Sourced by scripts/demo.sh and scripts/test.sh; prints nothing when the environment is current.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VDP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
# DeepSpeed JIT-builds its CPU communication op into this folder. One per environment: a shared one
# is rebuilt by every environment in turn (its build commands name the environment's paths), and a build
# killed half-way leaves a lock there that makes every later run wait forever (remove the folder to recover).
# A folder another checkout's env.sh exported (a shell or a test that sourced it first) is not inherited;
# one you set yourself is kept.
if [ -z "${TORCH_EXTENSIONS_DIR:-}" ] || [ "$TORCH_EXTENSIONS_DIR" = "${VDP_ENV_EXTENSIONS:-}" ]; then
  export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" VDP_ENV_EXTENSIONS="$VENV/torch_extensions"
fi
STAMP="$VENV/.installed-$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/env.sh" | sha1sum | cut -c1-12)"
if [ ! -f "$STAMP" ]; then
  echo "[env] setting up $VENV (one time)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # torch first, pinned: 2.13.0 is the CPU build on this machine class; an unpinned torch pulls a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,data]" >&2
  # DeepSpeed's CPU all-reduce op, JIT-built now rather than by the first job's ranks (parallel/distributed/deepspeed/shm.py),
  # with the environment's own ninja, as the ranks will find it (another one's build is redone by theirs)
  PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT" "$VENV/bin/python" -m parallel.distributed.deepspeed.shm >&2
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

#!/usr/bin/env bash
# The user's path on one GPU at release token counts: train with checkpoints, resume, sample, export to
# diffusers and verify it, ring attention's flash kernels, the plan's device peak and each step's MFU; one table,
# also written into bench/report.md's "GPU check" section (bench/gpu_check.py says what each row is).
#
#   bash scripts/gpu-check.sh                 # on the GPU machine (--budget 540 s by default; never timed on one)
#   bash scripts/gpu-check.sh --tiny          # the same commands on the debug presets (CPU works)
#   bash scripts/gpu-check.sh --pack          # here: bench/out/carry.tar.gz, what a bare device image lacks
#   bash scripts/gpu-check.sh --capped        # Wan 14B LoRA capped at 24 GiB vs its plan and uncapped
#                                             # (bench/capped.py, about 5 minutes; --capped --tiny on CPU)
#   bash scripts/gpu-check.sh --speed         # issue 42: train.py's 5B step by phase, its blocks against diffusers',
#                                             # compiled blocks (bench/gpu_speed.py, --budget 540 s; --speed --tiny on CPU)
#   bash scripts/gpu-check.sh --write-report gpu-check.md   # here: a device run's table into bench/report.md
#                                             # (--capped --write-report capped.md, --speed --write-report gpu-speed.md)
#
# Python: the project's .venv where it exists (scripts/env.sh), else the machine's python3 with
# bench/out/carry/ (unpacked from --pack's carry.tar.gz: DeepSpeed, diffusers, peft, torchao and their pure-Python
# dependencies, and pydantic_core built for the device's Python) on its path.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$ROOT/bench/out/carry"
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0
fi
if [ "${1:-}" = "--pack" ]; then
  source "$ROOT/scripts/env.sh"
  SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$CARRY"; mkdir -p "$CARRY"
  for pkg in deepspeed diffusers peft torchao hjson pydantic annotated_types typing_inspection msgpack ninja cpuinfo; do
    [ -e "$SITE/$pkg" ] && cp -r "$SITE/$pkg" "$CARRY/"
  done
  cp "$SITE"/typing_extensions.py "$CARRY/" 2>/dev/null || true
  find "$CARRY" -name __pycache__ -prune -exec rm -rf {} +
  # pydantic_core is compiled: the wheel of the same version for the device's Python (DEVICE_PY, default 3.12)
  version="$(python -c 'import pydantic_core; print(pydantic_core.__version__)')"
  python -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PY:-3.12}" \
    --platform manylinux2014_x86_64 "pydantic_core==$version" -d "$CARRY/wheels"
  (cd "$CARRY/wheels" && for w in *.whl; do python -m zipfile -e "$w" "$CARRY"; done)
  rm -rf "$CARRY/wheels"
  tar czf "$CARRY.tar.gz" -C "$ROOT/bench/out" carry
  echo "bench/out/carry.tar.gz: $(du -sh "$CARRY.tar.gz" | cut -f1) (carry it with the tree; the script unpacks it)"
  exit 0
fi
if [ -d "$ROOT/.venv" ] || ! python3 -c "import torch" 2>/dev/null; then
  source "$ROOT/scripts/env.sh"
  PY=python
else                                  # the machine's python3, the one that has torch (a bare device image)
  [ -d "$CARRY" ] || [ ! -f "$CARRY.tar.gz" ] || tar xzf "$CARRY.tar.gz" -C "$ROOT/bench/out"
  export PYTHONPATH="$ROOT:$CARRY${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
fi
# CUDA's device count through NVML, not a CUDA context: bench/ranks.py forks ranks from a server, and a process
# with a CUDA context cannot fork one that uses CUDA (DeepSpeed sets it too, but only once it is imported)
export PYTORCH_NVML_BASED_CUDA_CHECK=1
cd "$ROOT"
if [ "${1:-}" = "--capped" ]; then
  shift
  exec "$PY" -m bench.capped "$@"
fi
if [ "${1:-}" = "--speed" ]; then
  shift
  exec "$PY" -m bench.gpu_speed "$@"
fi
exec "$PY" -m bench.gpu_check "$@"

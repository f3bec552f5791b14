#!/usr/bin/env bash
# Set up the environment (first run only) and run the main job: the `debug` DiT trained with
# tensor parallelism 2 x pipeline parallelism 2 x data parallelism 2 (ZeRO-1, bf16, activation
# checkpointing) as 8 processes. On a machine without GPUs they run on the CPU over gloo.
# CONFIG=configs/debug-stdit.yaml bash scripts/demo.sh trains the STDiT3-style model instead;
# MASTER_PORT=29600 bash scripts/demo.sh rendezvouses there when another job holds the default 29500.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
OUT="${OUT:-runs/demo-$(date +%Y%m%d-%H%M%S)}"
CONFIG="${CONFIG:-configs/debug.yaml}"
CMD=(deepspeed --num_gpus 8 --master_port "${MASTER_PORT:-29500}" train.py --config "$CONFIG" --deepspeed-config ds_configs/zero1_bf16.json
     --set parallel.tp_size=2 --set parallel.pp_size=2 --set "train.output_dir=$OUT" "$@")
echo "+ ${CMD[*]}"
# DeepSpeed's INFO/WARNING log lines and its FutureWarnings are filtered; errors and our output pass.
"${CMD[@]}" 2>&1 | grep --line-buffered -vE '^\[[0-9-]+ [0-9:,]+\] \[(INFO|WARNING)\]|^\s*$|FutureWarning|^\s+return func\(' || true
test "${PIPESTATUS[0]}" -eq 0
echo "per-step metrics: $OUT/metrics.jsonl"

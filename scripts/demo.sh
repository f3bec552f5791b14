#!/usr/bin/env bash
# Set up the environment (first run only) and run the main job.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
echo "+ python -m parallel.check --config configs/cogvideox-2b.yaml --deepspeed_config ds_configs/zero1_bf16.json --world-size 8 --set parallel.tp_size=2"
python -m parallel.check --config configs/cogvideox-2b.yaml --deepspeed_config ds_configs/zero1_bf16.json --world-size 8 --set parallel.tp_size=2
echo "+ python -m parallel.check --config configs/cogvideox-2b.yaml --set parallel.tp_size=4   (refused, as it must be)"
python -m parallel.check --config configs/cogvideox-2b.yaml --set parallel.tp_size=4 || true

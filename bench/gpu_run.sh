#!/usr/bin/env bash
# bench.gpu_encoder on the device machine, from the project's root, with the
# wheels its image lacks carried in .whl (docs/measurements/gpu-encoder.md says which):
#   bash bench/gpu_run.sh [bench.gpu_encoder arguments]
#   bash bench/gpu_run.sh -m bench.tower_load [its arguments]   (another module, the same environment)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
module=bench.gpu_encoder
if [ "${1:-}" = "-m" ]; then module=$2; shift 2; fi
# the console (the call's output_tail) without Python's and torch's warning lines and dynamo's
# recompile reasons (torch's V lines, which would fill it); log.txt keeps all
python3 -m "$module" "$@" 2>&1 | tee -a "${OUT:-/tmp}/log.txt" | grep --line-buffered -v -E '^[^ ]*Warning: |^[WV][0-9]{4} '

#!/usr/bin/env bash
# bench.gpu_encoder on the device machine, from the project's root, with the
# wheels its image lacks carried in .whl (docs/gpu.md says which):
#   bash bench/gpu_run.sh [bench.gpu_encoder arguments]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
python3 -m bench.gpu_encoder "$@" 2>&1 | tee "${OUT:-/tmp}/log.txt" | grep -v -i warn

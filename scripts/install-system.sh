#!/usr/bin/env bash
# Debian packages the tests use beside the Python environment: a real
# Prometheus server (and promtool), headless Chromium, a Redis server (the
# encoders' shared cache tier) and docker-compose (to validate the compose
# files; no container engine runs). Installed when missing and we may (root or
# sudo); otherwise the tests that need them say so.
set -euo pipefail

packages=()
command -v prometheus >/dev/null || packages+=(prometheus)
command -v chromium >/dev/null || packages+=(chromium)
command -v redis-server >/dev/null || packages+=(redis-server)
command -v docker-compose >/dev/null || packages+=(docker-compose)
[ ${#packages[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "warning: cannot install ${packages[*]} (not root); tests that need them will be skipped" >&2
  exit 0
fi
echo "installing Debian packages: ${packages[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null

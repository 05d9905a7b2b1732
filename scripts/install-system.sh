#!/usr/bin/env bash
# Debian packages the tests use beside the Python environment: a real
# Prometheus server (and promtool), headless Chromium, a Redis server (the
# encoders' shared cache tier) and docker-compose (to validate the compose
# files); the Kubernetes tests need a kubectl of 1.27 or newer (Debian's
# kubernetes-client is older: its kustomize reads no `components`). With `containers`
# (make test-containers): a container engine, debootstrap for a base image
# made from Debian's packages, and tcpdump to see where the containers send
# packets. Installed when missing and we may (root or
# sudo); otherwise the tests that need them say so.
set -euo pipefail

packages=()
need() { command -v "$1" >/dev/null || packages+=("$2"); }
if [ "${1:-}" = containers ]; then
  need dockerd docker.io; need docker-compose docker-compose; need debootstrap debootstrap; need tcpdump tcpdump
else
  need prometheus prometheus; need chromium chromium; need redis-server redis-server; need docker-compose docker-compose
fi
[ ${#packages[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
  echo "warning: cannot install ${packages[*]} (not root); tests that need them will be skipped" >&2
  exit 0
fi
echo "installing Debian packages: ${packages[*]}"
$sudo apt-get update -qq
install() { DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; }
# One the distribution does not have (Ubuntu has no `chromium` package, only a snap): said, and
# the tests that need it say so too, instead of the whole run stopping here.
install "${packages[@]}" || for package in "${packages[@]}"; do
  install "$package" || echo "warning: could not install $package; tests that need it will be skipped" >&2
done

#!/usr/bin/env bash
# A Debian bookworm base image made from Debian's packages, for a machine that
# reaches no image registry: docker/Dockerfile's BASE_IMAGE there. Needs root,
# debootstrap and a running dockerd; about 30 s.
#   scripts/debian-base-image.sh [NAME]     (default prism-base:bookworm)
set -euo pipefail
name=${1:-prism-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

debootstrap --variant=minbase --include=ca-certificates bookworm "$dir" "$mirror" >/dev/null
# The suites the registry's debian:bookworm-slim lists, security updates included.
rm -f "$dir/etc/apt/sources.list"
cat >"$dir/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${mirror%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
# The host's own certificate authorities (a TLS-inspecting proxy's, on networks
# that have one), so builds on this base reach the package index as the host does.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$dir/usr/local/share/ca-certificates/"
  chroot "$dir" update-ca-certificates >/dev/null 2>&1
fi
rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/var/log/*
tar -C "$dir" -c . | docker import --change 'CMD ["bash"]' - "$name" >/dev/null
echo "$name"

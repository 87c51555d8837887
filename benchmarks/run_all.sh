#!/usr/bin/env bash
# The one documented benchmark command: the default suite of benchmarks/bench_loss.py (speed,
# measured memory peaks, scaling) writing benchmarks/results/{bench_loss.json,bench_loss.csv,
# bench_loss.png,README_table.md}. Under 10 minutes on a quiet 2-core CPU machine.
#   benchmarks/run_all.sh                  # the default suite on the CPU
#   benchmarks/run_all.sh --device cuda    # on a GPU (adds GB/s and Liger Kernel when installed)
#   benchmarks/run_all.sh --large          # larger scaling sizes (more memory and time)
# Extra arguments go to bench_loss.py (see `python benchmarks/bench_loss.py --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
export DPPO_BENCH_COMMAND="benchmarks/run_all.sh${*:+ $*}"
exec "$PYTHON" benchmarks/bench_loss.py "$@"

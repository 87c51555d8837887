#!/usr/bin/env bash
# The embedded default run: build a tiny character-level Llama, warm-start it with a short
# supervised fine-tune on a disjoint slice of the arithmetic task, then train it with DPPO
# (binary TV) from vLLM rollouts (transformers generate when vLLM is not installed).
# Needs no network. Writes runs/arithmetic_default/{metrics.jsonl,metrics.png,summary.json,checkpoint-<step>/}.
#
#   bash examples/arithmetic_default.sh                 # the default run
#   bash examples/arithmetic_default.sh --loss grpo_clip --out runs/arithmetic_grpo   # a baseline
#   bash examples/arithmetic_default.sh --resume        # continue from its newest checkpoint-<step>/
#   bash examples/arithmetic_default.sh --overwrite     # start over (a non-empty --out is refused otherwise)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
exec "$PYTHON" -m dppo_ext.train --out runs/arithmetic_default "$@"

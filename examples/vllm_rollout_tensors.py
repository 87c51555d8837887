"""vLLM rollouts into dppo_loss without our trainer, and what goes wrong with vLLM's default log-probs.

    python examples/vllm_rollout_tensors.py [--temperature 0.7] [--top-k 4]

Builds the embedded tiny model (no download; its LM head scaled by --head-scale so the policy is
peaked like a trained one), samples with an in-process ``vllm.LLM`` and turns the
``RequestOutput``s into the op's tensors with ``dppo_ext.rollout.vllm_rollout_tensors``. The policy
scores the same tokens with the same weights, so the op's ``|pi - mu|`` should be rounding noise and
nothing should be masked. It then repeats the rollout with vLLM's default ``raw_logprobs`` (log-probs
of the logits before temperature scaling): at T != 1 every token shows a spurious mismatch and DPPO
masks tokens the policy never moved. One line per logprobs_mode is printed, and written as JSON
with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch


def rollout_metrics(model_dir: str, logprobs_mode: str, args: argparse.Namespace) -> dict[str, float]:
    """Sample with vLLM in ``logprobs_mode``; return the op's metrics against the policy's own logits."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from dppo_ext import dppo_loss
    from dppo_ext.rollout import vllm_rollout_tensors

    llm = LLM(
        model=model_dir, dtype="float32", seed=0, max_model_len=64, enforce_eager=True, logprobs_mode=logprobs_mode
    )
    params = SamplingParams(n=8, temperature=args.temperature, max_tokens=8, logprobs=args.top_k, seed=1)
    prompts = [{"prompt_token_ids": [1, 4 + i % 10, 14, 4 + (3 * i) % 10, 16]} for i in range(16)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    rollout = vllm_rollout_tensors(outputs, top_k=args.top_k)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = torch.tensor(rollout.prompt_ids)  # [B, P]: equal-length prompts here
    with torch.no_grad():
        logits = model(torch.cat([prompt, rollout.tokens], 1)).logits[:, prompt.shape[1] - 1 : -1]  # [B, T, V]
    advantages = torch.tensor([1.0, -1.0]).repeat(len(rollout.prompt_ids) // 2)  # [B]: both signs
    metrics = {}
    for mode in ("binary_tv", "topk_tv"):
        _, m = dppo_loss(
            logits,
            rollout.tokens,
            rollout.rollout_logprobs,
            advantages,
            response_mask=rollout.response_mask,
            mode=mode,
            topk_ids=rollout.topk_ids,
            topk_logprobs=rollout.topk_logprobs,
            temperature=args.temperature,
        )
        metrics[f"{mode}_masked_frac"] = float(m["masked_frac"])
        metrics["mismatch_mean"], metrics["mismatch_max"] = float(m["mismatch_mean"]), float(m["mismatch_max"])
    metrics["tokens"] = int(rollout.response_mask.sum())
    return metrics


def sharpen(model_dir: str, scale: float) -> None:
    """Scale the LM head so the random tiny model is as peaked as a trained one (it is near-uniform)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(model_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--head-scale", type=float, default=8.0, help="LM-head scale that makes the policy peaked")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--model-dir", default="", help=argparse.SUPPRESS)  # one mode per process (below)
    parser.add_argument("--logprobs-mode", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from dppo_ext.rollout.vllm_logging import quiet_vllm_logging

    quiet_vllm_logging()
    if args.logprobs_mode:
        print(json.dumps(rollout_metrics(args.model_dir, args.logprobs_mode, args)))
        return
    from dppo_ext.models.tiny import build_tiny_model

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_tiny_model(tmp, seed=0))
        sharpen(model_dir, args.head_scale)
        for mode in ("processed_logprobs", "raw_logprobs"):
            # A fresh process per engine: one in-process vLLM engine per process is what vLLM expects.
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--model-dir",
                    model_dir,
                    "--logprobs-mode",
                    mode,
                    "--temperature",
                    str(args.temperature),
                    "--top-k",
                    str(args.top_k),
                ],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            )
            results[mode] = r = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"logprobs_mode={mode:<19} T={args.temperature}: mismatch |pi - mu| mean {r['mismatch_mean']:.2e} "
                f"max {r['mismatch_max']:.2e}; masked: binary_tv {100 * r['binary_tv_masked_frac']:.1f}%, "
                f"topk_tv {100 * r['topk_tv_masked_frac']:.1f}% of {r['tokens']} tokens",
                flush=True,
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"temperature": args.temperature, "top_k": args.top_k, **results}, handle, indent=2)


if __name__ == "__main__":
    main()

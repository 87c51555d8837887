"""What an fp32 LM head buys in |pi - mu|: a bfloat16 model in vLLM with its head in bfloat16 or in float32, scored by
the trainer's fused LM head + loss with bfloat16 or float32 logits.

    python benchmarks/fp32_head_mismatch.py [--head-scale 8] [--vocab-size 0] [--temperature 1.0] [--json out.json]

Builds the embedded tiny model (no download; its LM head scaled by ``--head-scale`` so the policy is peaked like a
trained one; ``--vocab-size`` pads its 17-token vocabulary with unused rows, as a real vocabulary's rare tokens)
and loads the same bfloat16 weights on both sides. For each engine head dtype, an in-process
``vllm.LLM`` (``dtype="bfloat16"``; the float32 head through ``hf_overrides={"head_dtype": "float32"}``, vLLM's own
switch) samples 16 prompts x 8 completions over the whole vocabulary; the trainer's bfloat16 model computes the
hidden states of the same tokens and ``fused_linear_dppo_loss`` scores them (``binary_tv``, the API defaults) with
``logits_dtype=None`` (bfloat16 logits, the model's dtype) and ``logits_dtype=torch.float32``. A float32 engine
scored by a float32 trainer is the floor: what two implementations of the same float32 model differ by. Prints a
markdown table and writes the figures as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import tempfile

import torch
from replay_vllm_mismatch import peaked_tiny_model

PROMPTS = 16
SAMPLES = 8
NEW_TOKENS = 8


def engine_rollout(model_dir: str, dtype: str, head_dtype: str | None, temperature: float):
    """One engine's rollout of every prompt (``vllm_rollout_tensors``), the engine shut down after."""
    from vllm import LLM, SamplingParams

    from dppo_ext.rollout import vllm_rollout_tensors

    overrides = {"head_dtype": head_dtype} if head_dtype else None
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        seed=0,
        max_model_len=64,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        hf_overrides=overrides,
    )
    prompts = [{"prompt_token_ids": [1, 4 + i % 10, 14, 4 + (3 * i) % 10, 16]} for i in range(PROMPTS)]
    params = SamplingParams(n=SAMPLES, temperature=temperature, max_tokens=NEW_TOKENS, logprobs=0, seed=1)
    rollout = vllm_rollout_tensors(llm.generate(prompts, params, use_tqdm=False))
    del llm
    gc.collect()
    return rollout


def trainer_scores(model, rollout, temperature: float, logits_dtype) -> dict[str, float]:
    """|pi - mu| and the masked share of the rollout's response tokens, pi from the trainer's fused LM head."""
    from dppo_ext import fused_linear_dppo_loss

    prompt = torch.tensor(rollout.prompt_ids)  # [B, P]: equal-length prompts here
    with torch.no_grad():
        ids = torch.cat([prompt, rollout.tokens], 1)
        hidden = model.model(ids).last_hidden_state[:, prompt.shape[1] - 1 : -1]  # [B, T, H]
        advantages = torch.tensor([1.0, -1.0]).repeat(rollout.tokens.shape[0] // 2)  # [B]: both signs
        _, metrics = fused_linear_dppo_loss(
            hidden,
            model.lm_head.weight,
            rollout.tokens,
            rollout.rollout_logprobs,
            advantages,
            response_mask=rollout.response_mask,
            temperature=temperature,
            logits_dtype=logits_dtype,
        )
    return {name: float(metrics[name]) for name in ("mismatch_mean", "mismatch_max", "mismatch_k3", "masked_frac")}


def measure(model_dir: str, temperature: float) -> list[dict]:
    from transformers import AutoModelForCausalLM

    trainers = {
        dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        for dtype in ("bfloat16", "float32")
    }
    rows = []
    cases = [("bfloat16", None), ("bfloat16", "float32"), ("float32", None)]
    for engine_dtype, head_dtype in cases:
        rollout = engine_rollout(model_dir, engine_dtype, head_dtype, temperature)
        engine = f"{engine_dtype}, head {head_dtype or engine_dtype}"
        tokens = int(rollout.response_mask.sum())
        if engine_dtype == "float32":
            score = trainer_scores(trainers["float32"], rollout, temperature, None)
            rows.append({"engine": engine, "trainer": "float32 model, float32 logits", "tokens": tokens, **score})
            continue
        for logits_dtype in (None, torch.float32):
            score = trainer_scores(trainers["bfloat16"], rollout, temperature, logits_dtype)
            trainer = "bfloat16 model, " + ("float32 logits" if logits_dtype else "bfloat16 logits")
            rows.append({"engine": engine, "trainer": trainer, "tokens": tokens, **score})
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| vLLM engine | trainer (`fused_linear_dppo_loss`) | tokens | \\|π − μ\\| mean | \\|π − μ\\| max | k3 KL "
        "| masked |",
        "|---|---|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['trainer']} | {r['tokens']} | {r['mismatch_mean']:.2e} | {r['mismatch_max']:.2e} "
            f"| {r['mismatch_k3']:.1e} | {100 * r['masked_frac']:.2f} % |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--head-scale", type=float, default=8.0, help="LM-head scale that makes the policy peaked")
    parser.add_argument("--vocab-size", type=int, default=0, help="pad the vocabulary to this size (0: 17 tokens)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args()
    from dppo_ext import cpu_capability

    with tempfile.TemporaryDirectory() as tmp:
        # bfloat16 weights: the same numbers on both sides
        model_dir = peaked_tiny_model(tmp, args.head_scale, vocab_size=args.vocab_size, dtype=torch.bfloat16)
        rows = measure(model_dir, args.temperature)
    print(
        f"T = {args.temperature}, LM head x{args.head_scale}, V = {args.vocab_size or 17}, bfloat16 weights on both "
        f"sides, binary_tv defaults, {platform.processor() or platform.machine()}, dppo_ext kernels: {cpu_capability}"
    )
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            record = {
                "temperature": args.temperature,
                "head_scale": args.head_scale,
                "vocab_size": args.vocab_size or 17,
                "cpu_capability": cpu_capability,
            }
            json.dump({**record, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()

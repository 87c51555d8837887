"""Truncated sampling through the real path (vLLM -> ``vllm_rollout_tensors`` -> the op), with and without replay.

    python benchmarks/replay_vllm_mismatch.py [--temperature 0.7] [--head-scale 8] [--json out.json]

Builds the embedded tiny model (no download; its LM head scaled by ``--head-scale`` so the policy is peaked like a
trained one), samples 16 prompts x 8 completions with an in-process ``vllm.LLM`` (float32,
``logprobs_mode="processed_logprobs"``) under each sampling setting, and scores the same tokens with the same
weights in float32 through ``dppo_loss`` (``binary_tv``, the API defaults): once over the whole vocabulary (no
``kept_ids``: what a loss without replay computes), once with the kept sets ``vllm_rollout_tensors`` returns, and
once with the kept sets ``kept_ids_by_rule`` derives from the trainer's logits. Same weights and dtype on both sides,
so every |pi - mu| beyond float32 rounding, and every masked token, is the truncation's. Prints a markdown table
(one row per setting) and writes the figures as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import torch

# (name, SamplingParams truncation) of each row; "full" samples from the whole distribution.
SETTINGS = {
    "full": {},
    "top_p 0.9": {"top_p": 0.9},
    "top_p 0.7": {"top_p": 0.7},
    "top_k 5": {"top_k": 5},
    "top_k 2": {"top_k": 2},
    "min_p 0.1": {"min_p": 0.1},
}


def score(logits, rollout, temperature: float, kept_ids) -> dict[str, float]:
    """The op's |pi - mu| mean / max and masked share over the rollout's response tokens."""
    from dppo_ext import dppo_loss

    advantages = torch.tensor([1.0, -1.0]).repeat(rollout.tokens.shape[0] // 2)  # [B]: both signs
    _, metrics = dppo_loss(
        logits,
        rollout.tokens,
        rollout.rollout_logprobs,
        advantages,
        response_mask=rollout.response_mask,
        kept_ids=kept_ids,
        temperature=temperature,
    )
    return {name: float(metrics[name]) for name in ("mismatch_mean", "mismatch_max", "masked_frac", "mismatch_k3")}


def measure(model_dir: str, temperature: float) -> dict[str, dict]:
    """Every setting of :data:`SETTINGS` on one engine."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from dppo_ext.rollout import kept_ids_by_rule, vllm_rollout_tensors

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    llm = LLM(
        model=model_dir,
        dtype="float32",
        seed=0,
        max_model_len=64,
        enforce_eager=True,
        logprobs_mode="processed_logprobs",
        max_logprobs=vocab,
    )
    prompts = [{"prompt_token_ids": [1, 4 + i % 10, 14, 4 + (3 * i) % 10, 16]} for i in range(16)]
    results = {}
    for name, truncation in SETTINGS.items():
        # logprobs = V: every kept set comes back whole (the tiny vocabulary allows it)
        params = SamplingParams(n=8, temperature=temperature, max_tokens=8, logprobs=vocab, seed=1, **truncation)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        rollout = vllm_rollout_tensors(outputs, sampling_params=params if truncation else None)
        prompt = torch.tensor(rollout.prompt_ids)  # [B, P]: equal-length prompts here
        with torch.no_grad():
            logits = model(torch.cat([prompt, rollout.tokens], 1)).logits[:, prompt.shape[1] - 1 : -1]  # [B, T, V]
        row = {"tokens": int(rollout.response_mask.sum()), "no_replay": score(logits, rollout, temperature, None)}
        if truncation:
            valid = rollout.response_mask
            row["mean_kept"] = float((rollout.kept_ids >= 0).sum(-1)[valid].float().mean())
            row["replay_recorded"] = score(logits, rollout, temperature, rollout.kept_ids)
            by_rule = kept_ids_by_rule(logits, temperature, max_kept=vocab, **truncation)
            row["replay_by_rule"] = score(logits, rollout, temperature, by_rule)
            same = [
                set(a.tolist()) - {-1} == set(b.tolist()) - {-1}
                for a, b in zip(rollout.kept_ids[valid], by_rule[valid])
            ]
            row["rule_agrees_frac"] = sum(same) / len(same)
        results[name] = row
    return results


def table(results: dict[str, dict]) -> str:
    lines = [
        "| sampling | mean kept | no replay: \\|π − μ\\| mean / max, masked | replay (recorded kept set) | "
        "replay (by rule) | sets agree |",
        "|---|--:|--:|--:|--:|--:|",
    ]

    def cell(m: dict | None) -> str:
        if m is None:
            return "—"
        return f"{m['mismatch_mean']:.1e} / {m['mismatch_max']:.1e}, {100 * m['masked_frac']:.1f} %"

    for name, row in results.items():
        kept = f"{row['mean_kept']:.2f}" if "mean_kept" in row else "all"
        agree = f"{100 * row['rule_agrees_frac']:.0f} %" if "rule_agrees_frac" in row else "—"
        lines.append(
            f"| {name} | {kept} | {cell(row['no_replay'])} | {cell(row.get('replay_recorded'))} | "
            f"{cell(row.get('replay_by_rule'))} | {agree} |"
        )
    return "\n".join(lines)


def peaked_tiny_model(folder: str, head_scale: float, *, vocab_size: int = 0, dtype=torch.float32) -> str:
    """The embedded tiny model saved in ``folder`` (``dtype`` weights), its LM head scaled by ``head_scale`` (the
    random model is near-uniform; a scaled head is as peaked as a trained one), and vLLM set up to run in this
    process, quietly. ``vocab_size``: pad the 17-token vocabulary with unused rows (0: none)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    from dppo_ext.models.tiny import build_tiny_model
    from dppo_ext.rollout.vllm_logging import quiet_vllm_logging

    quiet_vllm_logging()
    model_dir = str(build_tiny_model(folder, seed=0, vocab_size=vocab_size))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    model.to(dtype).save_pretrained(model_dir)
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--head-scale", type=float, default=8.0, help="LM-head scale that makes the policy peaked")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = measure(peaked_tiny_model(tmp, args.head_scale), args.temperature)
    print(f"T = {args.temperature}, LM head x{args.head_scale}, float32 engine and trainer, binary_tv defaults")
    print(table(results))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            record = {"temperature": args.temperature, "head_scale": args.head_scale, "host": platform.node()}
            json.dump({**record, "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()

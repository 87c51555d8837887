"""The sync guard's floor and cost per architecture: |log pi - log mu| on the stored sequence after a weight sync.

For each tiny random architecture of python_tests/dppo_testing/architectures.py, one in-process vLLM engine in
``--engine-dtype``; the trainer's model in float32 and in ``--engine-dtype``; five times: every weight moved by
Gaussian noise (0.02 x its RMS), a sync, then what the guard computes on 4 fresh rollouts (prompt + up to 12
generated tokens). Prints and writes (``--out``, JSON) per architecture and trainer dtype the largest
|log pi - log mu|, the largest |log pi| it occurred with, and the seconds of one check next to one sync.

    python benchmarks/bench_sync_guard.py --engine-dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_tests"))  # the tiny architectures

from dppo_testing.architectures import ARCHITECTURES, build_architecture  # noqa: E402

from dppo_ext.rollout.sync_guard import engine_logprobs, model_logprobs  # noqa: E402
from dppo_ext.rollout.vllm_engine import VLLMEngine  # noqa: E402
from dppo_ext.rollout.vllm_parity import policy_load_kwargs  # noqa: E402

PROMPTS = [[1, 5, 16, 7, 15], [1, 9, 14, 4, 15], [1, 6, 14, 12, 15], [1, 8, 16, 10, 15]]


def guard_diff(engine: VLLMEngine, model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What the sync guard computes: the trainer's and vLLM's log-probs of ``ids[1:]`` (float64)."""
    return model_logprobs(model, ids).double(), engine_logprobs(engine.llm, ids)


def measure(arch: str, folder: Path, engine_dtype: str, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    path = build_architecture(arch, folder / arch)
    engine = VLLMEngine(str(path), dtype=engine_dtype, max_model_len=64, sync_check=False)
    out: dict = {}
    try:
        for trainer_dtype in dict.fromkeys(("float32", engine_dtype)):
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, trainer_dtype), **policy_load_kwargs(str(path))
            ).eval()
            worst, worst_lp, checks, syncs = 0.0, 0.0, [], []
            generator = torch.Generator().manual_seed(0)
            for round_ in range(rounds):
                with torch.no_grad():
                    for p in model.parameters():
                        noise = torch.randn(p.shape, generator=generator).to(p.dtype)
                        p.add_(noise * 0.02 * p.float().pow(2).mean().sqrt().to(p.dtype))
                start = time.perf_counter()
                engine.sync_weights(model)
                syncs.append(time.perf_counter() - start)
                for group in engine.generate(PROMPTS, n=1, temperature=1.0, max_tokens=12, seed=round_):
                    start = time.perf_counter()
                    pi, mu = guard_diff(engine, model, group[0].prompt_ids + group[0].response_ids)
                    checks.append(time.perf_counter() - start)
                    diff = (pi - mu).abs()
                    if float(diff.max()) > worst:
                        worst, worst_lp = float(diff.max()), float(pi.abs()[diff.argmax()])
            out[trainer_dtype] = {
                "max_diff": worst,
                "abs_logp_at_max": worst_lp,
                "check_s": statistics.median(checks),
                "sync_s": statistics.median(syncs),
            }
            print(
                f"{arch:14s} engine {engine_dtype:9s} trainer {trainer_dtype:9s} max |log pi - log mu| "
                f"{worst:.3g} (|log pi| {worst_lp:.2f}); check {statistics.median(checks) * 1e3:.0f} ms, "
                f"sync without check {statistics.median(syncs) * 1e3:.0f} ms",
                flush=True,
            )
    finally:
        engine.close()
        del engine
        gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--archs", nargs="*", default=list(ARCHITECTURES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/dppo_sync_guard_models"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {arch: measure(arch, args.folder, args.engine_dtype, args.rounds) for arch in args.archs}
    if args.out:
        args.out.write_text(json.dumps({"engine_dtype": args.engine_dtype, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""The cost of the mask family's settings: ``dppo_loss`` forward+backward with and without each, side by side.

One process, the same inputs (``benchlib.inputs.make_inputs``: N rows of V logits, reshaped to ``[B, T, V]`` so that
every row of ``B`` is a sequence), the default ``binary_tv`` loss with ``token-mean`` aggregation as the baseline,
then each setting alone and all together: ``mask_direction="symmetric"`` (the kernels' trust_mask),
``kl_tau`` (the squared-log-ratio penalty composed on ``logp``), ``sequence_mask`` (a sequence-mean k3 mask composed on
the per-row outputs) and the three at once. The cases are interleaved round by round (warm-up first), and each one's
median over ``--repeats`` rounds is reported with its ratio to the baseline's median. The target is at most 1.05x:
each setting adds O(N) work to an O(N * V) step.

    python benchmarks/bench_mask_family.py                     # N = 2048, V = 32768, float32, CPU
    python benchmarks/bench_mask_family.py --n 256 --v 4096    # a quick look

Prints one line per case and writes ``--out`` (JSON: the figures and the machine, load average included: a busy
host's figures are noisier, so compare ratios from the same run only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import inputs, machine  # noqa: E402

from dppo_ext import SequenceMask, cpu_capability, dppo_loss, dppo_loss_per_row  # noqa: E402
from dppo_ext._rows import LossSettings, RowInputs  # noqa: E402
from dppo_ext.aggregation import aggregate_with, compose_rows  # noqa: E402

CASES = {
    "baseline": {},
    "symmetric": {"mask_direction": "symmetric"},
    "kl_tau": {"kl_tau": 1e-3},
    "sequence_mask": {"sequence_mask": SequenceMask("k3", "mean", high=0.05)},
    "all three": {
        "mask_direction": "symmetric",
        "kl_tau": 1e-3,
        "sequence_mask": SequenceMask("k3", "mean", high=0.05),
    },
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048, help="rows (response tokens)")
    parser.add_argument("--v", type=int, default=32768, help="vocabulary")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (N must be a multiple)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (each case once per round)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=os.path.join("artifacts", "bench_mask_family.json"))
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.n % args.seq_len:
        raise SystemExit(f"--n={args.n} must be a multiple of --seq-len={args.seq_len}")
    dtype = getattr(torch, args.dtype)
    inp = inputs.make_inputs(args.n, args.v, 0, "binary_tv", dtype, "cpu")
    b, t = args.n // args.seq_len, args.seq_len
    logits = inp.logits.detach().reshape(b, t, args.v).requires_grad_(True)
    rows = (inp.tokens.reshape(b, t), inp.rollout_logprobs.reshape(b, t), inp.advantages.reshape(b, t))

    def step(settings: dict) -> float:
        logits.grad = None
        start = time.perf_counter()
        loss, _metrics = dppo_loss(logits, *rows, **settings)
        loss.backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in CASES}
    for round_ in range(args.warmup + args.repeats):
        for name, settings in CASES.items():
            elapsed = step(settings)
            if round_ >= args.warmup:
                times[name].append(elapsed)
    base = statistics.median(times["baseline"])
    info = machine.machine_info("cpu")
    info["dppo_cpu_capability"] = cpu_capability
    print(
        f"dppo_loss forward+backward, N={args.n} ({b} sequences of {t}), V={args.v}, {args.dtype}, CPU "
        f"{info['cpu_simd']} (kernels: {info['dppo_cpu_capability']}), {info['torch_threads']} threads, "
        f"load average {info['loadavg_start'][0]:.1f}; median of {args.repeats}"
    )
    results = {}
    for name in CASES:
        median = statistics.median(times[name])
        results[name] = {"median_s": median, "ratio": median / base, "times_s": times[name]}
        print(f"  {name:<14} {median * 1e3:8.1f} ms   {median / base:5.3f}x")
    compose = _composition_time(inp, b, t, args.repeats)
    results["composition alone"] = {"median_s": compose, "ratio": compose / base}
    print(
        f"  {'composition alone':<14} {compose * 1e3:8.3f} ms   {compose / base:5.3f}x  (kl_tau + sequence mask, O(N))"
    )
    report = {"args": vars(args), "machine": info, "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    return report


def _composition_time(inp: inputs.LossInputs, b: int, t: int, repeats: int) -> float:
    """The median time of what "all three" adds outside the kernels: the penalty and the sequence mask composed on one
    call's per-row outputs, aggregated, and their backward to ``logp`` (the kernels' own backward not included)."""
    settings = LossSettings.resolve("binary_tv", 1.0, None, None, 10.0, True, **CASES["all three"])
    rows = RowInputs(inp.tokens, inp.rollout_logprobs, inp.advantages)
    with torch.no_grad():
        out = dppo_loss_per_row(inp.logits.detach(), *rows[:3], mask_direction="symmetric")
    index, valid = torch.arange(b).repeat_interleave(t), torch.ones(b, t, dtype=torch.bool)
    times = []
    for _ in range(3 * repeats):
        leaf = out._replace(loss=out.loss.clone().requires_grad_(True), logp=out.logp.clone().requires_grad_(True))
        start = time.perf_counter()
        composed, _frac = compose_rows(leaf, rows, settings, index, b)
        aggregate_with(composed.loss.reshape(b, t), valid, settings).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()

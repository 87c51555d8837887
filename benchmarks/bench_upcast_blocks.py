"""The fp32 LM head's widening block size: one row chunk's float32 logits from bfloat16 ``hidden`` and ``weight``.

Times, side by side in one process (each round runs every case once; medians of the per-round ratios):

  bf16 product          torch.mm(h, W^T) in bfloat16 (the default fused path's product)
  fp32 product          torch.mm(h32, W32^T) with a float32 copy of the whole weight made beforehand (the bound)
  widen whole           W.float() then the product (what a whole-weight copy per chunk costs)
  blocks of R rows      h widened once, then the product a block of R weight rows at a time, each widened on the
                        way: the loop of the fused path's float32 logits (``logits_dtype=torch.float32``) with its
                        UPCAST_BLOCK_BYTES = R * H * 4, written out here so that R can vary

    python benchmarks/bench_upcast_blocks.py                     # 256 rows, H=512, V=32768
    python benchmarks/bench_upcast_blocks.py --blocks 1024 4096 8192 16384
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib.machine import machine_info  # noqa: E402  (benchmarks/ on the path first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=256, help="rows of one chunk")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096, 8192, 16384], help="weight rows")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    h = torch.randn(args.rows, args.hidden, dtype=torch.bfloat16)
    w = torch.randn(args.vocab, args.hidden, dtype=torch.bfloat16)
    h32, w32 = h.float(), w.float()
    out = torch.empty(args.rows, args.vocab)
    out16 = torch.empty(args.rows, args.vocab, dtype=torch.bfloat16)

    def blocked(rows: int):
        def run() -> None:
            wide = h.float()
            for start in range(0, args.vocab, rows):
                stop = min(start + rows, args.vocab)
                torch.mm(wide, w[start:stop].float().t(), out=out[:, start:stop])

        return run

    cases = {
        "bf16 product": lambda: torch.mm(h, w.t(), out=out16),
        "fp32 product": lambda: torch.mm(h32, w32.t(), out=out),
        "widen whole": lambda: torch.mm(h32, w.float().t(), out=out),
        **{f"blocks of {r} rows ({r * args.hidden * 4 / 2**20:g} MiB)": blocked(r) for r in args.blocks},
    }
    for run in cases.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    machine = machine_info("cpu")
    print(
        f"rows={args.rows} H={args.hidden} V={args.vocab}; {machine['cpu_model']}, {machine['cpu_count']} cores, "
        f"widest SIMD {machine['cpu_simd']}, torch {machine['torch']}, load {machine['loadavg_start'][0]:.1f}"
    )
    base = times["fp32 product"]
    for name, values in times.items():
        ratio = statistics.median(t / b for t, b in zip(values, base))
        print(f"  {name:32s} median {statistics.median(values) * 1e3:8.1f} ms   x fp32 product {ratio:5.2f}")


if __name__ == "__main__":
    main()

"""Sampling replay's cost: the DPPO op with ``kept_ids`` against the plain op, forward + backward, side by side.

For each shape (N rows, V vocabulary) the same logits, tokens and rollout log-probs run through
``dppo_loss_per_row`` without and with a kept set of S ids per row (the sampled token plus S - 1 others, a quarter
of them -1 padding), fp32, entropy on, out-of-place backward. Timing: both contenders in one process, interleaved
(plain, replay, plain, ...) after ``--warmup`` rounds; the median of ``--repeats`` rounds of each and their ratio.
Peak memory: each contender in a fresh child process (benchlib.peak_memory: glibc returns freed blocks at once, the
resident-set peak VmHWM is reset before the step) on CPU, ``max_memory_allocated`` on CUDA; the peak beyond the
inputs, during one forward + backward.

    python benchmarks/bench_replay.py [--shapes 2048x32768,4096x151936] [--s 64] [--repeats 7] [--device cpu]
        [--json replay.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from benchlib.machine import machine_info  # noqa: E402
from benchlib.peak_memory import MALLOC_ENV, MIB, peak_rss, reset_peak_rss  # noqa: E402

from dppo_ext import dppo_loss_per_row  # noqa: E402

log = logging.getLogger("bench_replay")


def make_inputs(n: int, v: int, s: int, device: str, seed: int = 0) -> dict:
    """Logits [N, V] fp32, tokens, rollout log-probs, advantages, and kept_ids [N, S] holding each row's token."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=gen) * 2.0
    tokens = torch.randint(0, v, (n,), generator=gen)
    # distinct ids per row: the token, then offsets 1, 1 + step, 1 + 2 step, ... from it (mod V)
    step = max(v // s, 1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), 1 + step * torch.arange(s - 1)])
    kept = (tokens[:, None] + offsets[None, :]) % v
    kept[:, -(s // 4) :] = -1
    rollout = torch.log_softmax(logits.double() / 1.0, -1).gather(1, tokens[:, None]).squeeze(1).float() - 0.01
    adv = torch.randn(n, generator=gen)
    return {
        "logits": logits.to(device),
        "tokens": tokens.to(device),
        "rollout_logprobs": rollout.clamp(max=0).to(device),
        "advantages": adv.to(device),
        "kept_ids": kept.to(device),
    }


def step(inputs: dict, leaf: torch.Tensor, replay: bool) -> None:
    """One forward + backward (the gradient lands in leaf.grad, reset first)."""
    leaf.grad = None
    kw = {k: v for k, v in inputs.items() if k not in ("logits", "kept_ids")}
    out = dppo_loss_per_row(leaf, **kw, kept_ids=inputs["kept_ids"] if replay else None)
    (out.loss.sum() + out.entropy.sum() * 0.01).backward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_side_by_side(inputs: dict, device: str, warmup: int, repeats: int) -> dict:
    leaf = inputs["logits"].clone().requires_grad_(True)
    times = {"plain": [], "replay": []}
    for r in range(warmup + repeats):
        for name in ("plain", "replay"):
            sync(device)
            t0 = time.perf_counter()
            step(inputs, leaf, name == "replay")
            sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    return {"plain_s": med["plain"], "replay_s": med["replay"], "ratio": med["replay"] / med["plain"]}


def peak_child(n: int, v: int, s: int, device: str, replay: bool) -> int:
    """The peak memory of one forward + backward beyond the inputs, in bytes (this process: the child)."""
    inputs = make_inputs(n, v, s, device)
    leaf = inputs["logits"].clone().requires_grad_(True)
    step(inputs, leaf, replay)  # warm: the kernels' and the allocator's first-call work
    leaf.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step(inputs, leaf, replay)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    start = reset_peak_rss()
    step(inputs, leaf, replay)
    return peak_rss() - start


def measure_peak(n: int, v: int, s: int, device: str, replay: bool) -> int:
    cmd = [sys.executable, __file__, "--child", f"{n}x{v}", "--s", str(s), "--device", device]
    if replay:
        cmd.append("--replay")
    env = dict(os.environ, **MALLOC_ENV, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x32768,4096x151936", help="comma-separated NxV")
    ap.add_argument("--s", type=int, default=64, help="kept-set width S")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--replay", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        n, v = map(int, args.child.split("x"))
        print(peak_child(n, v, args.s, args.device, args.replay))
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for shape in args.shapes.split(","):
        n, v = map(int, shape.split("x"))
        inputs = make_inputs(n, v, args.s, args.device)
        row = {"n": n, "v": v, "s": args.s, **time_side_by_side(inputs, args.device, args.warmup, args.repeats)}
        del inputs
        if not args.no_memory:
            row["plain_peak_mib"] = measure_peak(n, v, args.s, args.device, False) / MIB
            row["replay_peak_mib"] = measure_peak(n, v, args.s, args.device, True) / MIB
        rows.append(row)
        mem = "" if args.no_memory else f"  peak {row['plain_peak_mib']:.0f} MiB -> {row['replay_peak_mib']:.0f} MiB"
        log.info(
            "N=%d V=%d S=%d: plain %.3f s, replay %.3f s, ratio %.3fx%s",
            n,
            v,
            args.s,
            row["plain_s"],
            row["replay_s"],
            row["ratio"],
            mem,
        )
    result = {"machine": machine_info(args.device), "command": " ".join(sys.argv), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log.info("wrote %s", args.json)


if __name__ == "__main__":
    main()

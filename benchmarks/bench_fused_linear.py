"""Fused-linear DPPO vs the logits path: measured peak memory beyond the inputs, and time, per loss step.

One step = forward + backward of ``loss = sum(per-row DPPO loss) / N`` from ``hidden [N, H]`` and the LM-head
``weight [V, H]`` (both require grad), the LM-head matmul included:

  fused           dppo_ext.fused_linear_dppo_loss_per_row(hidden, weight, ...) (the core of fused_linear_dppo_loss)
  logits          logits = hidden @ weight.T; dppo_ext.ops.dppo_loss_forward(logits, ...)
  logits_inplace  the same with inplace_backward=True (the gradient is written into the logits buffer)

Memory is measured, never estimated. On CPU every case runs in a fresh subprocess; the peak resident set is
reset after the inputs exist (``/proc/self/clear_refs``) and the step's peak is ``VmHWM - VmRSS`` at that point.
On CUDA it is ``torch.cuda.max_memory_allocated()`` minus the allocated bytes before the step. The gradients of
hidden and weight are part of every case's peak.

    python benchmarks/bench_fused_linear.py                  # issue target: N=8192, H=2048, V=151936, bf16
    python benchmarks/bench_fused_linear.py --small          # N=2048, H=1024, V=32768: a minute on 2 cores

Results: a table on stdout, ``<out-dir>/bench_fused_linear.json`` and ``.png`` (peak memory and time bars).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("fused", "logits", "logits_inplace")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TARGET = {"n": 8192, "hidden": 2048, "vocab": 151936}
SMALL = {"n": 2048, "hidden": 1024, "vocab": 32768}
GIB = 1024**3


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS


def run_case(args: argparse.Namespace) -> dict:
    """Child process: build the inputs, run the step, return measured peak bytes and times."""
    import torch

    import dppo_ext.ops  # noqa: F401  (loads the native library: registers torch.ops.dppo)
    from dppo_ext.fused_linear import fused_linear_dppo_loss_per_row, plan_chunks
    from dppo_ext.ops import dppo_loss_forward

    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    n, h, v = args.n, args.hidden, args.vocab
    hidden = torch.randn(n, h, device=device, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device=device, dtype=dtype) * 0.02).requires_grad_(True)
    tokens = torch.randint(0, v, (n,), device=device)
    rollout = -torch.rand(n, device=device) * 3.0
    advantages = torch.randn(n, device=device)
    kwargs = dict(mode=args.mode, temperature=1.0, delta_low=0.15, delta_high=0.15)

    def step() -> None:
        if args.case == "fused":
            out = fused_linear_dppo_loss_per_row(hidden, weight, tokens, rollout, advantages,
                                                 chunk_size=args.chunk_size, **kwargs)
        else:
            logits = hidden @ weight.t()
            out = dppo_loss_forward(logits, tokens, rollout, advantages,
                                    inplace_backward=args.case == "logits_inplace", **kwargs)
        (out.loss.sum() / n).backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    peaks, times = [], []
    for i in range(args.warmup + args.repeats):
        hidden.grad = weight.grad = None
        gc.collect()
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _reset_peak_rss()
            base = _proc_status_kib("VmRSS") * 1024
        start = time.perf_counter()
        step()
        sync()
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _proc_status_kib("VmHWM") * 1024
        peaks.append(peak - base)
        if i >= args.warmup:
            times.append(elapsed)
    plan = plan_chunks(n, v, h, dtype, chunk_size=args.chunk_size) if args.case == "fused" else None
    return {
        "case": args.case,
        "peak_bytes": max(peaks),
        "median_s": statistics.median(times),
        "times_s": times,
        "plan": None if plan is None else plan.__dict__,
    }


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help=f"smaller defaults {SMALL} (runs here in minutes)")
    parser.add_argument("--n", type=int, help=f"rows (default {TARGET['n']})")
    parser.add_argument("--hidden", type=int, help=f"hidden size (default {TARGET['hidden']})")
    parser.add_argument("--vocab", type=int, help=f"vocabulary (default {TARGET['vocab']})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--mode", default="binary_tv")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--chunk-size", type=int, default=None, help="fused rows per chunk (default: automatic)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs (default 1, 0 at the target size)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs (default 3, 1 at the target size)")
    parser.add_argument("--out-dir", default="artifacts/bench_fused_linear")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # child process: run this one case
    args = parser.parse_args()
    sizes = SMALL if args.small else TARGET
    for key in ("n", "hidden", "vocab"):
        if getattr(args, key) is None:
            setattr(args, key, sizes[key])
    big = args.n * args.vocab >= TARGET["n"] * TARGET["vocab"] // 4
    args.warmup = (0 if big else 1) if args.warmup is None else args.warmup
    args.repeats = (1 if big else 3) if args.repeats is None else args.repeats

    if args.case is not None:
        print(json.dumps(run_case(args)))
        return

    element = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    # Only a guard against swapping the machine: logits + their gradient + weight and its gradient.
    rough_need = (2 * args.n * args.vocab + 2 * args.vocab * args.hidden) * element
    if args.device == "cpu" and rough_need > 0.9 * _mem_available_bytes():
        sys.exit(f"the logits path needs about {rough_need / GIB:.1f} GiB but only "
                 f"{_mem_available_bytes() / GIB:.1f} GiB are available: use smaller --n/--vocab or --small")

    from bench_common import machine_info  # imports torch: only the parent process needs it here

    machine = machine_info(args.device)
    print(f"N={args.n} H={args.hidden} V={args.vocab} {args.dtype} {args.device} mode={args.mode} "
          f"warmup={args.warmup} repeats={args.repeats}", flush=True)
    print(f"host: {machine['cpu_model']}, {machine['cpu_count']} cores, widest SIMD {machine['cpu_simd']}, "
          f"torch {machine['torch']}, load {machine['loadavg_start'][0]:.1f}", flush=True)
    results = []
    passthrough = ["--n", str(args.n), "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype,
                   "--device", args.device, "--mode", args.mode, "--warmup", str(args.warmup),
                   "--repeats", str(args.repeats)]
    if args.chunk_size is not None:
        passthrough += ["--chunk-size", str(args.chunk_size)]
    for case in args.cases:
        proc = subprocess.run([sys.executable, __file__, "--case", case, *passthrough], capture_output=True,
                              text=True, env=dict(os.environ))
        if proc.returncode != 0:
            sys.exit(f"case {case} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"  {case:15s} peak beyond inputs {r['peak_bytes'] / GIB:8.3f} GiB   median {r['median_s']:8.3f} s",
              flush=True)

    by_case = {r["case"]: r for r in results}
    if "fused" in by_case:
        for ref in ("logits", "logits_inplace"):
            if ref in by_case:
                ratio = by_case["fused"]["peak_bytes"] / by_case[ref]["peak_bytes"]
                speed = by_case["fused"]["median_s"] / by_case[ref]["median_s"]
                print(f"fused / {ref}: peak {ratio:.3f}x, time {speed:.2f}x")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("n", "hidden", "vocab", "dtype", "device", "mode", "warmup", "repeats",
                                             "chunk_size")}
    machine["loadavg_end"] = os.getloadavg()
    (out_dir / "bench_fused_linear.json").write_text(
        json.dumps({"config": config, "machine": machine, "results": results}, indent=2))
    _plot(results, config, out_dir / "bench_fused_linear.png")
    print(f"wrote {out_dir / 'bench_fused_linear.json'} and .png")


def _plot(results: list[dict], config: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in results]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax_mem.bar(names, [r["peak_bytes"] / GIB for r in results], color="tab:blue")
    ax_mem.set_ylabel("peak beyond inputs (GiB)")
    ax_time.bar(names, [r["median_s"] for r in results], color="tab:orange")
    ax_time.set_ylabel("fwd+bwd step, median (s)")
    fig.suptitle(f"DPPO loss step, N={config['n']} H={config['hidden']} V={config['vocab']} {config['dtype']} "
                 f"{config['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""Fused-linear DPPO vs the logits path: measured peak memory beyond the inputs, and time, per loss step.

One step = forward + backward of the token-mean loss from ``hidden [N, H]`` and the LM-head ``weight [V, H]`` (both
require grad), the LM-head matmul included:

  fused            dppo_ext.fused_linear_dppo_loss(hidden, weight, ...) as a trainer calls it: the hidden and
                   weight gradients computed in the forward, chunk by chunk (three LM-head products); in float16
                   the backward recomputes the logits (four products) and applies the upstream gradient, e.g.
                   AMP's loss scale, before its products, as the logits path does
  fused_f32sums    the same with accum_dtype=torch.float32: in 16-bit dtypes the weight gradient is summed over
                   the chunks in a float32 accumulator (by default: in the 16-bit gradient itself); in float32 the
                   same as fused
  fused_f32logits  fused with logits_dtype=torch.float32 (and accum_dtype=torch.float32): from bf16/fp16 hidden and
                   weight, the logits tiles and every LM-head product in float32 (an fp32 LM head), the weight
                   widened 16 MiB at a time; in float32 the same as fused
  fused_recompute  dppo_ext.fused_linear_dppo_loss_per_row(...).loss, summed / N by the caller: the per-row path,
                   whose backward recomputes the logits tile by tile (four LM-head products)
  logits           logits = hidden @ weight.T; dppo_ext.dppo_loss(logits, ...)
  logits_inplace   the same with inplace_backward=True (the gradient is written into the logits buffer)

``--chunk-sizes 64,256`` adds ``fused@64``, ``fused@256`` (and ``fused_f32sums@64``, ... when ``fused_f32sums`` is
among the cases): the fused path with that many rows per chunk (the sweep the automatic plan's chunk sizes were
picked from).

Memory is measured, never estimated. On CPU every case runs in a fresh subprocess, which first runs the case once on
a 64-row input (the libraries' one-time buffers, e.g. the BLAS's, then exist, as they do in any trainer after its
first step); the peak resident set is reset after the full-size inputs exist (``/proc/self/clear_refs``) and the
step's peak is ``VmHWM - VmRSS`` at that point, the largest over the warm-up and timed steps (the first full-size
step allocates every buffer fresh). On CUDA it is ``torch.cuda.max_memory_allocated()`` minus the allocated
bytes before the step. The gradients of hidden and weight are part of every case's peak.

Time is measured in one more process, with the allocator's default settings (as a trainer has them), that runs
every case in turn, round after round (the order rotates each round), so a loaded machine slows them alike: each
case's median step time, and its median over the rounds of ``time / the logits path's time in the same round``;
the same for the process's CPU time (all threads), which a shared machine's other jobs inflate far less than the
wall time.

    python benchmarks/bench_fused_linear.py                  # N=8192, H=2048, V=151936, bf16
    python benchmarks/bench_fused_linear.py --small          # N=2048, H=512, V=32768: minutes on 2 cores
    python benchmarks/bench_fused_linear.py --small --chunk-sizes 64,128,256,512 --cases fused logits

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib.peak_memory import MALLOC_ENV  # noqa: E402  (benchmarks/ on the path first)

CASES = ("fused", "fused_f32sums", "fused_f32logits", "fused_recompute", "logits", "logits_inplace")
# the fused cases that compute the gradients in the forward (plan_chunks(grads_in_forward=True))
IN_FORWARD = ("fused", "fused_f32sums", "fused_f32logits")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TARGET = {"n": 8192, "hidden": 2048, "vocab": 151936}
SMALL = {"n": 2048, "hidden": 512, "vocab": 32768}
GIB = 1024**3
MODE = "binary_tv"


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS


def _split_case(case: str) -> tuple[str, int | None]:
    """``fused@128`` -> ("fused", 128); other names -> (name, None)."""
    name, _, chunk = case.partition("@")
    return name, (int(chunk) if chunk else None)


class Step:
    """The inputs of one configuration and a loss step of any case on them."""

    def __init__(self, args: argparse.Namespace, n: int | None = None) -> None:
        import torch

        torch.manual_seed(0)
        self.torch = torch
        self.device = torch.device(args.device)
        dtype = getattr(torch, DTYPES[args.dtype])
        self.dtype = dtype
        n, h, v = args.n if n is None else n, args.hidden, args.vocab
        self.n = n
        self.hidden = torch.randn(n, h, device=self.device, dtype=dtype).requires_grad_(True)
        self.weight = (torch.randn(v, h, device=self.device, dtype=dtype) * 0.02).requires_grad_(True)
        self.tokens = torch.randint(0, v, (n,), device=self.device)
        self.rollout = -torch.rand(n, device=self.device) * 3.0
        self.advantages = torch.randn(n, device=self.device)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def __call__(self, case: str) -> None:
        from dppo_ext import dppo_loss, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row

        name, chunk = _split_case(case)
        self.hidden.grad = self.weight.grad = None
        args = (self.tokens, self.rollout, self.advantages)
        if name in IN_FORWARD:
            accum = self.torch.float32 if name in ("fused_f32sums", "fused_f32logits") else None
            logits_dtype = self.torch.float32 if name == "fused_f32logits" else None
            loss = fused_linear_dppo_loss(
                self.hidden,
                self.weight,
                *args,
                mode=MODE,
                chunk_size=chunk,
                accum_dtype=accum,
                logits_dtype=logits_dtype,
            )[0]
        elif name == "fused_recompute":
            out = fused_linear_dppo_loss_per_row(self.hidden, self.weight, *args, mode=MODE, chunk_size=chunk)
            loss = out.loss.sum() / self.n
        else:
            logits = self.hidden @ self.weight.t()
            loss = dppo_loss(logits, *args, mode=MODE, inplace_backward=name == "logits_inplace")[0]
        loss.backward()
        self.sync()


def run_memory_case(args: argparse.Namespace) -> dict:
    """Child process: one case, its step's peak beyond what was live before it, and its times."""
    small = Step(args, n=min(args.n, 64))  # the libraries' one-time allocations happen here, not in a measured step
    small(args.case)
    del small
    gc.collect()
    step = Step(args)
    torch = step.torch
    peaks, times = [], []
    for i in range(args.warmup + args.repeats):
        step.hidden.grad = step.weight.grad = None
        gc.collect()
        step.sync()
        if step.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _reset_peak_rss()
            base = _proc_status_kib("VmRSS") * 1024
        start = time.perf_counter()
        step(args.case)
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if step.device.type == "cuda" else _proc_status_kib("VmHWM") * 1024
        peaks.append(peak - base)
        if i >= args.warmup:
            times.append(elapsed)
    return {"case": args.case, "peak_bytes": max(peaks), "peaks_bytes": peaks, "times_s": times}


def run_timing(args: argparse.Namespace, cases: list[str]) -> dict:
    """Child process: every case in turn, ``args.rounds`` rounds after one warm-up round, the order rotating."""
    step = Step(args)
    for case in cases:
        step(case)
    times: dict[str, list[float]] = {c: [] for c in cases}
    cpu_times: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        order = cases[r % len(cases) :] + cases[: r % len(cases)]
        for case in order:
            gc.collect()
            start, cpu_start = time.perf_counter(), time.process_time()
            step(case)
            times[case].append(time.perf_counter() - start)
            cpu_times[case].append(time.process_time() - cpu_start)
    out = {}
    for case, values in times.items():
        cpu = cpu_times[case]
        rec = {
            "median_s": statistics.median(values),
            "times_s": values,
            "median_cpu_s": statistics.median(cpu),
            "cpu_times_s": cpu,
        }
        if "logits" in times:
            rec["ratio_to_logits"] = statistics.median(t / b for t, b in zip(values, times["logits"]))
            rec["cpu_ratio_to_logits"] = statistics.median(t / b for t, b in zip(cpu, cpu_times["logits"]))
        out[case] = rec
    return out


def _plan(args: argparse.Namespace, case: str) -> dict | None:
    import torch

    from dppo_ext._lm_head_tiles import plan_chunks

    name, chunk = _split_case(case)
    if not name.startswith("fused"):
        return None
    dtype = getattr(torch, DTYPES[args.dtype])
    logits_dtype = torch.float32 if name == "fused_f32logits" else None
    plan = plan_chunks(
        args.n,
        args.vocab,
        args.hidden,
        dtype,
        chunk_size=chunk,
        grads_in_forward=name in IN_FORWARD,
        logits_dtype=logits_dtype,
    )
    return {key: str(value) if key == "logits_dtype" else value for key, value in plan.__dict__.items()}


def _mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(args: argparse.Namespace, extra: list[str]) -> dict:
    passthrough = [
        "--n",
        str(args.n),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--repeats",
        str(args.repeats),
        "--rounds",
        str(args.rounds),
    ]
    # the memory children: every freed block of 64 KiB or more leaves the resident set (benchlib/peak_memory.py);
    # the timing child keeps the allocator's defaults, as a trainer has them
    env = dict(os.environ, **MALLOC_ENV) if "--case" in extra else dict(os.environ)
    proc = subprocess.run([sys.executable, __file__, *passthrough, *extra], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"child {extra} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help=f"smaller defaults {SMALL} (runs here in minutes)")
    parser.add_argument("--n", type=int, help=f"rows (default {TARGET['n']})")
    parser.add_argument("--hidden", type=int, help=f"hidden size (default {TARGET['hidden']})")
    parser.add_argument("--vocab", type=int, help=f"vocabulary (default {TARGET['vocab']})")
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--chunk-sizes", default="", help="comma list: add fused@<rows> cases with that chunk size")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory processes")
    parser.add_argument("--no-timing", action="store_true", help="skip the alternating timing process")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per memory process (default 1, 0 at the target size)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per memory process (default 1)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 5, 2 at the target size)")
    parser.add_argument("--out-dir", default="artifacts/bench_fused_linear")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # child process: measure this case's memory
    parser.add_argument("--timing", help=argparse.SUPPRESS)  # child process: time these cases (comma list)
    args = parser.parse_args()
    sizes = SMALL if args.small else TARGET
    for key in ("n", "hidden", "vocab"):
        if getattr(args, key) is None:
            setattr(args, key, sizes[key])
    big = args.n * args.vocab >= TARGET["n"] * TARGET["vocab"] // 4
    args.warmup = (0 if big else 1) if args.warmup is None else args.warmup
    args.repeats = 1 if args.repeats is None else args.repeats
    args.rounds = (2 if big else 5) if args.rounds is None else args.rounds

    if args.case is not None:
        print(json.dumps(run_memory_case(args)))
        return
    if args.timing is not None:
        print(json.dumps(run_timing(args, args.timing.split(","))))
        return

    swept = [c for c in ("fused", "fused_f32sums") if c in args.cases] or ["fused"]
    cases = list(args.cases) + [f"{c}@{int(r)}" for c in swept for r in args.chunk_sizes.split(",") if r]
    element = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    # Only a guard against swapping the machine: logits + their gradient + weight and its gradient.
    rough_need = (2 * args.n * args.vocab + 2 * args.vocab * args.hidden) * element
    if args.device == "cpu" and rough_need > 0.9 * _mem_available_bytes():
        sys.exit(
            f"the logits path needs about {rough_need / GIB:.1f} GiB but only "
            f"{_mem_available_bytes() / GIB:.1f} GiB are available: use smaller --n/--vocab or --small"
        )

    from benchlib.machine import machine_info  # imports torch: only the parent process needs it here

    machine = machine_info(args.device)
    print(
        f"N={args.n} H={args.hidden} V={args.vocab} {args.dtype} {args.device} mode={MODE} cases={cases} "
        f"memory: warmup={args.warmup} repeats={args.repeats}; timing: {args.rounds} rounds",
        flush=True,
    )
    print(
        f"host: {machine['cpu_model']}, {machine['cpu_count']} cores, widest SIMD {machine['cpu_simd']} "
        f"(dppo_ext CPU kernels: {machine.get('dppo_ext_cpu_capability')}), torch {machine['torch']}, "
        f"load {machine['loadavg_start'][0]:.1f}",
        flush=True,
    )
    results = {case: {"case": case, "plan": _plan(args, case)} for case in cases}
    if not args.no_memory:
        for case in cases:
            results[case].update(_child(args, ["--case", case]))
            print(f"  memory {case:16s} peak beyond inputs {results[case]['peak_bytes'] / GIB:8.3f} GiB", flush=True)
    if not args.no_timing:
        for case, rec in _child(args, ["--timing", ",".join(cases)]).items():
            results[case].update(timing=rec)
    logits_peak = results.get("logits", {}).get("peak_bytes")
    print(
        f"{'case':16s} {'peak GiB':>9s} {'x logits':>9s} {'median s':>9s} {'x logits (paired)':>18s} "
        f"{'CPU s':>8s} {'CPU x logits':>13s}"
    )
    for case, r in results.items():
        peak = r.get("peak_bytes")
        t = r.get("timing", {})
        if peak is not None and logits_peak:
            r["peak_ratio_to_logits"] = peak / logits_peak
        print(
            f"{case:16s} {'-' if peak is None else f'{peak / GIB:9.3f}':>9s} "
            f"{r.get('peak_ratio_to_logits', float('nan')):9.3f} {t.get('median_s', float('nan')):9.3f} "
            f"{t.get('ratio_to_logits', float('nan')):18.3f} {t.get('median_cpu_s', float('nan')):8.3f} "
            f"{t.get('cpu_ratio_to_logits', float('nan')):13.3f}"
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        k: getattr(args, k)
        for k in ("n", "hidden", "vocab", "dtype", "device", "warmup", "repeats", "rounds", "chunk_sizes")
    }
    config["mode"] = MODE
    machine["loadavg_end"] = os.getloadavg()
    (out_dir / "bench_fused_linear.json").write_text(
        json.dumps({"config": config, "machine": machine, "results": list(results.values())}, indent=2)
    )
    _plot(list(results.values()), config, out_dir / "bench_fused_linear.png")
    print(f"wrote {out_dir / 'bench_fused_linear.json'} and .png")


def _plot(results: list[dict], config: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in results]
    fig, (ax_mem, ax_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_mem.bar(names, [r.get("peak_bytes", 0) / GIB for r in results], color="tab:blue")
    ax_mem.set_ylabel("peak beyond inputs (GiB)")
    ax_time.bar(names, [r.get("timing", {}).get("median_s", 0) for r in results], color="tab:orange")
    ax_time.set_ylabel("fwd+bwd step, median (s)")
    for ax in (ax_mem, ax_time):
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(
        f"DPPO loss step, N={config['n']} H={config['hidden']} V={config['vocab']} {config['dtype']} {config['device']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

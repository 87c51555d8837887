"""Memory bandwidth of the DPPO loss kernels next to the device's measured copy bandwidth.

The op is memory-bound: the forward reads the logits once, the backward reads them once and writes
the gradient once. This script measures

* copy bandwidth: ``dst.copy_(src)`` of a large tensor, bytes = read + write;
* forward GB/s of ``torch.ops.dppo.dppo_loss_forward`` (bytes = logits read) and backward GB/s of
  ``dppo_loss_backward`` / ``dppo_loss_backward_`` (bytes = logits read + grad written), by default at
  N = 16384, V = 151936, bfloat16;
* for contrast, the eager ``dppo_ext.reference.dppo_loss_reference`` (forward, and forward + autograd
  backward) at a smaller N, next to our op at that same N.

Two timings per case: ``op`` is the wall time of the whole call between CUDA events (it includes the
input validation of checks.h, a few small reductions and host syncs); ``kernel`` is the device time
of the dppo kernels alone, from torch.profiler. The bandwidth targets (forward >= 75 %, backward
>= 80 % of copy bandwidth) are judged on ``kernel``. Medians over --iters runs after --warmup.

Each kernel row also carries a prediction: the bytes the kernel moves at these sizes (the CPU emulator's
count of its global-memory traffic, benchmarks/results/cuda_traffic.json: bytes per logit, per row and per
top-K id) over the copy bandwidth (bytes read + written). ``--predict`` prints only that, without a GPU,
at the H200's ~4.3 TB/s (``--copy-gbps``), in the columns the measured figures go in, labelled as such.

Usage (a GPU machine; scripts/gpu_check.sh runs it):
    python benchmarks/gpu_bandwidth.py [--n 16384] [--v 151936] [--dtype bf16] [--out results.json]
Predicted kernel times, no GPU needed:
    python benchmarks/gpu_bandwidth.py --predict [--copy-gbps 4300]
Smoke test without a GPU (tiny sizes, CPU kernels, no targets):
    python benchmarks/gpu_bandwidth.py --device cpu --n 64 --v 4096 --ref-n 32 --iters 2
Results are printed as a table and written as JSON to --out (default $OUT/gpu_bandwidth.json when
$OUT is set, else ./gpu_bandwidth.json).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import dppo_ext.ops  # noqa: F401  (loads the native library: registers torch.ops.dppo.*)
from dppo_ext.contract import TOPK_MODES

log = logging.getLogger("gpu_bandwidth")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TARGETS = {"forward": 0.75, "backward": 0.80}
TRAFFIC_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cuda_traffic.json")
# An H200's device-to-device copy bandwidth, bytes read + written, as the prediction's default (the measured
# copy_ bandwidth replaces it on a GPU).
H200_COPY_GBPS = 4300.0
# Benchmark case -> the row of cuda_traffic.json whose traffic it has (the entropy changes no byte moved).
TRAFFIC_OF = {
    "forward binary_tv entropy=True": ("forward", "binary_tv"),
    "forward binary_tv entropy=False": ("forward", "binary_tv"),
    "forward topk_kl entropy=True": ("forward", "topk_kl"),
    "backward (no entropy grad)": ("backward", "any"),
    "backward (with entropy grad)": ("backward + entropy grad", "any"),
    "backward_ in-place": ("backward in-place", "any"),
}


@dataclass
class Row:
    """One benchmark case: times in ms (medians), bandwidths in GB/s (1e9 bytes/s)."""

    name: str
    kind: str  # "copy" | "forward" | "backward" | "reference"
    n: int
    v: int
    bytes: int
    op_ms: float
    kernel_ms: Optional[float]
    op_gbps: float
    kernel_gbps: Optional[float]
    pct_of_copy: Optional[float]  # kernel GB/s (op GB/s when no kernel time) / copy GB/s
    target: Optional[float]
    meets_target: Optional[bool]
    predicted_ms: Optional[float] = None  # emulator-counted bytes / copy bandwidth (not measured)
    predicted_bytes: Optional[int] = None


def load_traffic(path: str = TRAFFIC_JSON) -> dict:
    """(kernel, mode, dtype) -> its bytes per logit, per row and per top-K id (cuda_traffic.json)."""
    with open(path) as f:
        doc = json.load(f)
    return {(r["kernel"], r["mode"], r["dtype"]): r for r in doc["rows"]}


def predicted_bytes(traffic: dict, case: str, n: int, v: int, k: int, dtype: str) -> Optional[int]:
    """Bytes the kernels of a benchmark case move at N x V (K top-K ids), from the emulator's counts."""
    kernel, mode = TRAFFIC_OF.get(case, (None, None))
    row = traffic.get((kernel, mode, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]))
    if row is None:
        return None
    topk = row["topk_bytes"] * n * k if "topk" in mode else 0
    return round(row["logit_bytes"] * n * v + row["row_bytes"] * n + topk)


def print_prediction(args) -> None:
    """The prediction alone (no GPU): each kernel case's bytes over the copy bandwidth (a memory-bound kernel's
    floor), and over the fraction of it the targets ask for."""
    traffic = load_traffic()
    gbps = args.copy_gbps or H200_COPY_GBPS
    print(
        f"\nDPPO loss kernels, PREDICTED (not measured): bytes the CPU emulator counts ({TRAFFIC_JSON}) over a "
        f"copy bandwidth of {gbps:,.0f} GB/s (read + write), dtype {args.dtype}, N={args.n}, V={args.v}, "
        f"K={args.k}\n"
    )
    hdr = f"{'case':44s} {'bytes':>9s} {'B/logit':>8s} {'kern ms':>8s} {'at target':>16s}"
    print(hdr + "   <- predicted, where a GPU run prints its measurement")
    print("-" * len(hdr))
    rows = []
    for case in TRAFFIC_OF:
        nbytes = predicted_bytes(traffic, case, args.n, args.v, args.k, args.dtype)
        ms = nbytes / gbps / 1e6
        kind = case.split()[0].rstrip("_")
        target = TARGETS[kind]
        rows.append(
            {
                "name": case,
                "predicted_bytes": nbytes,
                "predicted_ms": ms,
                "target": target,
                "predicted_ms_at_target": ms / target,
                "copy_gbps": gbps,
            }
        )
        print(
            f"{case:44s} {nbytes / 1e9:8.2f}G {nbytes / (args.n * args.v):8.3f} {ms:8.3f} "
            f"{ms / target:8.3f} ({100 * target:.0f}%)  (predicted)"
        )
    print(
        "\nkern ms: the bytes at the full copy bandwidth (the floor of a memory-bound kernel); at target: at the "
        "fraction of it the benchmark's targets ask for."
    )
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "gpu_bandwidth_predicted.json")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(
            {"predicted": True, "dtype": args.dtype, "n": args.n, "v": args.v, "k": args.k, "rows": rows}, f, indent=2
        )
    print(f"wrote {out_path}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median wall time of fn() in ms (CUDA events on a GPU, perf_counter on the CPU)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_kernels(fn: Callable[[], object], device: torch.device, iters: int, name_part: str) -> Optional[float]:
    """Mean device time per call (ms) of the CUDA kernels whose name contains name_part, measured
    with torch.profiler; None on the CPU or when the profiler records no such kernel."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            sync(device)
        events = prof.events()
    except RuntimeError as exc:  # no CUPTI, or a profiler already active
        log.warning("torch.profiler failed (%s): no kernel-only time", exc)
        return None
    total_us = 0.0
    found = False
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CUDA and name_part in evt.name:
            total_us += evt.time_range.elapsed_us()
            found = True
    return total_us / iters / 1e3 if found else None


def make_inputs(n: int, v: int, dtype: torch.dtype, device: torch.device, k: int, seed: int = 0) -> dict:
    """Random op inputs: logits [N, V] (dtype), tokens [N], rollout log-probs [N] (<= 0), advantages
    [N], top-K ids [N, K] and log-probs [N, K] (<= 0), all per-row tensors in float32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(n, v, dtype=dtype, device=device)
    for i in range(0, n, 1024):  # row chunks keep the fp32 temporary small
        rows = min(1024, n - i)
        logits[i : i + rows] = torch.randn(rows, v, generator=gen, device=device) * 2.0
    tokens = torch.randint(0, v, (n,), generator=gen, device=device)
    rollout = -torch.rand(n, generator=gen, device=device) * 5.0
    adv = torch.randn(n, generator=gen, device=device)
    topk_ids = torch.randint(0, v, (n, k), generator=gen, device=device)
    topk_lp = torch.log_softmax(torch.randn(n, k, generator=gen, device=device), dim=-1) - 0.5
    return dict(logits=logits, tokens=tokens, rollout=rollout, adv=adv, topk_ids=topk_ids, topk_lp=topk_lp)


def forward_call(x: dict, mode: str, entropy: bool) -> Callable[[], object]:
    topk = mode in TOPK_MODES
    return lambda: torch.ops.dppo.dppo_loss_forward(
        x["logits"],
        x["tokens"],
        x["rollout"],
        x["adv"],
        x["topk_ids"] if topk else None,
        x["topk_lp"] if topk else None,
        None,
        mode,
        1.0,
        0.2,
        0.2,
        10.0,
        entropy,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384, help="rows (response tokens)")
    ap.add_argument("--v", type=int, default=151936, help="vocabulary size")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--k", type=int, default=20, help="top-K width of the topk_kl case")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--copy-gib", type=float, default=4.0, help="size of the copied tensor (GiB)")
    ap.add_argument("--ref-n", type=int, default=1024, help="rows for the eager-reference contrast (0: skip)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument(
        "--predict", action="store_true", help="print the predicted kernel times only (no GPU, no kernel runs)"
    )
    ap.add_argument(
        "--copy-gbps",
        type=float,
        default=None,
        help=f"copy bandwidth (GB/s, read + write) for the prediction (default: the measured one on a "
        f"GPU, {H200_COPY_GBPS:g} with --predict)",
    )
    args = ap.parse_args()
    if args.predict:
        print_prediction(args)
        return
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to torch; use --device cpu for a smoke test")
    dtype = DTYPES[args.dtype]
    out_path = args.out or os.path.join(os.environ.get("OUT", "."), "gpu_bandwidth.json")
    esize = torch.empty((), dtype=dtype).element_size()
    rows: list[Row] = []
    traffic = load_traffic()

    def add(name, kind, n, v, nbytes, op_ms, kernel_ms, copy_gbps):
        op_gbps = nbytes / op_ms / 1e6
        kernel_gbps = nbytes / kernel_ms / 1e6 if kernel_ms else None
        best = kernel_gbps if kernel_gbps is not None else op_gbps
        pct = best / copy_gbps if copy_gbps else None
        target = TARGETS.get(kind) if device.type == "cuda" else None
        meets = (pct >= target) if (target is not None and pct is not None and kernel_gbps is not None) else None
        pbytes = predicted_bytes(traffic, name, n, v, args.k, args.dtype) if kind != "copy" else None
        pms = pbytes / (args.copy_gbps or copy_gbps) / 1e6 if pbytes is not None and copy_gbps else None
        rows.append(
            Row(name, kind, n, v, nbytes, op_ms, kernel_ms, op_gbps, kernel_gbps, pct, target, meets, pms, pbytes)
        )

    # Copy bandwidth: bytes = read + write.
    numel = int(args.copy_gib * 2**30) // 4
    src = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = time_op(functools.partial(dst.copy_, src), device, args.iters, args.warmup)
    copy_gbps = 2 * src.numel() * 4 / copy_ms / 1e6
    add("copy_", "copy", 0, 0, 2 * src.numel() * 4, copy_ms, None, copy_gbps)
    del src, dst

    n, v = args.n, args.v
    x = make_inputs(n, v, dtype, device, args.k)
    read = n * v * esize
    for mode, entropy in (("binary_tv", True), ("binary_tv", False), ("topk_kl", True)):
        fn = forward_call(x, mode, entropy)
        add(
            f"forward {mode} entropy={entropy}",
            "forward",
            n,
            v,
            read,
            time_op(fn, device, args.iters, args.warmup),
            time_kernels(fn, device, args.iters, "dppo_loss_forward"),
            copy_gbps,
        )

    outs = forward_call(x, "binary_tv", True)()
    lse, ent = outs[6], outs[5]
    gt = torch.randn(n, device=device)
    gh = torch.randn(n, device=device) * 0.01
    # The timed calls bind their tensors (functools.partial), so that `del` below frees them all at once.
    backward = functools.partial(torch.ops.dppo.dppo_loss_backward, gt)
    for name, fn in (
        ("backward (no entropy grad)", functools.partial(backward, None, x["logits"], x["tokens"], lse, None, 1.0)),
        ("backward (with entropy grad)", functools.partial(backward, gh, x["logits"], x["tokens"], lse, ent, 1.0)),
    ):
        add(
            name,
            "backward",
            n,
            v,
            2 * read,
            time_op(fn, device, args.iters, args.warmup),
            time_kernels(fn, device, args.iters, "dppo_loss_backward"),
            copy_gbps,
        )
    # In place last: it overwrites the logits with gradients (the bytes moved are the same).
    fn = functools.partial(torch.ops.dppo.dppo_loss_backward_, gt, None, x["logits"], x["tokens"], lse, None, 1.0)
    add(
        "backward_ in-place",
        "backward",
        n,
        v,
        2 * read,
        time_op(fn, device, args.iters, args.warmup),
        time_kernels(fn, device, args.iters, "dppo_loss_backward"),
        copy_gbps,
    )
    del x, outs, lse, ent, fn
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if args.ref_n > 0:
        try:
            from dppo_ext.reference import dppo_loss_reference
        except ImportError as exc:
            print(f"(eager reference not importable: {exc})")
        else:
            rn = args.ref_n
            y = make_inputs(rn, v, dtype, device, args.k, seed=1)
            rread = rn * v * esize
            fn = forward_call(y, "binary_tv", True)
            add(
                f"ours forward binary_tv (N={rn})",
                "forward",
                rn,
                v,
                rread,
                time_op(fn, device, args.iters, args.warmup),
                time_kernels(fn, device, args.iters, "dppo_loss_forward"),
                copy_gbps,
            )

            def ours_fwd_bwd():
                o = fn()
                torch.ops.dppo.dppo_loss_backward(o[0], None, y["logits"], y["tokens"], o[6], None, 1.0)

            add(
                f"ours fwd+bwd binary_tv (N={rn})",
                "reference",
                rn,
                v,
                3 * rread,
                time_op(ours_fwd_bwd, device, args.iters, args.warmup),
                None,
                copy_gbps,
            )

            def ref_fwd():
                with torch.no_grad():
                    return dppo_loss_reference(y["logits"], y["tokens"], y["rollout"], y["adv"], mode="binary_tv")

            def ref_fwd_bwd():
                logits = y["logits"].detach().requires_grad_(True)
                out = dppo_loss_reference(logits, y["tokens"], y["rollout"], y["adv"], mode="binary_tv")
                out["loss"].sum().backward()

            add(
                f"reference forward binary_tv (N={rn})",
                "reference",
                rn,
                v,
                rread,
                time_op(ref_fwd, device, args.iters, args.warmup),
                None,
                copy_gbps,
            )
            add(
                f"reference fwd+bwd binary_tv (N={rn})",
                "reference",
                rn,
                v,
                3 * rread,
                time_op(ref_fwd_bwd, device, args.iters, args.warmup),
                None,
                copy_gbps,
            )

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nDPPO loss bandwidth on {name}, torch {torch.__version__}, dtype {args.dtype}, N={n}, V={v}")
    print(f"copy bandwidth (copy_ of {args.copy_gib:g} GiB fp32, read + write): {copy_gbps:,.0f} GB/s\n")
    hdr = (
        f"{'case':44s} {'bytes':>9s} {'op ms':>8s} {'op GB/s':>9s} {'kern ms':>8s} {'kern GB/s':>9s} {'% copy':>7s} "
        f"{'target':>7s} {'pred ms':>8s}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows[1:]:
        kms = f"{r.kernel_ms:8.3f}" if r.kernel_ms is not None else f"{'-':>8s}"
        kgb = f"{r.kernel_gbps:9,.0f}" if r.kernel_gbps is not None else f"{'-':>9s}"
        pct = f"{100 * r.pct_of_copy:6.1f}%" if r.pct_of_copy is not None else f"{'-':>7s}"
        tgt = "" if r.target is None else (f">={100 * r.target:.0f}% " + ("ok" if r.meets_target else "MISS"))
        pms = f"{r.predicted_ms:8.3f}" if r.predicted_ms is not None else f"{'-':>8s}"
        print(f"{r.name:44s} {r.bytes / 1e9:8.2f}G {r.op_ms:8.3f} {r.op_gbps:9,.0f} {kms} {kgb} {pct} {tgt:>7s} {pms}")
    print(
        "(pred ms: predicted from the emulator-counted bytes (benchmarks/results/cuda_traffic.json) and the copy "
        "bandwidth above; not measured)"
    )
    result = {
        "device": name,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "n": n,
        "v": v,
        "copy_gbps": copy_gbps,
        "targets": TARGETS,
        "rows": [asdict(r) for r in rows],
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()

"""Benchmark the fused DPPO loss against the naive reference: time, measured memory peaks, scaling.

One run compares, on the same inputs, ``dppo_ext.dppo_loss`` (plain and ``inplace_backward``),
the eager full-vocabulary reference, ``torch.compile`` of that reference and, on a GPU with
``liger_kernel`` installed, Liger Kernel's Triton GRPO loss. Sections:

- ``validate``: the CPU peak-memory method measures known allocations (1 GiB in one block and in
  64 blocks of 16 MiB) correctly.
- ``speed``: every mode x dtype at one size (default N=2048, V=32768, K=20): forward, backward
  and forward+backward timed separately, warm-up then the median of ``--repeats`` steps (fused)
  or ``--baseline-repeats`` steps (eager, compile, Liger); one copy pass over the same logits is
  timed before every step, so each phase also reports its achieved GB/s and its multiple of a copy.
- ``memory``: the stated memory point (default N=4096, V=151936, bf16, topk_kl): each contender in
  a fresh process, its step's measured peak beyond the inputs and the returned gradient, and time.
- ``scaling``: extra memory and time as N grows (V fixed) and as V grows (N fixed), each point in
  a fresh process, for the fused op (plain and in-place) and the eager reference.

Results go to ``--out-dir`` (default benchmarks/results/, or artifacts/bench_loss_quick/ with ``--quick`` so
that a smoke test never overwrites the committed figures): ``bench_loss.json`` (every figure and the machine),
``bench_loss.csv`` (one row per contender and case), ``bench_loss.png`` (time and memory vs N and vs V, log
scale) and ``README_table.md`` (the tables for the README).

    python benchmarks/bench_loss.py                 # the default suite (< 10 min on 2 CPU cores)
    python benchmarks/bench_loss.py --quick         # tiny sizes: a harness smoke test (153 s on 2 busy AVX2 cores)
    python benchmarks/bench_loss.py --device cuda   # on a GPU (adds GB/s and Liger when installed)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import report  # noqa: E402
from benchlib import contenders, inputs, machine, peak_memory, timing  # noqa: E402

log = logging.getLogger("bench_loss")

SECTIONS = ("validate", "speed", "memory", "scaling")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        """Keeps the module docstring's layout and shows every default."""

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--sections", type=_names, default=list(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument(
        "--out-dir",
        default=None,
        help="default: benchmarks/results/ (the committed figures); artifacts/bench_loss_quick/ with --quick",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes and repeats: checks the harness, not the op")
    p.add_argument(
        "--large",
        action="store_true",
        help="larger scaling sizes (N up to 32768; compile in every scaling point); needs ~40 GiB",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topk", type=int, default=20, help="K of the top-K modes (default 20, vLLM's default)")
    p.add_argument(
        "--no-entropy",
        dest="entropy",
        action="store_false",
        help="compute_entropy=False for every contender (default: True, the API's default)",
    )
    g = p.add_argument_group("speed section")
    g.add_argument("--modes", type=_names, default=list(inputs.MODES))
    g.add_argument("--dtypes", type=_names, default=["float32", "bfloat16"])
    g.add_argument(
        "--contenders",
        type=_names,
        default=list(contenders.ALL_CONTENDERS),
        help="contenders to run (those that cannot run here are skipped with the reason)",
    )
    g.add_argument("--speed-n", type=int, default=2048)
    g.add_argument("--speed-v", type=int, default=32768)
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--repeats", type=int, default=5, help="timed steps of the fused contenders")
    g.add_argument(
        "--baseline-repeats", type=int, default=3, help="timed steps of the slow baselines (eager, compile, Liger)"
    )
    g = p.add_argument_group("memory section (the stated memory point)")
    g.add_argument("--memory-n", type=int, default=4096)
    g.add_argument("--memory-v", type=int, default=151936)
    g.add_argument("--memory-dtype", default="bfloat16")
    g.add_argument("--memory-modes", type=_names, default=["topk_kl"])
    g.add_argument(
        "--memory-repeats", type=int, default=2, help="warm timed steps after the measured (cold) one, per process"
    )
    g = p.add_argument_group("scaling section")
    g.add_argument("--scaling-n", type=_ints, default=[1024, 2048, 4096, 8192, 16384])
    g.add_argument("--scaling-fixed-v", type=int, default=32768, help="V while N varies")
    g.add_argument("--scaling-v", type=_ints, default=[32768, 131072, 151936])
    g.add_argument("--scaling-fixed-n", type=int, default=4096, help="N while V varies")
    g.add_argument("--scaling-mode", default="topk_kl")
    g.add_argument("--scaling-dtype", default="bfloat16")
    g.add_argument("--scaling-contenders", type=_names, default=["fused", "fused_inplace", "eager"])
    g.add_argument(
        "--scaling-repeats", type=int, default=2, help="warm timed steps after the measured (cold) one, per process"
    )
    p.add_argument("--child-timeout", type=float, default=900.0, help="seconds allowed to one child process")
    p.add_argument(
        "--mem-guard",
        type=float,
        default=1.0,
        help="skip a case when MemAvailable < guard x a rough need (protects a shared machine)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"--sections got {sorted(unknown)}; expected names from {SECTIONS}")
    for name in args.modes + args.memory_modes + [args.scaling_mode]:
        if name not in inputs.MODES:
            p.error(f"mode {name!r} is not one of {inputs.MODES}")
    for name in args.dtypes + [args.memory_dtype, args.scaling_dtype]:
        if name not in inputs.DTYPES:
            p.error(f"dtype {name!r} is not one of {tuple(inputs.DTYPES)}")
    for name in args.contenders + args.scaling_contenders:
        if name not in contenders.ALL_CONTENDERS:
            p.error(f"contender {name!r} is not one of {contenders.ALL_CONTENDERS}")
    if args.out_dir is None:  # a harness smoke test never overwrites the committed results
        here = os.path.dirname(os.path.abspath(__file__))
        args.out_dir = (
            os.path.join(os.path.dirname(here), "artifacts", "bench_loss_quick")
            if args.quick
            else os.path.join(here, "results")
        )
    if args.quick:
        args.speed_n, args.speed_v, args.repeats, args.baseline_repeats = 256, 4096, 3, 2
        args.memory_n, args.memory_v = 512, 16384
        args.scaling_n, args.scaling_fixed_v = [256, 512, 1024], 8192
        args.scaling_v, args.scaling_fixed_n = [4096, 16384], 512
        args.memory_repeats = 1
    if args.large:
        args.scaling_n = sorted(set(args.scaling_n) | {32768})
        args.scaling_contenders = sorted(set(args.scaling_contenders) | {"compile"})
    return args


# ----------------------------------------------------------------------------------------------
# Child process: one case, measured peak + time
# ----------------------------------------------------------------------------------------------


def _calibrate(pattern: str, device: str) -> dict:
    """Measure a known allocation pattern with the same meter the cases use (expected: 1 GiB)."""
    with peak_memory.PeakMeter(device) as meter:
        if pattern == "one_1gib":
            block = torch.ones(peak_memory.GIB // 4, device=device)
            del block
        elif pattern == "64x16mib":
            blocks = [torch.ones(16 * peak_memory.MIB // 4, device=device) for _ in range(64)]
            del blocks
            half = torch.ones(peak_memory.GIB // 8, device=device)  # freed memory must not hide a later peak
            del half
        else:
            raise ValueError(f"unknown calibration pattern {pattern!r}")
    return {"expected_bytes": peak_memory.GIB, "measured_bytes": meter.delta, "ratio": meter.delta / peak_memory.GIB}


def child_main(case: dict) -> dict:
    """Run one case in this (fresh) process: warm up, measure one step's peak, then time more steps."""
    device = case["device"]
    if case["kind"] == "calibrate":
        return _calibrate(case["pattern"], device)
    dtype = inputs.DTYPES[case["dtype"]]
    contender = contenders.build_contender(case["contender"], case["mode"], device, case.get("compute_entropy", True))
    if case["contender"] != "compile":
        small = inputs.make_inputs(min(case["n"], 64), case["v"], case["k"], case["mode"], dtype, device, case["seed"])
        small_leaf = contender.make_leaf(small)
        timing.step(contender, small, small_leaf, device)
        del small, small_leaf
    inp = inputs.make_inputs(case["n"], case["v"], case["k"], case["mode"], dtype, device, case["seed"])
    leaf = contender.make_leaf(inp)
    if case["contender"] == "compile":
        timing.step(contender, inp, leaf, device)  # compiles for this exact shape
    repeats = case["repeats"]
    pristine = inp.logits.detach().clone() if contender.consumes_logits and repeats else None
    inputs_bytes = inp.nbytes() + (leaf.numel() * leaf.element_size() if leaf is not inp.logits else 0)
    with peak_memory.PeakMeter(device) as meter:
        res = timing.step(contender, inp, leaf, device)
    grad_aliases_leaf = res.grad.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
    grad_bytes = 0 if grad_aliases_leaf else res.grad.numel() * res.grad.element_size()
    # The measured step is this process's first at full size (cold: first-touch of pools and
    # thread start-up), so it is timed only when no warm step follows.
    cold = timing.Timing([res.fwd_s], [res.bwd_s])
    warm = timing.Timing([], [])
    del res
    for _ in range(repeats):
        if contender.consumes_logits:
            timing.restore_logits(leaf, pristine)
        extra = timing.step(contender, inp, leaf, device)
        warm.fwd.append(extra.fwd_s)
        warm.bwd.append(extra.bwd_s)
        del extra
    out = {
        "inputs_bytes": inputs_bytes,
        "grad_bytes": grad_bytes,
        "grad_aliases_logits": grad_aliases_leaf,
        "step_peak_bytes": meter.delta,
        "extra_bytes": meter.delta - grad_bytes,
        "whole_peak_ratio": (inputs_bytes + meter.delta) / inputs_bytes,
        "baseline_bytes": meter.base,
        "memory_method": "cuda max_memory_allocated" if device.startswith("cuda") else "VmHWM-VmRSS (clear_refs)",
        "contender_note": contender.note,
    }
    out.update((warm if repeats else cold).summary())
    out["cold_total_ms"] = 1e3 * cold.total[0]
    return out


def run_case_in_child(case: dict, timeout: float) -> dict:
    """Run ``case`` in a fresh process; the child's result, or a record of why it failed."""
    script = os.path.abspath(__file__)
    try:
        rc, stdout, stderr = peak_memory.run_child([script, "--child", json.dumps(case)], timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if rc != 0 or not lines:
        reason = "killed (out of memory?)" if rc in (-9, 137) else f"exit code {rc}"
        return {"status": f"failed: {reason}: {stderr.strip().splitlines()[-1:] if stderr.strip() else ''}"}
    return json.loads(lines[-1][len("RESULT ") :])


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


def _base_record(section: str, contender: str, mode: str, dtype: str, n: int, v: int, k: int) -> dict:
    return {
        "section": section,
        "contender": contender,
        "mode": mode,
        "dtype": dtype,
        "N": n,
        "V": v,
        "K": k if mode in inputs.TOPK_MODES else 0,
    }


def run_validate(args: argparse.Namespace) -> list[dict]:
    """Show the peak meter reads a known 1 GiB allocation as ~1 GiB."""
    out = []
    for pattern in ("one_1gib", "64x16mib"):
        res = run_case_in_child({"kind": "calibrate", "pattern": pattern, "device": args.device}, args.child_timeout)
        res.update(section="validate", pattern=pattern)
        log.info(
            "memory meter on %s: expected %.3f GiB, measured %s",
            pattern,
            1.0,
            f"{res['measured_bytes'] / peak_memory.GIB:.3f} GiB" if "measured_bytes" in res else res.get("status"),
        )
        out.append(res)
    return out


def _speed_order(names: list[str]) -> list[str]:
    """Eager first: its gradient is the reference the others are checked against."""
    return sorted(names, key=lambda c: (c != "eager", contenders.ALL_CONTENDERS.index(c)))


def run_speed(args: argparse.Namespace, progress) -> list[dict]:
    """Time every contender on every mode x dtype at the speed size, in this process.

    Before every timed step a copy pass over the same logits is timed too (``timing.CopyPass``), so each record
    carries its phases' GB/s and multiples of a copy pass measured beside them.
    """
    out = []
    n, v, k = args.speed_n, args.speed_v, args.topk
    for mode in args.modes:
        for dtype_name in args.dtypes:
            dtype = inputs.DTYPES[dtype_name]
            inp = inputs.make_inputs(n, v, k, mode, dtype, args.device, args.seed)
            pristine = inp.logits.detach().clone()
            copy_pass = timing.CopyPass(inp.logits, args.device)
            logits_bytes = inp.logits.numel() * inp.logits.element_size()
            ref_grad, ref_loss = None, None
            for name in _speed_order(args.contenders):
                progress.set_postfix_str(f"speed {mode} {dtype_name} {name}")
                rec = _base_record("speed", name, mode, dtype_name, n, v, k)
                try:
                    contender = contenders.build_contender(name, mode, args.device, args.entropy)
                    leaf = contender.make_leaf(inp)
                    repeats = args.repeats if name.startswith("fused") else args.baseline_repeats
                    times, first = timing.time_contender(
                        contender, inp, leaf, args.device, args.warmup, repeats, pristine, copy_pass
                    )
                except contenders.ContenderUnavailable as exc:
                    rec["status"] = f"skipped: {exc}"
                    out.append(rec)
                    continue
                finally:
                    timing.restore_logits(inp.logits, pristine)
                rec.update(status="ok", note=contender.note, **times.summary(logits_bytes))
                rec["loss"] = float(first.loss)
                if name == "eager":
                    ref_grad, ref_loss = first.grad, first.loss
                elif ref_grad is not None and first.grad.shape == ref_grad.shape:
                    rec["check_loss_abs_diff_vs_eager"] = abs(float(first.loss) - float(ref_loss))
                    rec["check_grad_max_abs_diff_vs_eager"] = float((first.grad.float() - ref_grad.float()).abs().max())
                out.append(rec)
                log.info(
                    "%-9s %-8s %-14s fwd %8.2f ms (%4.2fx copy)  bwd %8.2f ms (%4.2fx)  fwd+bwd %8.2f ms (%4.2fx)"
                    "  copy %7.2f ms",
                    mode,
                    dtype_name,
                    name,
                    rec["fwd_ms"],
                    rec["fwd_x_copy"],
                    rec["bwd_ms"],
                    rec["bwd_x_copy"],
                    rec["total_ms"],
                    rec["total_x_copy"],
                    rec["copy_ms"],
                )
                del first, leaf, contender
            del inp, pristine, ref_grad, copy_pass
            progress.update(1)
    return out


def _rough_need_bytes(contender: str, n: int, v: int, dtype: torch.dtype) -> int:
    """A generous upper bound of a case's memory, used only to avoid starting a case that cannot fit."""
    logits = n * v * torch.empty((), dtype=dtype).element_size()
    if contender in ("eager", "compile"):
        return logits * 2 + n * v * 4 * 5
    return logits * 3


def run_children(args: argparse.Namespace, cases: list[dict], progress) -> dict[tuple, dict]:
    """Run each distinct child case once; results keyed by (contender, mode, dtype, N, V)."""
    results: dict[tuple, dict] = {}
    for case in cases:
        key = (case["contender"], case["mode"], case["dtype"], case["n"], case["v"])
        if key in results:
            continue
        progress.set_postfix_str(f"{case['contender']} {case['mode']} {case['dtype']} N={case['n']} V={case['v']}")
        need = _rough_need_bytes(case["contender"], case["n"], case["v"], inputs.DTYPES[case["dtype"]])
        available = peak_memory.mem_available()
        if args.device == "cpu" and available < args.mem_guard * need:
            res = {
                "status": f"skipped: needs ~{need / peak_memory.GIB:.1f} GiB, "
                f"{available / peak_memory.GIB:.1f} GiB available"
            }
        else:
            res = run_case_in_child(case, args.child_timeout)
            res.setdefault("status", "ok")
        results[key] = res
        if res["status"] == "ok":
            log.info(
                "%-14s %-8s %-8s N=%-6d V=%-6d extra %10.1f MiB  peak/inputs %.3f  fwd+bwd %9.1f ms",
                case["contender"],
                case["mode"],
                case["dtype"],
                case["n"],
                case["v"],
                res["extra_bytes"] / peak_memory.MIB,
                res["whole_peak_ratio"],
                res["total_ms"],
            )
        else:
            log.warning("%s: %s", key, res["status"])
        progress.update(1)
    return results


def _child_case(args: argparse.Namespace, contender: str, mode: str, dtype: str, n: int, v: int, repeats: int) -> dict:
    return {
        "kind": "loss",
        "device": args.device,
        "contender": contender,
        "mode": mode,
        "dtype": dtype,
        "n": n,
        "v": v,
        "k": args.topk,
        "seed": args.seed,
        "repeats": repeats,
        "compute_entropy": args.entropy,
    }


def plan_children(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """The memory-section cases and the scaling-section cases (duplicates run once)."""
    memory, scaling = [], []
    cpu_like = [c for c in args.contenders if args.device.startswith("cuda") or c in contenders.CPU_CONTENDERS]
    if "memory" in args.sections:
        for mode in args.memory_modes:
            for name in cpu_like:
                memory.append(
                    _child_case(args, name, mode, args.memory_dtype, args.memory_n, args.memory_v, args.memory_repeats)
                )
    if "scaling" in args.sections:
        for name in args.scaling_contenders:
            for n in args.scaling_n:
                scaling.append(
                    _child_case(
                        args, name, args.scaling_mode, args.scaling_dtype, n, args.scaling_fixed_v, args.scaling_repeats
                    )
                )
            for v in args.scaling_v:
                scaling.append(
                    _child_case(
                        args, name, args.scaling_mode, args.scaling_dtype, args.scaling_fixed_n, v, args.scaling_repeats
                    )
                )
    return memory, scaling


def child_records(section: str, cases: list[dict], results: dict[tuple, dict], args: argparse.Namespace) -> list[dict]:
    """Records of a child section, with each contender's extra memory as a ratio to the naive one."""
    out = []
    for case in cases:
        key = (case["contender"], case["mode"], case["dtype"], case["n"], case["v"])
        rec = _base_record(section, case["contender"], case["mode"], case["dtype"], case["n"], case["v"], args.topk)
        if section == "scaling":
            rec["axis"] = "N" if case["v"] == args.scaling_fixed_v and case["n"] in args.scaling_n else "V"
        rec.update(results[key])
        naive = results.get(("eager",) + key[1:], {})
        if rec.get("status") == "ok" and naive.get("status") == "ok" and naive["extra_bytes"] > 0:
            rec["extra_ratio_to_naive"] = rec["extra_bytes"] / naive["extra_bytes"]
        out.append(rec)
    if section == "scaling":
        # A point on both axes (e.g. N=4096, V=32768) appears once per axis.
        both = [
            dict(r, axis="V")
            for r in out
            if r["axis"] == "N" and r["N"] == args.scaling_fixed_n and r["V"] in args.scaling_v
        ]
        out.extend(both)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.child:
        try:
            result = child_main(json.loads(args.child))
        except contenders.ContenderUnavailable as exc:
            result = {"status": f"skipped: {exc}"}
        except Exception as exc:  # the parent records why the case failed instead of losing the run
            traceback.print_exc()
            result = {"status": f"failed: {type(exc).__name__}: {exc}"}
        print("RESULT " + json.dumps(result), flush=True)
        return 0

    from tqdm import tqdm

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    started = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    results = {
        "machine": machine.machine_info(args.device),
        "config": {k: v for k, v in vars(args).items() if k != "child"},
        "records": [],
    }
    log.info("machine: %s", results["machine"])
    memory_cases, scaling_cases = plan_children(args)
    n_speed = len(args.modes) * len(args.dtypes) if "speed" in args.sections else 0
    distinct = {(c["contender"], c["mode"], c["dtype"], c["n"], c["v"]) for c in memory_cases + scaling_cases}
    with tqdm(total=n_speed + len(distinct), desc="bench_loss", unit="case", file=sys.stderr) as progress:
        if "validate" in args.sections and args.device == "cpu":
            results["validation"] = run_validate(args)
        if "speed" in args.sections:
            results["records"] += run_speed(args, progress)
        child_results = run_children(args, memory_cases + scaling_cases, progress)
    results["records"] += child_records("memory", memory_cases, child_results, args)
    results["records"] += child_records("scaling", scaling_cases, child_results, args)
    results["checks"] = report.checks(results)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["machine"]["wall_s"] = round(time.time() - started, 1)
    paths = report.write_all(results, args.out_dir)
    print(report.markdown(results))
    log.info("wrote %s in %.0f s", ", ".join(paths), time.time() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())

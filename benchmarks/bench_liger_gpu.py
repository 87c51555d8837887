"""Liger Kernel's GRPO losses and ours on the same inputs, in one process: time and peak memory of one loss step.

One step = forward + backward of the scalar loss with respect to ``hidden [B, T, H]`` and the LM-head
``weight [V, H]`` (both require grad, the LM-head product included). Every contender gets the same hidden, weight,
sampled token ids ``[B, T]``, old log-probs ``[B, T]`` and advantages ``[B]``:

  dppo_fused_linear   dppo_ext.fused_linear_dppo_loss (binary_tv, token-mean): the logits never exist as [N, V]
  dppo_logits         logits = hidden @ weight.T, then dppo_ext.dppo_loss(..., inplace_backward=True)
  liger_triton        the same logits product, then liger_kernel's triton_grpo_loss (its Triton kernel, in place as
                      by its default); Liger drops each sequence's last position, so its hidden has T + 1 positions
                      (the extra one zero, its gradient ignored)
  liger_fused_linear  liger_kernel's LigerFusedLinearGRPOLoss (chunked LM head, its loss math under torch.compile, as
                      by its default)

Both Liger losses run with loss_type "dapo" (the token mean over the batch, as ours), beta 0 (no reference model)
and the clip 0.2 / 0.28; ours with compute_entropy=False (Liger computes no entropy). They are GRPO ratio clips, not
DPPO's divergence mask: the figures compare what one step of each library's loss costs, not the losses. As a check
that each pair was fed alike, the weight gradients of the two paths of each library are compared (they compute the
same loss two ways).

Time: CUDA events around each step, the median over ``--repeats`` steps after ``--warmup`` (the first call, with
Liger's compile and Triton's autotuning, is reported on its own). Peak memory: ``torch.cuda.max_memory_allocated()``
during one step, minus the bytes allocated before it (the returned gradients included).

    python benchmarks/bench_liger_gpu.py --json liger.json              # a GPU with liger_kernel installed
    python benchmarks/bench_liger_gpu.py --device cpu --shapes 2x8x32x256 --repeats 1   # smoke test, no GPU

Without CUDA (``--device cuda``, the default) it says so and exits 0 without timing; without liger_kernel it times
ours and names the Liger contenders unavailable (exit 1 with ``--require-liger``, as scripts/gpu_check.sh runs it).
``--budget-s`` skips the contenders that would start after that many seconds; the JSON is rewritten after each one.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Callable, Optional

import torch

log = logging.getLogger("bench_liger_gpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# B x T x H x V: the fused-linear benchmark's small and target sizes (benchmarks/bench_fused_linear.py), N = B * T.
DEFAULT_SHAPES = ("4x512x512x32768", "16x512x2048x151936")
CONTENDERS = ("dppo_fused_linear", "dppo_logits", "liger_triton", "liger_fused_linear")
EPS_LOW, EPS_HIGH = 0.2, 0.28
MIB = 1024**2


class Unavailable(RuntimeError):
    """The contender cannot run here; the message says why."""


@dataclass
class Inputs:
    """One shape's inputs, shared by every contender."""

    hidden: torch.Tensor  # [B, T, H], requires grad
    weight: torch.Tensor  # [V, H], requires grad
    tokens: torch.Tensor  # [B, T] int64, sampled from the policy
    old_logprobs: torch.Tensor  # [B, T] float32: the tokens' log-probs plus N(0, 0.3) noise, <= 0
    advantages: torch.Tensor  # [B] float32


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"a shape is BxTxHxV with positive integers, e.g. 4x512x512x32768; got {text!r}"
        )
    b, t, h, v = (int(p) for p in parts)
    return b, t, h, v


def make_inputs(b: int, t: int, h: int, v: int, dtype: torch.dtype, device: str, seed: int = 0) -> Inputs:
    """Random hidden states and weight (logits of std ~2), tokens sampled from the softmax, noisy old log-probs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=gen, device=device) * (2.0 / h**0.5)).to(dtype)
    flat = hidden.view(-1, h)
    tokens = torch.empty(b * t, dtype=torch.long, device=device)
    logprobs = torch.empty(b * t, dtype=torch.float32, device=device)
    rows = max(1, (1 << 26) // v)  # a float32 [rows, V] block of at most 256 MiB at a time
    for start in range(0, b * t, rows):
        logp = torch.log_softmax((flat[start : start + rows] @ weight.T).float(), dim=-1)
        ids = torch.multinomial(logp.exp(), 1, generator=gen)
        tokens[start : start + rows] = ids[:, 0]
        logprobs[start : start + rows] = logp.gather(-1, ids)[:, 0]
    noise = 0.3 * torch.randn(b * t, generator=gen, device=device)
    old = (logprobs + noise).clamp(max=0.0).view(b, t)
    advantages = torch.randn(b, generator=gen, device=device)
    return Inputs(hidden.requires_grad_(), weight.requires_grad_(), tokens.view(b, t), old, advantages)


StepFn = Callable[[], torch.Tensor]


def build_step(name: str, inp: Inputs, device: str) -> tuple[StepFn, torch.Tensor]:
    """The contender's loss function (returns the scalar loss with its graph) and the hidden leaf it reads."""
    common = {"mode": "binary_tv", "compute_entropy": False}
    if name == "dppo_fused_linear":
        from dppo_ext import fused_linear_dppo_loss

        def fused_linear() -> torch.Tensor:
            return fused_linear_dppo_loss(
                inp.hidden, inp.weight, inp.tokens, inp.old_logprobs, inp.advantages, **common
            )[0]

        return fused_linear, inp.hidden
    if name == "dppo_logits":
        from dppo_ext import dppo_loss

        def logits_path() -> torch.Tensor:
            logits = inp.hidden @ inp.weight.T
            return dppo_loss(logits, inp.tokens, inp.old_logprobs, inp.advantages, inplace_backward=True, **common)[0]

        return logits_path, inp.hidden
    if name == "liger_triton":
        if not device.startswith("cuda"):
            raise Unavailable("Liger's Triton GRPO loss runs on CUDA only")
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss
        except ImportError as exc:
            raise Unavailable(f"liger_kernel is not installed ({exc})") from exc
        # Liger reads logits [B, T + 1, V] and drops the last position: one zero position more per sequence.
        pad = torch.zeros_like(inp.hidden[:, :1])
        hidden = torch.cat([inp.hidden.detach(), pad], dim=1).requires_grad_()

        def liger_triton() -> torch.Tensor:
            logits = hidden @ inp.weight.T
            return triton_grpo_loss(
                logits,
                inp.old_logprobs,
                None,
                inp.tokens,
                inp.advantages,
                temperature=1.0,
                beta=0.0,
                eps_low=EPS_LOW,
                eps_high=EPS_HIGH,
                loss_type="dapo",
                reduce=True,
            )[0]

        return liger_triton, hidden
    if name == "liger_fused_linear":
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except ImportError as exc:
            raise Unavailable(f"liger_kernel is not installed ({exc})") from exc
        module = LigerFusedLinearGRPOLoss(
            beta=0.0, use_ref_model=False, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH, loss_type="dapo"
        )
        attention_mask = torch.ones_like(inp.tokens)

        def liger_fused_linear() -> torch.Tensor:
            return module(
                inp.hidden,
                inp.weight,
                inp.tokens,
                attention_mask,
                inp.advantages,
                old_per_token_logps=inp.old_logprobs,
            )[0]

        return liger_fused_linear, inp.hidden
    raise ValueError(f"unknown contender {name!r}; expected one of {CONTENDERS}")


class Clock:
    """Seconds of device work between two points: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def time(self, fn: Callable[[], object]) -> tuple[float, object]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def run_contender(name: str, inp: Inputs, device: str, warmup: int, repeats: int) -> dict:
    """Time one contender: the first call, then ``repeats`` steps after ``warmup``; its peak memory; its grads."""
    loss_fn, hidden = build_step(name, inp, device)
    clock = Clock(device)

    def one_step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        loss = loss_fn()
        grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, inp.weight])
        return loss.detach(), grad_hidden, grad_weight

    first_s, (loss, _, grad_weight) = clock.time(one_step)
    for _ in range(warmup):
        clock.time(one_step)
    times = [clock.time(one_step)[0] for _ in range(repeats)]
    record = {
        "contender": name,
        "first_call_s": round(first_s, 4),
        "step_ms": 1e3 * statistics.median(times),
        "step_reps_ms": [round(1e3 * s, 3) for s in times],
        "loss": float(loss),
    }
    if device.startswith("cuda"):
        del grad_weight
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        _, _, grad_weight = one_step()
        torch.cuda.synchronize()
        record["peak_extra_mib"] = (torch.cuda.max_memory_allocated() - before) / MIB
    record["_grad_weight"] = grad_weight.float()
    return record


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: how far apart two computations of the same gradient are."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def bench_shape(
    shape: tuple[int, int, int, int], args: argparse.Namespace, deadline: float, out: dict, save: Callable[[], None]
) -> None:
    """Fill ``out`` with each contender's record on this shape, calling ``save`` after each (a step stopped at its
    time limit keeps what it measured)."""
    b, t, h, v = shape
    out.update({"B": b, "T": t, "N": b * t, "H": h, "V": v, "dtype": args.dtype, "results": []})
    inp = make_inputs(b, t, h, v, DTYPES[args.dtype], args.device)
    grads: dict[str, torch.Tensor] = {}
    for name in args.contenders:
        if time.monotonic() > deadline:
            out["results"].append({"contender": name, "skipped": f"the {args.budget_s:g} s budget was spent"})
            continue
        try:
            record = run_contender(name, inp, args.device, args.warmup, args.repeats)
        except Unavailable as exc:
            out["results"].append({"contender": name, "unavailable": str(exc)})
            log.warning("%s: unavailable: %s", name, exc)
            continue
        grads[name] = record.pop("_grad_weight")
        out["results"].append(record)
        save()
        log.info("N=%d H=%d V=%d %s: %s", b * t, h, v, name, {k: record[k] for k in ("step_ms", "first_call_s")})
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    pairs = {"dppo": ("dppo_fused_linear", "dppo_logits"), "liger": ("liger_fused_linear", "liger_triton")}
    out["weight_grad_rel_diff"] = {
        lib: relative_difference(grads[x], grads[y]) for lib, (x, y) in pairs.items() if x in grads and y in grads
    }
    save()


def machine(device: str) -> dict:
    info = {"torch": torch.__version__, "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    try:
        info["liger_kernel"] = version("liger-kernel")
    except PackageNotFoundError:
        info["liger_kernel"] = None
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def print_table(report: dict) -> None:
    print(f"\n{'N':>6} {'H':>5} {'V':>7} {'contender':<19} {'step ms':>9} {'first s':>8} {'peak MiB':>9}  note")
    for shape in report["shapes"]:
        for r in shape["results"]:
            note = r.get("unavailable") or r.get("skipped") or ""
            step = f"{r['step_ms']:9.2f}" if "step_ms" in r else f"{'-':>9}"
            first = f"{r['first_call_s']:8.2f}" if "first_call_s" in r else f"{'-':>8}"
            peak = f"{r['peak_extra_mib']:9.0f}" if "peak_extra_mib" in r else f"{'-':>9}"
            print(f"{shape['N']:>6} {shape['H']:>5} {shape['V']:>7} {r['contender']:<19} {step} {first} {peak}  {note}")
        for lib, diff in shape["weight_grad_rel_diff"].items():
            print(f"{'':>21} {lib}: its two paths' weight gradients differ by {diff:.2e} (max abs / max abs)")


def write_json(path: Optional[Path], report: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--shapes",
        type=parse_shape,
        nargs="+",
        default=[parse_shape(s) for s in DEFAULT_SHAPES],
        help=f"BxTxHxV per case (default: {' '.join(DEFAULT_SHAPES)})",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=list(CONTENDERS))
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (the median is reported)")
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="start no contender after this many seconds (0: no limit)"
    )
    parser.add_argument("--require-liger", action="store_true", help="exit 1 when a Liger contender could not run")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the imports and arguments, stop before any GPU call"
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    import dppo_ext  # noqa: F401  (fails here, before any timing, when the extension is not built)

    if args.dry_run:
        try:
            import liger_kernel  # noqa: F401

            print("liger_kernel importable:", liger_kernel.__file__)
        except ImportError as exc:
            print(f"liger_kernel not importable here ({exc}): a GPU run without its wheel times ours alone")
        print("dry run: stopped before the first GPU call (torch.cuda.is_available)")
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing timed (Liger's Triton loss and this comparison need a GPU)")
        write_json(args.json, {"skipped": "no CUDA device"})
        return 0
    t0 = time.monotonic()
    deadline = t0 + args.budget_s if args.budget_s > 0 else float("inf")
    report = {"machine": machine(args.device), "command": " ".join(sys.argv), "shapes": []}
    for shape in args.shapes:
        report["shapes"].append({"weight_grad_rel_diff": {}})
        bench_shape(shape, args, deadline, report["shapes"][-1], lambda: write_json(args.json, report))
    print_table(report)
    missing = [
        r["contender"]
        for s in report["shapes"]
        for r in s["results"]
        if r["contender"].startswith("liger") and "unavailable" in r
    ]
    if missing and args.require_liger:
        print(f"Liger contenders did not run ({', '.join(sorted(set(missing)))}): see the notes above")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

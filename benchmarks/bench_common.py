"""Shared pieces of the DPPO loss benchmarks: inputs, contenders, timing and measured memory peaks.

Every contender computes the same thing from the same inputs: the scalar DPPO loss (token-mean)
and the gradient of that loss with respect to the logits ``[N, V]``, returned by
``torch.autograd.grad`` (so the gradient is handed back, not accumulated into ``.grad``):

- ``fused``: ``dppo_ext.dppo_loss`` (the fused op; no full-vocabulary buffer).
- ``fused_inplace``: the same with ``inplace_backward=True`` (the gradient is written into the
  logits buffer, which the step consumes).
- ``eager``: ``dppo_ext.reference.dppo_loss_full_reference`` (the naive full-vocabulary
  ``log_softmax`` + autograd path).
- ``compile``: ``torch.compile`` of that reference (inductor, default options).
- ``liger_grpo`` / ``liger_grpo_inplace`` (CUDA only, when ``liger_kernel`` is installed): Liger
  Kernel's Triton GRPO loss (the nearest public fused policy loss: a ratio clip, no DPPO divergence),
  timed for scale on the same logits.

Memory is measured, never estimated. On CUDA: ``torch.cuda.max_memory_allocated`` around one loss
step. On the CPU: the step runs in a fresh process whose glibc allocator returns every buffer of
64 KiB or more to the OS when freed (``MALLOC_MMAP_THRESHOLD_``), the kernel's peak-RSS counter
``VmHWM`` is reset through ``/proc/self/clear_refs`` just before the step and read right after it,
so ``VmHWM - VmRSS(before)`` is the step's true physical peak (see docs/benchmarks.md).
"""

from __future__ import annotations

import gc
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
TOPK_MODES = ("topk_tv", "topk_kl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_CONTENDERS = ("fused", "fused_inplace", "eager", "compile")
CUDA_ONLY_CONTENDERS = ("liger_grpo", "liger_grpo_inplace")
ALL_CONTENDERS = CPU_CONTENDERS + CUDA_ONLY_CONTENDERS
CONSUMES_LOGITS = ("fused_inplace", "liger_grpo_inplace")
# glibc malloc settings for the CPU memory child: every block >= 64 KiB is its own mmap, unmapped on
# free, so a freed buffer leaves the resident set at once and a new one must raise it again.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}
GIB = 1024**3
MIB = 1024**2
SAMPLE_TOP = 64  # tokens are sampled among each row's top SAMPLE_TOP logits


@dataclass
class LossInputs:
    """One benchmark case's inputs (shapes per row i of N, vocabulary V, top-K K)."""

    logits: torch.Tensor  # [N, V] in the benchmark dtype, requires_grad
    tokens: torch.Tensor  # [N] int64 sampled ids
    rollout_logprobs: torch.Tensor  # [N] float32, <= 0
    advantages: torch.Tensor  # [N] float32
    topk_ids: Optional[torch.Tensor]  # [N, K] int64 (top-K modes)
    topk_logprobs: Optional[torch.Tensor]  # [N, K] float32, <= 0 (top-K modes)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor (for byte accounting)."""
        out = [self.logits, self.tokens, self.rollout_logprobs, self.advantages]
        return out + [t for t in (self.topk_ids, self.topk_logprobs) if t is not None]

    def nbytes(self) -> int:
        """Bytes held by all inputs together."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def make_inputs(n: int, v: int, k: int, mode: str, dtype: torch.dtype, device: str, seed: int = 0) -> LossInputs:
    """Realistic random inputs, generated chunk by chunk so setup never holds an fp32 [N, V] copy.

    Logits: each chunk of rows is a random window of a block of ``2 * randn`` rows (twice a chunk
    tall), rolled along V by a random shift (torch's CPU generator is sequential: drawing N*V ~ 6e8
    normals would dominate the setup, and the loss's cost does not depend on which values a row
    holds), plus a boost of ``log(V) + 2 + U(-6, 6)`` on one random token per row, so the boosted
    token's probability spans ~0.002 to ~0.998 (peaked, LLM-like rows). Tokens are sampled from
    the softmax restricted to the row's top ``SAMPLE_TOP`` logits; the rollout log-probs are the
    tokens' true log-probs plus N(0, 0.3) noise (a train/inference mismatch, so some rows get
    masked); advantages are N(0, 1); top-K ids/log-probs are the row's top-K with the same noise.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    rows_per_chunk = max(1, (1 << 23) // v)
    base = 2.0 * torch.randn(min(n, 2 * rows_per_chunk), v, generator=gen, device=device)
    logits = torch.empty(n, v, dtype=dtype, device=device)
    tokens = torch.empty(n, dtype=torch.long, device=device)
    rollout = torch.empty(n, dtype=torch.float32, device=device)
    topk = mode in TOPK_MODES
    topk_ids = torch.empty(n, k, dtype=torch.long, device=device) if topk else None
    topk_lp = torch.empty(n, k, dtype=torch.float32, device=device) if topk else None
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        rows = stop - start
        first = int(torch.randint(0, base.shape[0] - rows + 1, (1,), generator=gen))
        shift = int(torch.randint(0, v, (1,), generator=gen))
        window = base[first:first + rows]
        z = torch.empty(rows, v, device=device)
        z[:, : v - shift] = window[:, shift:]
        z[:, v - shift:] = window[:, :shift]
        preferred = torch.randint(0, v, (rows, 1), generator=gen, device=device)
        boost = math.log(v) + 2.0 + 12.0 * torch.rand(rows, 1, generator=gen, device=device) - 6.0
        z.scatter_add_(1, preferred, boost)
        logits[start:stop] = z.to(dtype)
        logp = torch.log_softmax(z, dim=-1)
        top_lp, top_ids = logp.topk(max(k, SAMPLE_TOP), dim=-1)
        pick = torch.multinomial(top_lp.exp(), 1, generator=gen)
        noise = 0.3 * torch.randn(rows, 1, generator=gen, device=device)
        rollout[start:stop] = (top_lp.gather(1, pick) + noise).clamp(max=0.0).squeeze(1)
        tokens[start:stop] = top_ids.gather(1, pick).squeeze(1)
        if topk:
            topk_ids[start:stop] = top_ids[:, :k]
            topk_lp[start:stop] = (top_lp[:, :k] + 0.3 * torch.randn(rows, k, generator=gen, device=device)).clamp(
                max=0.0)
        del z, logp
    advantages = torch.randn(n, generator=gen, device=device)
    return LossInputs(logits.requires_grad_(), tokens, rollout, advantages, topk_ids, topk_lp)


def deltas_for(mode: str) -> tuple[float, float]:
    """(delta_low, delta_high): the fused API's defaults for ``mode``, passed to every contender."""
    from dppo_ext import DEFAULT_DELTAS

    return DEFAULT_DELTAS[mode]


StepFn = Callable[["LossInputs"], torch.Tensor]


def _logits_leaf(inp: LossInputs) -> torch.Tensor:
    return inp.logits


class _AsLayerOutput(torch.autograd.Function):
    """The logits leaf as a layer's output (same storage, identity gradient).

    ``inplace_backward`` refuses leaf logits (it would overwrite a tensor the user owns). A model's logits are
    a layer's output; here the benchmark's own leaf stands in for that buffer, and the step restores it before
    every repeat (``consumes_logits``), so the in-place path is measured as a model would run it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return logits.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


@dataclass
class Contender:
    """A way to compute the loss.

    ``make_leaf(inp)`` returns the tensor whose gradient the step hands back (the logits, or a
    contender's own layout of them); ``forward(inp)`` returns the scalar loss with its graph.
    """

    name: str
    forward: StepFn
    consumes_logits: bool
    note: str = ""
    make_leaf: StepFn = _logits_leaf


class ContenderUnavailable(RuntimeError):
    """The contender cannot run here (missing package, wrong device); the reason is the message."""


def build_contender(name: str, mode: str, device: str, compute_entropy: bool = True) -> Contender:
    """Construct contender ``name`` for ``mode`` (raises ContenderUnavailable when it cannot run).

    ``compute_entropy`` is passed to every DPPO contender (the API's default is True).
    """
    low, high = deltas_for(mode)
    common = {"mode": mode, "delta_low": low, "delta_high": high, "compute_entropy": compute_entropy}

    def topk_kwargs(inp: LossInputs) -> dict:
        return {"topk_ids": inp.topk_ids, "topk_logprobs": inp.topk_logprobs}

    if name in ("fused", "fused_inplace"):
        try:
            from dppo_ext import dppo_loss
        except ImportError as exc:
            raise ContenderUnavailable(f"dppo_ext fused op not importable: {exc}") from exc
        inplace = name == "fused_inplace"

        def fused(inp: LossInputs) -> torch.Tensor:
            logits = _AsLayerOutput.apply(inp.logits) if inplace else inp.logits
            return dppo_loss(logits, inp.tokens, inp.rollout_logprobs, inp.advantages, **common,
                             **topk_kwargs(inp), inplace_backward=inplace)[0]

        return Contender(name, fused, inplace, "dppo_ext.dppo_loss" + (" (inplace_backward)" if inplace else ""))
    if name in ("eager", "compile"):
        from dppo_ext.reference import dppo_loss_full_reference

        fn = dppo_loss_full_reference
        if name == "compile":
            torch._dynamo.reset()
            fn = torch.compile(dppo_loss_full_reference)

        def reference(inp: LossInputs) -> torch.Tensor:
            return fn(inp.logits, inp.tokens, inp.rollout_logprobs, inp.advantages, **common, **topk_kwargs(inp))[0]

        note = "dppo_ext.reference.dppo_loss_full_reference"
        return Contender(name, reference, False, note if name == "eager" else f"torch.compile({note})")
    if name in CUDA_ONLY_CONTENDERS:
        return _liger_contender(name, device)
    raise ValueError(f"unknown contender {name!r}; expected one of {ALL_CONTENDERS}")


def _liger_contender(name: str, device: str) -> Contender:
    """Liger Kernel's Triton GRPO loss on the same rows, as one sequence of N tokens.

    Liger reads logits ``[B, L + 1, V]`` (it drops the last position), so it gets its own leaf:
    the benchmark's N rows plus one zero row, built once per input set by ``make_leaf``.
    """
    if not device.startswith("cuda"):
        raise ContenderUnavailable("Liger's Triton GRPO loss runs on CUDA only")
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError as exc:
        raise ContenderUnavailable(f"liger_kernel not installed: {exc}") from exc
    inplace = name == "liger_grpo_inplace"
    state: dict[str, torch.Tensor] = {}

    def make_leaf(inp: LossInputs) -> torch.Tensor:
        extra = torch.zeros(1, inp.logits.shape[1], dtype=inp.logits.dtype, device=inp.logits.device)
        state["leaf"] = torch.cat([inp.logits.detach(), extra]).unsqueeze(0).requires_grad_()
        return state["leaf"]

    def liger(inp: LossInputs) -> torch.Tensor:
        per_token = triton_grpo_loss(
            state["leaf"], inp.rollout_logprobs[None], None, inp.tokens[None], inp.advantages[:1],
            None, temperature=1.0, beta=0.0, eps_low=0.2, eps_high=0.28, inplace=inplace)[0]
        return per_token.mean()

    return Contender(name, liger, inplace, "liger_kernel triton_grpo_loss (GRPO ratio clip, shown for scale)",
                     make_leaf)


def synchronize(device: str) -> None:
    """Wait for queued device work (no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass
class StepResult:
    """One loss step: seconds of each phase, the returned gradient and the loss value."""

    fwd_s: float
    bwd_s: float
    grad: torch.Tensor
    loss: torch.Tensor


def step(contender: Contender, inp: LossInputs, leaf: torch.Tensor, device: str) -> StepResult:
    """One loss step: forward, then the gradient w.r.t. ``leaf`` via ``torch.autograd.grad``."""
    synchronize(device)
    t0 = time.perf_counter()
    loss = contender.forward(inp)
    synchronize(device)
    t1 = time.perf_counter()
    (grad,) = torch.autograd.grad(loss, [leaf])
    synchronize(device)
    t2 = time.perf_counter()
    return StepResult(t1 - t0, t2 - t1, grad, loss.detach())


def restore_logits(leaf: torch.Tensor, pristine: torch.Tensor) -> None:
    """Write the original logits back into (the first N rows of) a consumed leaf."""
    with torch.no_grad():
        leaf.view(-1, leaf.shape[-1])[: pristine.shape[0]].copy_(pristine)


@dataclass
class Timing:
    """Per-repeat seconds of one contender on one case."""

    fwd: list[float]
    bwd: list[float]

    @property
    def total(self) -> list[float]:
        return [f + b for f, b in zip(self.fwd, self.bwd)]

    def summary(self) -> dict:
        """Medians (the reported figure), minima and the raw repeats, in milliseconds."""
        out = {}
        for phase, values in (("fwd", self.fwd), ("bwd", self.bwd), ("total", self.total)):
            out[f"{phase}_ms"] = 1e3 * statistics.median(values)
            out[f"{phase}_min_ms"] = 1e3 * min(values)
            out[f"{phase}_reps_ms"] = [round(1e3 * x, 3) for x in values]
        return out


def time_contender(contender: Contender, inp: LossInputs, leaf: torch.Tensor, device: str, warmup: int,
                   repeats: int, pristine: Optional[torch.Tensor] = None) -> tuple[Timing, StepResult]:
    """Warm up, then time ``repeats`` steps (forward and backward each timed on its own).

    ``pristine`` (a copy of the logits) is restored, untimed, before every step of a contender
    that consumes its logits. Python's GC is paused inside each timed step.
    Returns (timing, the first step's result with its gradient cloned).
    """
    timing = Timing([], [])
    first = None
    for rep in range(warmup + repeats):
        if contender.consumes_logits:
            restore_logits(leaf, pristine)
        gc.collect()
        gc.disable()
        try:
            res = step(contender, inp, leaf, device)
        finally:
            gc.enable()
        if first is None:
            first = StepResult(res.fwd_s, res.bwd_s, res.grad.detach().clone(), res.loss)
        if rep >= warmup:
            timing.fwd.append(res.fwd_s)
            timing.bwd.append(res.bwd_s)
        del res
    return timing, first


# ----------------------------------------------------------------------------------------------
# Measured memory peaks
# ----------------------------------------------------------------------------------------------


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS counter to the current RSS; return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _proc_status()["VmRSS"]


def peak_rss() -> int:
    """The peak RSS (VmHWM) since the last reset, in bytes."""
    return _proc_status()["VmHWM"]


def cpu_rss_method_ok() -> tuple[bool, str]:
    """Whether this process can measure CPU peaks (Linux /proc with a resettable VmHWM + glibc env)."""
    if not os.path.exists("/proc/self/clear_refs"):
        return False, "/proc/self/clear_refs is missing (not Linux?)"
    missing = [k for k, v in MALLOC_ENV.items() if os.environ.get(k) != v]
    if missing:
        return False, f"allocator environment not set ({', '.join(missing)}); run through the child launcher"
    return True, ""


class PeakMeter:
    """Measures the peak memory of a code region beyond what was live when it started.

    CPU: resident-set peak (VmHWM) minus the resident set at the start (needs MALLOC_ENV).
    CUDA: ``max_memory_allocated`` minus ``memory_allocated`` at the start.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0
        self.peak = 0

    def __enter__(self) -> "PeakMeter":
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            ok, why = cpu_rss_method_ok()
            if not ok:
                raise RuntimeError(f"cannot measure CPU peaks here: {why}")
            self.base = reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = peak_rss()

    @property
    def delta(self) -> int:
        """Peak bytes above the starting level."""
        return self.peak - self.base


def run_child(args: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``python <args>`` in a fresh process with the allocator environment; (rc, stdout, stderr)."""
    env = dict(os.environ, **MALLOC_ENV)
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (a large number where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


# ----------------------------------------------------------------------------------------------
# Machine description
# ----------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_simd() -> str:
    """The widest x86 vector extension the host reports (``avx512f``, ``avx2``, ``none``), or ``unknown``."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return next((f for f in ("avx512f", "avx2") if f in flags), "none")


def machine_info(device: str) -> dict:
    """What a reader needs to judge the figures: hardware, software, threads, load, command."""
    info = {
        "cpu_model": cpu_model(),
        "cpu_simd": cpu_simd(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        # run_all.sh names itself here; a direct call records its own argv.
        "command": os.environ.get("DPPO_BENCH_COMMAND")
        or " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "loadavg_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import dppo_ext

        info["dppo_ext"] = dppo_ext.__version__
        info["dppo_ext_cuda_compiled"] = bool(dppo_ext.cuda_compiled)
        from dppo_ext import _native

        # The instruction set the CPU kernels ran with (chosen at import, see csrc/cpu/dispatch.h).
        info["dppo_ext_cpu_capability"] = _native.library.cpu_capability
    except ImportError as exc:
        info["dppo_ext"] = f"unavailable ({exc})"
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        info["git_commit"] = "unknown"
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info

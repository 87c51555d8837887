"""Timing: one loss step (forward and backward timed apart), repeats, and the copy pass beside them.

The CPU and the GPU are judged against the same yardstick: one read+write pass over the logits (a copy
into an existing buffer, ``CopyPass``) timed in the same run, interleaved with the steps, so a loaded or
throttled machine moves both alike. The forward reads the logits once, the backward reads them and
writes the gradient once (``bytes_moved``).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .contenders import Contender
from .inputs import LossInputs


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


class CopyPass:
    """One read+write pass over the logits: ``dst.copy_(logits)`` into a buffer allocated (and touched) once.

    The yardstick of every speed figure: ``2 * N * V * element size`` bytes moved at the machine's rate.
    """

    def __init__(self, logits: torch.Tensor, device: str) -> None:
        self.src = logits.detach()
        self.dst = self.src.clone()
        self.device = device

    @property
    def nbytes(self) -> int:
        return 2 * self.src.numel() * self.src.element_size()

    def run(self) -> float:
        """Seconds of one copy pass."""
        synchronize(self.device)
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        synchronize(self.device)
        return time.perf_counter() - t0


def bytes_moved(phase: str, logits_bytes: int) -> int:
    """Bytes the op must move in ``phase``: the forward reads the logits once; the backward (also in place)
    reads them once and writes the gradient once; fwd+bwd is both."""
    return {"fwd": 1, "bwd": 2, "total": 3}[phase] * logits_bytes


@dataclass
class Timing:
    """Per-repeat seconds of one contender on one case, and of the copy pass run just before each repeat."""

    fwd: list[float]
    bwd: list[float]
    copy: list[float] = field(default_factory=list)

    @property
    def total(self) -> list[float]:
        return [f + b for f, b in zip(self.fwd, self.bwd)]

    def summary(self, logits_bytes: Optional[int] = None) -> dict:
        """Medians (the reported figure), minima and the raw repeats, in milliseconds.

        With ``logits_bytes`` and copy passes recorded, also each phase's achieved GB/s (``bytes_moved`` over its
        median time) and its multiple of the copy pass's median (``fwd_x_copy``, ...), the copy pass's own GB/s.
        """
        out = {}
        for phase, values in (("fwd", self.fwd), ("bwd", self.bwd), ("total", self.total)):
            out[f"{phase}_ms"] = 1e3 * statistics.median(values)
            out[f"{phase}_min_ms"] = 1e3 * min(values)
            out[f"{phase}_reps_ms"] = [round(1e3 * x, 3) for x in values]
        if self.copy and logits_bytes:
            copy_s = statistics.median(self.copy)
            out["copy_ms"] = 1e3 * copy_s
            out["copy_reps_ms"] = [round(1e3 * x, 3) for x in self.copy]
            out["copy_GBps"] = 2 * logits_bytes / copy_s / 1e9
            for phase in ("fwd", "bwd", "total"):
                seconds = out[f"{phase}_ms"] * 1e-3
                out[f"{phase}_GBps"] = bytes_moved(phase, logits_bytes) / seconds / 1e9
                out[f"{phase}_x_copy"] = seconds / copy_s
        return out


def time_contender(
    contender: Contender,
    inp: LossInputs,
    leaf: torch.Tensor,
    device: str,
    warmup: int,
    repeats: int,
    pristine: Optional[torch.Tensor] = None,
    copy_pass: Optional[CopyPass] = None,
) -> tuple[Timing, StepResult]:
    """Warm up, then time ``repeats`` steps (forward and backward each timed on its own).

    ``pristine`` (a copy of the logits) is restored, untimed, before every step of a contender
    that consumes its logits. With ``copy_pass``, one copy pass is timed right before every timed step, so
    the step and its yardstick see the same machine state. Python's GC is paused inside each timed step.
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
            if copy_pass is not None and rep >= warmup:
                timing.copy.append(copy_pass.run())
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

"""The contenders: every way of computing the DPPO loss the benchmarks compare, on the same inputs.

Each computes the scalar DPPO loss (token-mean) and, through ``torch.autograd.grad``, its gradient with
respect to the logits ``[N, V]``:

- ``fused``: ``dppo_ext.dppo_loss`` (the fused op; no full-vocabulary buffer).
- ``fused_inplace``: the same with ``inplace_backward=True`` (the gradient is written into the
  logits buffer, which the step consumes).
- ``eager``: ``dppo_ext.reference.dppo_loss_full_reference`` (the naive full-vocabulary
  ``log_softmax`` + autograd path).
- ``compile``: ``torch.compile`` of that reference (inductor, default options).
- ``liger_grpo`` / ``liger_grpo_inplace`` (CUDA only, when ``liger_kernel`` is installed): Liger
  Kernel's Triton GRPO loss (the nearest public fused policy loss: a ratio clip, no DPPO divergence),
  timed for scale on the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .inputs import LossInputs, deltas_for

CPU_CONTENDERS = ("fused", "fused_inplace", "eager", "compile")
CUDA_ONLY_CONTENDERS = ("liger_grpo", "liger_grpo_inplace")
ALL_CONTENDERS = CPU_CONTENDERS + CUDA_ONLY_CONTENDERS
CONSUMES_LOGITS = ("fused_inplace", "liger_grpo_inplace")

StepFn = Callable[[LossInputs], torch.Tensor]


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
            return dppo_loss(
                logits,
                inp.tokens,
                inp.rollout_logprobs,
                inp.advantages,
                **common,
                **topk_kwargs(inp),
                inplace_backward=inplace,
            )[0]

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
            state["leaf"],
            inp.rollout_logprobs[None],
            None,
            inp.tokens[None],
            inp.advantages[:1],
            None,
            temperature=1.0,
            beta=0.0,
            eps_low=0.2,
            eps_high=0.28,
            inplace=inplace,
        )[0]
        return per_token.mean()

    return Contender(
        name, liger, inplace, "liger_kernel triton_grpo_loss (GRPO ratio clip, shown for scale)", make_leaf
    )

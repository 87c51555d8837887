"""The autograd rules every entry point of the loss shares: what it refuses, and the backward op's per-row inputs.

- ``grad_args``: the backward op's inputs from the upstream gradients of ``loss``, ``logp`` and ``entropy``
  (``grad_target = g_loss * coef + g_logp`` with ``coef = -A * w * M``, docs/contract.md).
- ``input_grads``: an autograd Function's gradient tuple, ``None`` for every input after the given ones.
- Refusals with a message a user can act on: double backward (``refuse_double_backward``), ``torch.func``
  transforms (``check_no_functorch``) and the uses of ``inplace_backward=True`` that would corrupt a tensor or a
  gradient (``inplace_applies``, ``check_inplace_backward``); a second backward after an in-place one
  (``BACKWARD_CONSUMED``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "BACKWARD_CONSUMED",
    "NO_DOUBLE_BACKWARD",
    "check_inplace_backward",
    "check_no_functorch",
    "grad_args",
    "inplace_applies",
    "input_grads",
    "refuse_double_backward",
]

NO_DOUBLE_BACKWARD = (
    "{what} does not support double backward: its backward is a fused kernel without a derivative of its own, "
    "so second-order gradients (backward/autograd.grad with create_graph=True, then differentiating the "
    "gradient) cannot be computed. Call backward without create_graph=True."
)

BACKWARD_CONSUMED = (
    "inplace_backward=True: the backward of this loss already ran and overwrote the logits with their gradient, so it "
    "cannot run again (backward(retain_graph=True) a second time). Use inplace_backward=False to backpropagate "
    "through the same graph more than once."
)


def grad_args(
    compute_entropy: bool,
    advantages: Tensor,
    mask: Tensor,
    weight: Tensor,
    grad_loss: Tensor,
    grad_logp: Tensor,
    grad_entropy: Optional[Tensor],
    entropy: Tensor,
) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """``(grad_target, grad_entropy, entropy)``, the backward op's per-row inputs: ``grad_target = g_loss * coef +
    g_logp`` with ``coef = -A * w * M``, and the entropy's gradient and value when the entropy was computed (else
    ``None, None``). Upstream gradients may be expanded (stride 0) views, e.g. from ``entropy.sum()``."""
    grad_target = (grad_loss * (-advantages * weight * mask) + grad_logp).contiguous()
    if grad_entropy is None or not compute_entropy:
        return grad_target, None, None
    return grad_target, grad_entropy.contiguous(), entropy


def input_grads(ctx, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """An autograd Function's backward result: ``grads`` for its first inputs, ``None`` for the rest."""
    return (*grads, *(None,) * (len(ctx.needs_input_grad) - len(grads)))


def refuse_double_backward(what: str) -> None:
    """Raise when a backward runs under ``create_graph=True``: its gradient would have no derivative."""
    if torch.is_grad_enabled():
        raise RuntimeError(NO_DOUBLE_BACKWARD.format(what=what))


def check_no_functorch(api: str, *tensors: Optional[Tensor]) -> None:
    """Refuse torch.func transforms (grad, vmap, jacrev, ...): the op's autograd formula is a plain-autograd one."""
    if torch.compiler.is_compiling():
        return
    if any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        raise RuntimeError(
            f"{api} does not support torch.func transforms (torch.func.grad, vmap, jacrev, ...): its fused kernels "
            "have a hand-written backward that only plain autograd runs. Use loss.backward() or "
            "torch.autograd.grad instead."
        )


def _may_overlap(t: Tensor) -> bool:
    """Whether two elements of ``t`` may share memory. torch's own test answers "too hard to tell" for every
    non-contiguous layout, a column slice included; then the dimensions, by increasing stride, must each step
    past everything the smaller ones span (sufficient for no overlap; a stride-0 dimension never does)."""
    verdict = torch._debug_has_internal_overlap(t)  # 0: no overlap, 1: overlap, 2: too hard to tell
    if verdict != 2:
        return verdict == 1
    span = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride < span:
            return True
        span += stride * (size - 1)
    return False


def check_inplace_backward(logits: Tensor, name: str = "logits") -> None:
    """Refuse the uses of ``inplace_backward=True`` that would silently corrupt a tensor or a gradient."""
    if torch.compiler.is_compiling():
        return
    # under torch.func a wrapped tensor looks like a leaf: name the transform, not the leaf rule
    check_no_functorch(f"inplace_backward=True on {name}", logits)
    if _may_overlap(logits):
        raise ValueError(
            f"inplace_backward=True would write the gradient over {name}, whose elements share memory (shape "
            f"{tuple(logits.shape)}, strides {logits.stride()}: a stride-0 dimension from expand() or broadcasting, "
            f"or another overlapping view), so one memory location would have to hold the gradients of several "
            f"elements. Pass {name}.contiguous(): a copy with one location per element, which the backward may "
            f"overwrite (the op reads overlapping rows with or without inplace_backward)."
        )
    if logits.is_leaf or (logits._base is not None and logits._base.is_leaf):
        raise ValueError(
            f"inplace_backward=True would overwrite {name}, a leaf tensor that requires grad (or a view of one), "
            f"with its gradient. Pass inplace_backward=False, or pass the output of the layer that computes the "
            f"logits (e.g. the LM head's output), which the backward may consume."
        )
    fn = logits.grad_fn
    if fn is not None and any(attr.startswith("_saved_result") for attr in dir(fn)):
        raise ValueError(
            f"inplace_backward=True cannot be used on {name} produced by {type(fn).__name__}: that node saved its "
            f"output (as x.exp(), softmax or sigmoid do) for its own backward, which the in-place gradient would "
            f"overwrite. Pass inplace_backward=False."
        )


def inplace_applies(inplace_backward: bool, logits: Tensor) -> bool:
    """Whether ``inplace_backward=True`` takes effect (autograd will differentiate ``logits``); when it does, its
    unsafe uses are refused first (:func:`check_inplace_backward`)."""
    if inplace_backward and torch.is_grad_enabled() and logits.requires_grad:
        check_inplace_backward(logits)
        return True
    return False

"""The Python side of ``torch.ops.dppo.*``: every fake (meta) kernel and autograd formula of the ops, and
``forward_rows``, the forward op's one call for the entry points (the public per-row function on logits is
``dppo_ext.dppo_loss_per_row``).

The op math is specified in ``docs/contract.md``; schemas live in ``csrc/op_schemas.h``. This module
adds what the C++ side cannot: ``register_fake`` (so the ops trace under ``torch.compile`` and
``torch.library.opcheck``) and ``register_autograd`` (the backward is itself an op,
``dppo_loss_backward``). ``loss``, ``logp`` and ``entropy`` are differentiable with respect to the
logits; ``divergence``, ``mask``, ``weight`` and ``lse`` are constants.

``inplace_backward=True`` routes through a small ``torch.autograd.Function`` that calls the
in-place backward op ``dppo_loss_backward_``: the gradient is written into the logits buffer, so
the loss adds no ``[N, V]`` tensor at all. The logits are consumed by the backward, and autograd is
told so (their version counter moves): a node that saved the same logits (or a view of them) and
runs its backward later fails with autograd's "modified by an inplace operation" error instead of
computing a wrong gradient. Refused with an error naming ``inplace_backward``: leaf logits that
require grad (their values would be replaced by the gradient), logits whose producer saved them
(``x.exp()``, softmax, sigmoid, ...), and a second backward through the same graph.

Not supported, with a clear error: double backward (``create_graph=True`` followed by a
differentiation of the gradient) and ``torch.func`` transforms (``grad``, ``vmap``, ...).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _native  # noqa: F401  (loads dppo_ext._C, which registers torch.ops.dppo.*)
from ._autograd import (
    BACKWARD_CONSUMED,
    NO_DOUBLE_BACKWARD,
    grad_args,
    input_grads,
    refuse_double_backward,
)
from ._rows import DPPOOutputs, LossSettings, RowInputs
from .contract import accumulation_dtype

__all__: list[str] = []  # the ops register themselves; forward_rows is the entry points' one call

# The forward op's argument names in schema order: its autograd context reads its inputs by name.
_FORWARD_ARGS = tuple(a.name for a in torch.ops.dppo.dppo_loss_forward.default._schema.arguments)


# ---- fake kernels ---------------------------------------------------------------------------------


@torch.library.register_fake("dppo::dppo_loss_forward")
def _forward_fake(
    logits,
    tokens,
    rollout_logprobs,
    advantages,
    topk_ids,
    topk_logprobs,
    anchor_logprobs,
    mode,
    temperature,
    delta_low,
    delta_high,
    ratio_cap,
    compute_entropy,
    kept_ids=None,
    mask_direction="advantage",
):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    return tuple(logits.new_empty((n,), dtype=accumulation_dtype(logits.dtype)) for _ in range(7))


@torch.library.register_fake("dppo::dppo_loss_backward")
def _backward_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids=None):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("dppo::dppo_loss_backward_")
def _backward_inplace_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature, kept_ids=None):
    return None


@torch.library.register_fake("dppo::dppo_vocab_parallel_stats")
def _stats_fake(logits, tokens, topk_ids, vocab_start, temperature, compute_entropy, kept_ids=None):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V_local], got shape {tuple(logits.shape)}")
    k = 0 if topk_ids is None else topk_ids.shape[1]
    s = 0 if kept_ids is None else kept_ids.shape[1]
    return logits.new_empty((logits.shape[0], 4 + k + s), dtype=accumulation_dtype(logits.dtype))


@torch.library.register_fake("dppo::dppo_vocab_parallel_epilogue")
def _epilogue_fake(
    stats,
    vocab_offsets,
    tokens,
    rollout_logprobs,
    advantages,
    topk_ids,
    topk_logprobs,
    anchor_logprobs,
    mode,
    delta_low,
    delta_high,
    ratio_cap,
    compute_entropy,
    kept_ids=None,
    mask_direction="advantage",
):
    torch._check(stats.dim() == 3, lambda: f"stats must be 3-D [W, N, 4 + K], got shape {tuple(stats.shape)}")
    return tuple(stats.new_empty((stats.shape[1],)) for _ in range(7))


# ---- autograd -------------------------------------------------------------------------------------


def _save_for_backward(
    ctx,
    logits: Tensor,
    tokens: Tensor,
    advantages: Tensor,
    temperature: float,
    compute_entropy: bool,
    output,
    kept_ids: Optional[Tensor] = None,
) -> None:
    _loss, _logp, divergence, mask, weight, entropy, lse = output
    ctx.temperature = temperature
    ctx.compute_entropy = compute_entropy
    ctx.has_kept = kept_ids is not None
    kept = (kept_ids,) if kept_ids is not None else ()
    ctx.save_for_backward(logits, tokens, advantages, mask, weight, entropy, lse, *kept)
    ctx.mark_non_differentiable(divergence, mask, weight, lse)


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FORWARD_ARGS, inputs))
    _save_for_backward(
        ctx,
        args["logits"],
        args["tokens"],
        args["advantages"],
        args["temperature"],
        args["compute_entropy"],
        output,
        args.get("kept_ids"),
    )


def _backward_args(ctx, grad_loss, grad_logp, grad_entropy):
    """``(logits, backward op arguments after logits)`` from the saved tensors and the upstream gradients."""
    logits, tokens, advantages, mask, weight, entropy, lse, *kept = ctx.saved_tensors
    gt, ge, ent = grad_args(ctx.compute_entropy, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy)
    return logits, (gt, ge, logits, tokens, lse, ent, ctx.temperature, kept[0] if kept else None)


def _backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
    _logits, args = _backward_args(ctx, grad_loss, grad_logp, grad_entropy)
    return input_grads(ctx, torch.ops.dppo.dppo_loss_backward(*args))


torch.library.register_autograd("dppo::dppo_loss_forward", _backward, setup_context=_setup_context)


def _backward_not_differentiable(ctx, *grads):
    raise RuntimeError(NO_DOUBLE_BACKWARD.format(what="the DPPO loss op (torch.ops.dppo.dppo_loss_forward)"))


# The backward op runs under autograd only when its caller asked for create_graph=True; its output then
# carries this node, so first-order gradients still work and a second-order one raises instead of the
# silent zero that an op without an autograd formula would give.
torch.library.register_autograd(
    "dppo::dppo_loss_backward", _backward_not_differentiable, setup_context=lambda ctx, inputs, output: None
)


class _DPPOInplace(torch.autograd.Function):
    """The op with a backward that writes the logits gradient into the logits buffer."""

    @staticmethod
    def forward(ctx, logits: Tensor, rows: RowInputs, settings: LossSettings):
        out = torch.ops.dppo.dppo_loss_forward(
            logits, *rows.op_inputs, *settings.op_args(), rows.kept_ids, settings.mask_direction
        )
        temperature, compute_entropy = float(settings.temperature), bool(settings.compute_entropy)
        _save_for_backward(ctx, logits, rows.tokens, rows.advantages, temperature, compute_entropy, out, rows.kept_ids)
        ctx.consumed = False
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
        refuse_double_backward("the DPPO loss with inplace_backward=True")
        if ctx.consumed:
            raise RuntimeError(BACKWARD_CONSUMED)
        logits, args = _backward_args(ctx, grad_loss, grad_logp, grad_entropy)
        torch.ops.dppo.dppo_loss_backward_(*args)
        # Tell autograd the logits changed: any node that saved them and runs later now fails its
        # saved-tensor version check instead of reading the gradient as if it were the logits.
        torch.autograd.graph.increment_version(logits)
        ctx.consumed = True
        return input_grads(ctx, logits)


# ---- wrappers ---------------------------------------------------------------------------------------


def forward_rows(logits: Tensor, rows: RowInputs, settings: LossSettings, inplace: bool) -> DPPOOutputs:
    """The op on ``logits [N, V]`` and ``rows`` with resolved ``settings``; ``inplace``: through the in-place
    backward (the caller decided it with ``inplace_applies``). No check of its own: for the entry points
    (``dppo_ext.loss``: ``dppo_loss``, ``dppo_loss_per_row``), which checked everything already."""
    if inplace:
        return DPPOOutputs(*_DPPOInplace.apply(logits, rows, settings))
    return DPPOOutputs(
        *torch.ops.dppo.dppo_loss_forward(
            logits, *rows.op_inputs, *settings.op_args(), rows.kept_ids, settings.mask_direction
        )
    )

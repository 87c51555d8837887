"""Typed wrappers of ``torch.ops.dppo.*``, and every fake (meta) kernel and autograd formula of the ops.

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
    check_no_functorch,
    grad_args,
    inplace_applies,
    input_grads,
    refuse_double_backward,
)
from ._rows import DPPOOutputs, LossSettings, RowInputs, check_tensors
from .contract import DEFAULT_MODE, DEFAULT_RATIO_CAP, accumulation_dtype

__all__ = ["dppo_loss_forward"]

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
):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    return tuple(logits.new_empty((n,), dtype=accumulation_dtype(logits.dtype)) for _ in range(7))


@torch.library.register_fake("dppo::dppo_loss_backward")
def _backward_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("dppo::dppo_loss_backward_")
def _backward_inplace_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature):
    return None


@torch.library.register_fake("dppo::dppo_vocab_parallel_stats")
def _stats_fake(logits, tokens, topk_ids, vocab_start, temperature, compute_entropy):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V_local], got shape {tuple(logits.shape)}")
    k = 0 if topk_ids is None else topk_ids.shape[1]
    return logits.new_empty((logits.shape[0], 4 + k), dtype=accumulation_dtype(logits.dtype))


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
):
    torch._check(stats.dim() == 3, lambda: f"stats must be 3-D [W, N, 4 + K], got shape {tuple(stats.shape)}")
    return tuple(stats.new_empty((stats.shape[1],)) for _ in range(7))


# ---- autograd -------------------------------------------------------------------------------------


def _save_for_backward(
    ctx, logits: Tensor, tokens: Tensor, advantages: Tensor, temperature: float, compute_entropy: bool, output
) -> None:
    _loss, _logp, divergence, mask, weight, entropy, lse = output
    ctx.temperature = temperature
    ctx.compute_entropy = compute_entropy
    ctx.save_for_backward(logits, tokens, advantages, mask, weight, entropy, lse)
    ctx.mark_non_differentiable(divergence, mask, weight, lse)


def _setup_context(ctx, inputs, output):
    args = dict(zip(_FORWARD_ARGS, inputs))
    _save_for_backward(
        ctx, args["logits"], args["tokens"], args["advantages"], args["temperature"], args["compute_entropy"], output
    )


def _backward_args(ctx, grad_loss, grad_logp, grad_entropy):
    """``(logits, backward op arguments after logits)`` from the saved tensors and the upstream gradients."""
    logits, tokens, advantages, mask, weight, entropy, lse = ctx.saved_tensors
    gt, ge, ent = grad_args(ctx.compute_entropy, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy)
    return logits, (gt, ge, logits, tokens, lse, ent, ctx.temperature)


def _backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
    _logits, args = _backward_args(ctx, grad_loss, grad_logp, grad_entropy)
    return input_grads(ctx, torch.ops.dppo.dppo_loss_backward(*args))


torch.library.register_autograd("dppo::dppo_loss_forward", _backward, setup_context=_setup_context)


def _backward_not_differentiable(ctx, *grads):
    raise RuntimeError(NO_DOUBLE_BACKWARD.format(what="dppo_loss_forward"))


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
        out = torch.ops.dppo.dppo_loss_forward(logits, *rows, *settings.op_args())
        temperature, compute_entropy = float(settings.temperature), bool(settings.compute_entropy)
        _save_for_backward(ctx, logits, rows.tokens, rows.advantages, temperature, compute_entropy, out)
        ctx.consumed = False
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
        refuse_double_backward("dppo_loss_forward(inplace_backward=True)")
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
    backward (the caller decided it with ``inplace_applies``). No check of its own: for the entry points, which
    checked everything already."""
    if inplace:
        return DPPOOutputs(*_DPPOInplace.apply(logits, rows, settings))
    return DPPOOutputs(*torch.ops.dppo.dppo_loss_forward(logits, *rows, *settings.op_args()))


def dppo_loss_forward(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    mode: str = DEFAULT_MODE,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
) -> DPPOOutputs:
    """The fused DPPO op on flat rows (see ``docs/contract.md``).

    Args:
        logits: ``[N, V]`` float32/float16/bfloat16/float64; stride(1) must be 1 (row views are fine).
        tokens: ``[N]`` int64 sampled token ids; ``-100`` marks a padding row (zero outputs and grad).
        rollout_logprobs: ``[N]`` rollout (behaviour) log-prob of each token, float32
            (float64 for float64 logits). ``-inf`` is allowed.
        advantages: ``[N]`` same dtype as ``rollout_logprobs``.
        topk_ids, topk_logprobs: ``[N, K]`` the rollout's top-K ids and log-probs (top-K modes).
        anchor_logprobs: ``[N]`` optional mask anchor replacing the rollout log-probs in the mask.
        mode: one of ``MODES`` or an alias of ``MODE_ALIASES`` (verl's ``dppo_tv``/``dppo_kl``).
        temperature: logits are divided by it (must match the rollout's temperature).
        delta_low, delta_high: trust-region thresholds (A <= 0 and A > 0 sides); ``None`` takes
            ``DEFAULT_DELTAS[mode]`` (``dppo_ext.contract``), as every other entry point does.
        ratio_cap: cap C of the importance weight.
        compute_entropy: also compute the entropy of softmax(logits / T) (else zeros).
        inplace_backward: write the gradient into ``logits`` during backward (consumes the logits;
            see the module docstring for the uses it refuses).

    Returns:
        ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each ``[N]``. A row whose
        scaled logits hold a NaN or +inf or are all -inf has NaN outputs (docs/contract.md).
    """
    settings = LossSettings.resolve(mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy)
    check_tensors(logits=logits)
    check_no_functorch("dppo_loss_forward", logits)
    rows = RowInputs.of(tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs)
    return forward_rows(logits, rows, settings, inplace_applies(inplace_backward, logits))

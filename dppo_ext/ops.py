"""Typed wrappers of ``torch.ops.dppo.*`` with fake (meta) kernels and autograd.

The op math is specified in ``docs/contract.md``; schemas live in ``csrc/ops.cpp``. This module
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

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _native  # noqa: F401  (loads dppo_ext._C, which registers torch.ops.dppo.*)
from .contract import MODE_ALIASES, MODES, canonical_mode, resolve_op_settings

__all__ = ["DPPOOutputs", "MODES", "MODE_ALIASES", "canonical_mode", "dppo_loss_forward", "dppo_loss_backward"]

_NO_DOUBLE_BACKWARD = (
    "{what} does not support double backward: its backward is a fused kernel without a derivative of its own, "
    "so second-order gradients (backward/autograd.grad with create_graph=True, then differentiating the "
    "gradient) cannot be computed. Call backward without create_graph=True."
)

_BACKWARD_CONSUMED = (
    "inplace_backward=True: the backward of this loss already ran and overwrote the logits with their gradient, so it "
    "cannot run again (backward(retain_graph=True) a second time). Use inplace_backward=False to backpropagate "
    "through the same graph more than once."
)


class DPPOOutputs(NamedTuple):
    """Per-row outputs of the op, each ``[N]`` in float32 (float64 for float64 logits)."""

    loss: Tensor
    logp: Tensor
    divergence: Tensor
    mask: Tensor
    weight: Tensor
    entropy: Tensor
    lse: Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("dppo::dppo_loss_forward")
def _forward_fake(logits, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, mode,
                  temperature, delta_low, delta_high, ratio_cap, compute_entropy):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    return tuple(logits.new_empty((n,), dtype=_acc_dtype(logits.dtype)) for _ in range(7))


@torch.library.register_fake("dppo::dppo_loss_backward")
def _backward_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("dppo::dppo_loss_backward_")
def _backward_inplace_fake(grad_target, grad_entropy, logits, tokens, lse, entropy, temperature):
    return None


def _setup_context(ctx, inputs, output):
    logits, tokens, _rollout, advantages = inputs[:4]
    temperature = inputs[8]
    _loss, _logp, _div, mask, weight, entropy, lse = output
    ctx.temperature = temperature
    ctx.compute_entropy = inputs[12]
    ctx.save_for_backward(logits, tokens, advantages, mask, weight, entropy, lse)
    ctx.mark_non_differentiable(output[2], output[3], output[4], output[6])


def _grad_args(ctx, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy):
    """The backward op's per-row inputs: grad_target = g_loss * coef + g_logp with
    coef = -A * w * M (docs/contract.md), and the entropy grad when the entropy was computed."""
    grad_target = (grad_loss * (-advantages * weight * mask) + grad_logp).contiguous()
    if grad_entropy is None or not ctx.compute_entropy:
        return grad_target, None, None
    return grad_target, grad_entropy.contiguous(), entropy


def _backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
    logits, tokens, advantages, mask, weight, entropy, lse = ctx.saved_tensors
    gt, ge, ent = _grad_args(ctx, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy)
    grad_logits = torch.ops.dppo.dppo_loss_backward(gt, ge, logits, tokens, lse, ent, ctx.temperature)
    return (grad_logits,) + (None,) * 12


torch.library.register_autograd("dppo::dppo_loss_forward", _backward, setup_context=_setup_context)


def _backward_not_differentiable(ctx, *grads):
    raise RuntimeError(_NO_DOUBLE_BACKWARD.format(what="dppo_loss_forward"))


# The backward op runs under autograd only when its caller asked for create_graph=True; its output then
# carries this node, so first-order gradients still work and a second-order one raises instead of the
# silent zero that an op without an autograd formula would give.
torch.library.register_autograd(
    "dppo::dppo_loss_backward", _backward_not_differentiable, setup_context=lambda ctx, inputs, output: None)


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


def check_inplace_backward(logits: Tensor, name: str = "logits") -> None:
    """Refuse the uses of ``inplace_backward=True`` that would silently corrupt a tensor or a gradient."""
    if torch.compiler.is_compiling():
        return
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


def _inplace_applies(inplace_backward: bool, logits: Tensor) -> bool:
    """Whether ``inplace_backward=True`` takes effect (autograd will differentiate ``logits``); when it does, its
    unsafe uses are refused first (:func:`check_inplace_backward`)."""
    if inplace_backward and torch.is_grad_enabled() and logits.requires_grad:
        check_inplace_backward(logits)
        return True
    return False


class _DPPOInplace(torch.autograd.Function):
    """The op with a backward that writes the logits gradient into the logits buffer."""

    @staticmethod
    def forward(ctx, logits, *args):
        out = torch.ops.dppo.dppo_loss_forward(logits, *args)
        _setup_context(ctx, (logits,) + args, out)
        ctx.consumed = False
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD.format(what="dppo_loss_forward(inplace_backward=True)"))
        if ctx.consumed:
            raise RuntimeError(_BACKWARD_CONSUMED)
        logits, tokens, advantages, mask, weight, entropy, lse = ctx.saved_tensors
        gt, ge, ent = _grad_args(ctx, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy)
        torch.ops.dppo.dppo_loss_backward_(gt, ge, logits, tokens, lse, ent, ctx.temperature)
        # Tell autograd the logits changed: any node that saved them and runs later now fails its
        # saved-tensor version check instead of reading the gradient as if it were the logits.
        torch.autograd.graph.increment_version(logits)
        ctx.consumed = True
        return (logits,) + (None,) * 12


def dppo_loss_forward(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    mode: str = "binary_tv",
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
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
    settings = resolve_op_settings(mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy)
    check_no_functorch("dppo_loss_forward", logits)
    args = (tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, *settings.op_args())
    if _inplace_applies(inplace_backward, logits):
        return DPPOOutputs(*_DPPOInplace.apply(logits, *args))
    return DPPOOutputs(*torch.ops.dppo.dppo_loss_forward(logits, *args))


def dppo_loss_backward(
    grad_target: Tensor,
    logits: Tensor,
    tokens: Tensor,
    lse: Tensor,
    temperature: float = 1.0,
    grad_entropy: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """The backward op, for callers that drive it directly (e.g. fused-linear chunking).

    ``grad[i, j] = (grad_target[i] * (1[j = a_i] - p_ij) - grad_entropy[i] * p_ij * (log p_ij + H_i)) / T``.
    With ``out=logits`` the gradient is written in place into ``logits`` and ``logits`` is returned.
    """
    if out is not None:
        if out is not logits:
            raise ValueError("out must be the logits tensor itself (the in-place backward writes into logits)")
        torch.ops.dppo.dppo_loss_backward_(grad_target, grad_entropy, logits, tokens, lse, entropy, float(temperature))
        return logits
    return torch.ops.dppo.dppo_loss_backward(grad_target, grad_entropy, logits, tokens, lse, entropy, float(temperature))

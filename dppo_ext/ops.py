"""Typed wrappers of ``torch.ops.dppo.*`` with fake (meta) kernels and autograd.

The op math is specified in ``docs/contract.md``; schemas live in ``csrc/ops.cpp``. This module
adds what the C++ side cannot: ``register_fake`` (so the ops trace under ``torch.compile`` and
``torch.library.opcheck``) and ``register_autograd`` (the backward is itself an op,
``dppo_loss_backward``). ``loss``, ``logp`` and ``entropy`` are differentiable with respect to the
logits; ``divergence``, ``mask``, ``weight`` and ``lse`` are constants.

``inplace_backward=True`` routes through a small ``torch.autograd.Function`` that calls the
in-place backward op ``dppo_loss_backward_``: the gradient is written into the logits buffer, so
the loss adds no ``[N, V]`` tensor at all. The logits are consumed by the backward: do not read
them afterwards, and do not use it when something else in the graph saved the same logits tensor.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

__all__ = ["DPPOOutputs", "MODES", "MODE_ALIASES", "canonical_mode", "dppo_loss_forward", "dppo_loss_backward"]

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "ratio", "none")
# Other projects' names for our modes, accepted wherever a mode is (docs/names.md): verl's
# ``policy_loss.loss_mode`` and the paper's verl fork (sail-sg/Stable-RL, also our trainer's --loss).
MODE_ALIASES = {
    "dppo_tv": "binary_tv",
    "dppo_kl": "binary_kl",
    "dppo_binary_tv": "binary_tv",
    "dppo_binary_kl": "binary_kl",
    "dppo_topk_tv": "topk_tv",
    "dppo_topk_kl": "topk_kl",
}


def canonical_mode(mode: str) -> str:
    """``mode`` as one of ``MODES`` (an alias of ``MODE_ALIASES`` is translated); ValueError otherwise."""
    if isinstance(mode, str):
        if mode in MODES:
            return mode
        if mode in MODE_ALIASES:
            return MODE_ALIASES[mode]
    raise ValueError(f"mode must be one of {MODES} (or an alias: {tuple(MODE_ALIASES)}), got {mode!r}")


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


class _DPPOInplace(torch.autograd.Function):
    """The op with a backward that writes the logits gradient into the logits buffer."""

    @staticmethod
    def forward(ctx, logits, *args):
        out = torch.ops.dppo.dppo_loss_forward(logits, *args)
        _setup_context(ctx, (logits,) + args, out)
        return out

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, _g_div, _g_mask, _g_weight, grad_entropy, _g_lse):
        logits, tokens, advantages, mask, weight, entropy, lse = ctx.saved_tensors
        gt, ge, ent = _grad_args(ctx, advantages, mask, weight, grad_loss, grad_logp, grad_entropy, entropy)
        torch.ops.dppo.dppo_loss_backward_(gt, ge, logits, tokens, lse, ent, ctx.temperature)
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
    delta_low: float = 0.2,
    delta_high: float = 0.2,
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
        delta_low, delta_high: trust-region thresholds (A <= 0 and A > 0 sides).
        ratio_cap: cap C of the importance weight.
        compute_entropy: also compute the entropy of softmax(logits / T) (else zeros).
        inplace_backward: write the gradient into ``logits`` during backward (consumes the logits).

    Returns:
        ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each ``[N]``.
    """
    args = (tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, canonical_mode(mode),
            float(temperature), float(delta_low), float(delta_high), float(ratio_cap), bool(compute_entropy))
    if inplace_backward and torch.is_grad_enabled() and logits.requires_grad:
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

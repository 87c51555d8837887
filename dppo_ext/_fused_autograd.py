"""The autograd functions of the fused LM-head + DPPO loss (the design is in :mod:`dppo_ext.fused_linear`'s docstring).

* :class:`FusedLinearRecompute`: per-row outputs, any upstream gradient; the backward recomputes the logits tile by
  tile (four LM-head products per training step).
* :class:`FusedLinearGradsInForward`: the aggregated loss, with the LM head's gradients computed in the forward
  chunk by chunk (three products, as the logits path), for :func:`dppo_ext.fused_linear_dppo_loss` in training
  (float32, bfloat16, float64: ``GRADS_IN_FORWARD_DTYPES``).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops  # noqa: F401  (loads dppo_ext._C, which registers torch.ops.dppo.*)
from ._autograd import grad_args, input_grads, refuse_double_backward
from ._lm_head_tiles import FusedLinearPlan, head_backward, logits_tiles, plan_chunks, upcast_mm
from ._rows import LossSettings, RowInputs
from .aggregation import aggregate_with
from .contract import IGNORE_INDEX, accumulation_dtype

__all__ = [
    "FusedLinearGradsInForward",
    "FusedLinearRecompute",
    "add_weight_grad",
    "aggregation_coefficients",
    "grads_in_forward_dtype",
    "grads_will_be_needed",
    "recompute_backward",
]

# dtypes whose LM-head gradients FusedLinearGradsInForward computes at an upstream gradient of 1 and scales by the
# real one in the backward. The logits path applies the upstream gradient to the logits gradient before its matmuls,
# in the dtype; scaling afterwards rounds the same way (exactly for a power of two such as AMP's loss scales, within
# one rounding otherwise) wherever every intermediate stays inside the dtype's exponent range. float32's and
# bfloat16's (and float64's) ranges, 1e-38..3e38, hold the gradients at every upstream scale a loss meets. float16's,
# 6e-8..65504, does not: the upstream scale decides which logits gradients underflow (AMP's GradScaler multiplies the
# loss by 2^16 so that they do not), so float16 keeps the recompute path, whose backward applies the upstream
# gradient before its products as the logits path does (one more LM-head product per step; docs/benchmarks.md).
GRADS_IN_FORWARD_DTYPES = (torch.float64, torch.float32, torch.bfloat16)
# Bytes of each block of the 16-bit product g^T @ h on its way into float32 partial sums (add_weight_grad).
SUM_BLOCK_BYTES = 1024 * 1024
# Gap, in units of the temperature-scaled logits, between a row's lse and the padding column of a vocabulary block.
OFF_BLOCK_GAP = 1.0e4


class FusedLinearRecompute(torch.autograd.Function):
    """Autograd function; see the module docstring for the forward/backward scheme."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows: RowInputs, settings: LossSettings, plan, weight_context):
        n = hidden.shape[0]
        outs = [torch.zeros(n, dtype=accumulation_dtype(hidden.dtype), device=hidden.device) for _ in range(7)]
        if n > 0:
            with weight_context():
                for tile in logits_tiles(hidden, weight, bias, plan.chunk_rows, logits_dtype=plan.logits_dtype):
                    chunk = rows.narrow(tile.rows)
                    chunk_outs = torch.ops.dppo.dppo_loss_forward(
                        tile.logits, *chunk.op_inputs, *settings.op_args(), chunk.kept_ids, settings.mask_direction
                    )
                    for out, chunk_out in zip(outs, chunk_outs):
                        out[tile.rows] = chunk_out
        loss, logp, divergence, mask, row_weight, entropy, lse = outs
        ctx.save_for_backward(hidden, weight, bias, rows.tokens, rows.advantages, row_weight, mask, entropy, lse)
        ctx.settings = settings
        ctx.plan = plan
        ctx.weight_context = weight_context
        ctx.kept_ids = rows.kept_ids  # an input, not an output: held as an attribute without a reference cycle
        ctx.mark_non_differentiable(divergence, mask, row_weight, lse)
        return loss, logp, divergence, mask, row_weight, entropy, lse

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):
        refuse_double_backward("fused_linear_dppo_loss")
        return input_grads(ctx, *recompute_backward(ctx, ctx.saved_tensors, ctx.plan, g_loss, g_logp, g_entropy))


def recompute_backward(ctx, saved, plan: FusedLinearPlan, g_loss, g_logp, g_entropy):
    """``(grad_hidden, grad_weight, grad_bias)`` from the upstream gradients of the per-row ``loss``, ``logp`` and
    ``entropy``, the logits recomputed in the tiles of ``plan``; ``saved``: ``(hidden, weight, bias, tokens,
    advantages, row_weight, mask, entropy, lse)``; ``ctx`` carries ``settings`` and ``weight_context``."""
    hidden, weight, bias, tokens, advantages, row_weight, mask, entropy, lse = saved
    settings = ctx.settings
    temperature = float(settings.temperature)
    grad_target, grad_entropy, entropy_arg = grad_args(
        settings.compute_entropy, advantages, mask, row_weight, g_loss, g_logp, g_entropy, entropy
    )
    valid = tokens != IGNORE_INDEX

    def tile_grad(tile):
        """d loss / d logits of one tile, written over its logits by the in-place backward op."""
        r, tok = tile.rows, tokens[tile.rows]
        if tile.has_spare_column:
            # A row whose token lies outside this vocabulary block points at the spare column, which holds a
            # finite logit far below the row's lse (probability 0); its gradient there is discarded.
            v0, width = tile.cols.start, tile.logits.shape[1]
            in_block = (tok >= v0) & (tok < tile.cols.stop)
            tok = torch.where(in_block, tok - v0, torch.full_like(tok, width))
            tok = torch.where(valid[r], tok, torch.full_like(tok, IGNORE_INDEX))
            tile.padded[:, width] = (lse[r] - OFF_BLOCK_GAP) * temperature
        ge = None if grad_entropy is None else grad_entropy[r]
        ent = None if entropy_arg is None else entropy_arg[r]
        kept = ctx.kept_ids
        if kept is not None:
            # this block's kept ids, local to it (-1 elsewhere: the backward writes 0 there)
            v0, v1 = tile.cols.start, tile.cols.stop
            kept = kept[r]
            kept = torch.where((kept >= v0) & (kept < v1), kept - v0, torch.full_like(kept, -1))
        torch.ops.dppo.dppo_loss_backward_(grad_target[r], ge, tile.padded, tok, lse[r], ent, temperature, kept)
        return tile.logits

    needs = ctx.needs_input_grad[:3]
    return head_backward(
        hidden, weight, bias, needs, plan.tile_rows, plan.vocab_block, tile_grad, ctx.weight_context, plan.logits_dtype
    )


class FusedLinearGradsInForward(torch.autograd.Function):
    """The aggregated loss, with the LM head's gradients computed in the forward (see the module docstring).

    Returns ``(loss, *per-row outputs)``; only the scalar ``loss`` is differentiable. ``valid [*lead]`` is the
    response mask the aggregation takes, ``coef [N]`` its ``d loss / d loss_rows``.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, rows: RowInputs, settings: LossSettings, plan, weight_context, valid, coef, accum
    ):
        n = hidden.shape[0]
        acc = accumulation_dtype(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        outs = [torch.zeros(n, dtype=acc, device=hidden.device) for _ in range(7)]
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=hidden.device) if need_bias else None
        weight_acc = None  # sum over chunks of g^T @ h in ``accum`` (add_weight_grad)
        temperature = float(settings.temperature)
        with weight_context():
            for tile in logits_tiles(hidden, weight, bias, plan.chunk_rows, logits_dtype=plan.logits_dtype):
                r = tile.rows
                part = rows.narrow(r)
                chunk = torch.ops.dppo.dppo_loss_forward(
                    tile.logits, *part.op_inputs, *settings.op_args(), part.kept_ids, settings.mask_direction
                )
                for out, chunk_out in zip(outs, chunk):
                    out[r] = chunk_out
                _loss, _logp, _div, mask, row_weight, entropy, lse = chunk
                grad_target, _, _ = grad_args(
                    settings.compute_entropy, rows.advantages[r], mask, row_weight, coef[r], 0.0, None, entropy
                )
                g = tile.logits  # overwritten with d loss / d logits
                torch.ops.dppo.dppo_loss_backward_(
                    grad_target, None, g, rows.tokens[r], lse, None, temperature, part.kept_ids
                )
                wide = g.dtype != hidden.dtype  # float32 logits of 16-bit inputs: float32 products
                if need_hidden:
                    if wide:
                        grad_hidden[r] = upcast_mm(g, weight)
                    else:
                        torch.mm(g, weight, out=grad_hidden[r])
                if need_weight:
                    weight_acc = add_weight_grad(weight_acc, g, tile.hidden.to(g.dtype) if wide else tile.hidden, accum)
                if need_bias:
                    grad_bias += g.sum(0, dtype=acc)
        grad_weight = None
        if need_weight:
            grad_weight = torch.zeros_like(weight) if weight_acc is None else weight_acc.to(weight.dtype)
            del weight_acc
        loss_rows, logp, divergence, mask, row_weight, entropy, lse = outs
        loss = aggregate_with(loss_rows.reshape(valid.shape), valid, settings)
        # not saved tensors: the backward hands them to autograd, which then holds the only reference (no copy)
        ctx.grads = [grad_hidden, grad_weight, None if grad_bias is None else grad_bias.to(bias.dtype)]
        ctx.save_for_backward(hidden, weight, bias, rows.tokens, rows.advantages, row_weight, mask, entropy, lse, coef)
        ctx.settings, ctx.weight_context, ctx.logits_dtype = settings, weight_context, plan.logits_dtype
        ctx.kept_ids = rows.kept_ids
        ctx.mark_non_differentiable(*outs)
        return loss, *outs

    @staticmethod
    def backward(ctx, g_loss, *_g_rows):
        refuse_double_backward("fused_linear_dppo_loss")
        grads, ctx.grads = ctx.grads, None
        if grads is not None:
            return input_grads(ctx, *(None if t is None else t.mul_(g_loss) for t in grads))
        # A second backward through the same graph (retain_graph=True): the first one took the forward's gradients.
        *saved, coef = ctx.saved_tensors
        hidden, weight = saved[:2]
        plan = plan_chunks(
            hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, logits_dtype=ctx.logits_dtype
        )
        grads = recompute_backward(ctx, saved, plan, g_loss * coef, torch.zeros_like(coef), None)
        return input_grads(ctx, *grads)


def add_weight_grad(weight_acc: Optional[torch.Tensor], g: torch.Tensor, h: torch.Tensor, accum: torch.dtype):
    """``weight_acc + g^T @ h`` in ``accum``, in place (``weight_acc`` None: the first chunk, a new tensor).

    ``h`` is in ``g``'s dtype. ``accum`` = ``g``'s dtype (the default): one product added into the sum itself (one
    rounding per chunk in 16-bit dtypes). Otherwise (16-bit ``g`` and ``accum_dtype=torch.float32``, or float32
    ``g`` of float32 logits and 16-bit ``accum``) the product is formed in blocks of
    ``SUM_BLOCK_BYTES`` of the gradient's rows, each still in cache when it is added into the float32 sum (one
    16-bit product buffer of the whole [V, H] would cost its size in memory and a round trip through it per chunk).
    """
    if accum == g.dtype:
        return torch.mm(g.t(), h) if weight_acc is None else weight_acc.addmm_(g.t(), h)
    vocab, hidden_size = g.shape[1], h.shape[1]
    first = weight_acc is None
    if first:
        weight_acc = torch.empty(vocab, hidden_size, dtype=accum, device=g.device)
    block = max(SUM_BLOCK_BYTES // (hidden_size * g.element_size()), 1)
    product = g.new_empty(min(block, vocab), hidden_size)
    widened = None if first else weight_acc.new_empty(product.shape)  # the block in float32, for an add of one dtype
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        out = torch.mm(g[:, v0:v1].t(), h, out=product[: v1 - v0])
        if first:
            weight_acc[v0:v1].copy_(out)
        else:
            weight_acc[v0:v1] += widened[: v1 - v0].copy_(out)
    return weight_acc


def grads_in_forward_dtype(dtype: torch.dtype) -> bool:
    """Whether the gradients of ``dtype`` inputs may be computed in the forward (``GRADS_IN_FORWARD_DTYPES``: any
    upstream gradient then gives the logits path's result); float16 keeps the recompute path."""
    return dtype in GRADS_IN_FORWARD_DTYPES


def grads_will_be_needed(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """Whether autograd will differentiate the loss w.r.t. the LM head's inputs (the forward then computes the
    gradients as it goes)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))


def aggregation_coefficients(valid: torch.Tensor, settings: LossSettings, dtype: torch.dtype) -> torch.Tensor:
    """``d loss / d loss_rows [N]`` of the aggregation (linear in the per-row loss), by differentiating it."""

    def aggregated(loss_rows: torch.Tensor) -> torch.Tensor:
        return aggregate_with(loss_rows.reshape(valid.shape), valid, settings)

    probe = torch.zeros(valid.numel(), dtype=dtype, device=valid.device)
    if torch.compiler.is_compiling():  # torch.compile traces torch.func.grad, not a tensor created with grad
        return torch.func.grad(aggregated)(probe)
    # eager: plain autograd (torch.func's first call imports torch._dynamo, ~140 MiB of resident memory)
    with torch.enable_grad():
        probe.requires_grad_(True)
        (coef,) = torch.autograd.grad(aggregated(probe), probe)
    return coef

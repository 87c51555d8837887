"""Fused LM-head + DPPO loss: the DPPO loss from the last hidden states, without an [N, V] logits tensor.

Math (docs/contract.md): ``logits = hidden @ weight^T (+ bias)``, then exactly ``torch.ops.dppo.dppo_loss_forward``
on those logits. Three entry points:

* :func:`fused_linear_dppo_loss` and the module :class:`FusedLinearDPPOLoss`: ``dppo_ext.dppo_loss`` with
  ``logits`` replaced by ``hidden [..., H]`` and ``weight [V, H]`` (+ ``bias [V]``): same arguments, per-mode
  defaults and ``(loss, metrics)`` result.
* :func:`fused_linear_dppo_loss_per_row`: the lower level, on flat rows; returns the op's
  ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each ``[N]``, differentiable w.r.t.
  ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` through ``loss``, ``logp`` and ``entropy``, for any upstream
  gradient (for callers that aggregate themselves or also train on ``logp``, e.g. a KL term).

Design (why recompute rather than Liger-style gradients-in-forward):
  Liger's fused linear cross-entropy computes the gradients during the forward, which needs the upstream gradient
  of every row to be known then (it reduces the loss itself). Our contract returns per-row outputs whose upstream
  gradients are arbitrary (the caller aggregates, may also use ``logp`` or ``entropy``), and
  ``grad_weight = sum_i g_i^T h_i`` cannot be formed from per-row summaries without storing the [N, V] gradient.
  So the forward only keeps the per-row ``lse`` and ``entropy`` ([N] each) and the backward recomputes the logits
  tile by tile. Cost: one extra LM-head matmul (4 N*V*H multiply-adds per step instead of 3).

  Forward: row chunks of ``chunk_rows`` rows: ``buf[:rows] = h_c @ W^T (+ b)`` into one reused ``[chunk_rows, V]``
  buffer, then the logits op on it (the op needs whole rows for the log-sum-exp and the top-K divergence).
  Backward: tiles of ``tile_rows`` x ``vocab_block``, vocabulary blocks outermost. Per tile, the logits are
  recomputed into one reused buffer and ``torch.ops.dppo.dppo_loss_backward_`` overwrites them in place with
  ``d loss / d logits`` (it takes the saved ``lse`` and ``entropy``: each gradient element depends only on its own
  logit, so a tile needs no other column). A row whose sampled token lies outside the tile's vocabulary block
  points at one extra column; its gradient is discarded, and it holds a finite logit ``1e4 * T`` below the row's
  ``lse`` (probability 0) rather than whatever the reused buffer held.
  Then ``grad_hidden += g @ W_b``, ``grad_weight[b] += g^T @ h``, ``grad_bias[b] += g.sum(0)``.
  With all rows in one tile (the usual automatic plan) each ``grad_weight`` block is a single matmul, as precise as
  the logits path; partial sums across tiles are accumulated in float32 (float64 for float64 inputs).

Tied embeddings: ``weight`` may be the input embedding's parameter; autograd adds this function's ``grad_weight``
to the embedding's own gradient.

Sharded weights: the function needs the full ``weight`` (FSDP / ZeRO-3 must gather it, see docs/distributed.md);
pass ``weight_context`` to re-enter such a gather in the backward.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence

import torch

from .contract import check_token_ids, resolve_loss_settings, resolve_op_settings
from .loss import (_check_row_shapes, _check_topk_shapes, _flat_rows, _LossModule, aggregate_loss, broadcast_advantages,
                   dppo_metrics)
from .ops import _NO_DOUBLE_BACKWARD, DPPOOutputs, _acc_dtype, check_no_functorch

__all__ = [
    "FusedLinearDPPOLoss", "FusedLinearPlan", "fused_linear_dppo_loss", "fused_linear_dppo_loss_per_row", "plan_chunks",
]

# Gap, in units of the temperature-scaled logits, between a row's lse and the padding column of a vocabulary block.
_OFF_BLOCK_GAP = 1.0e4
# Smallest vocabulary block the automatic plan uses before it also splits rows (keeps matmuls efficient).
_MIN_VOCAB_BLOCK = 2048
# Default memory budget for one logits buffer: max(this, the size of ``hidden``).
_DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FusedLinearPlan:
    """Chunking of one fused-linear call.

    chunk_rows: rows per forward chunk (forward buffer ``[chunk_rows, V]``).
    tile_rows, vocab_block: backward tile (buffer ``[tile_rows, vocab_block + 1]``).
    """

    chunk_rows: int
    tile_rows: int
    vocab_block: int

    def buffer_bytes(self, vocab: int, element_size: int) -> int:
        """Largest logits buffer the plan allocates, in bytes."""
        forward = self.chunk_rows * vocab
        backward = self.tile_rows * (self.vocab_block + (1 if self.vocab_block < vocab else 0))
        return max(forward, backward) * element_size


def plan_chunks(
    num_rows: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
) -> FusedLinearPlan:
    """Choose chunk sizes for ``num_rows`` rows, a ``[vocab, hidden_size]`` weight and ``dtype``.

    Automatic plan: a logits buffer of at most ``memory_budget_bytes`` (default: max(64 MiB, the size of the hidden
    states [N, H])). Forward chunks take as many whole rows as fit. The backward keeps all rows in one tile and
    splits the vocabulary into blocks of at least 2048 columns; only when even that does not fit are rows split too.
    ``chunk_size`` (rows) overrides the forward chunk and the backward tile rows; ``vocab_chunk_size`` overrides the
    backward vocabulary block (default with ``chunk_size``: the whole vocabulary).
    """
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if memory_budget_bytes is not None and memory_budget_bytes < 1:
        raise ValueError(f"memory_budget_bytes must be positive or None, got {memory_budget_bytes!r}")
    rows = max(num_rows, 1)
    element_size = torch.empty((), dtype=dtype).element_size()
    if memory_budget_bytes is None:
        memory_budget_bytes = max(_DEFAULT_BUDGET_BYTES, rows * hidden_size * element_size)
    budget_elems = max(memory_budget_bytes // element_size, 1)
    if chunk_size is not None:
        chunk_rows = min(chunk_size, rows)
        tile_rows = chunk_rows
        vocab_block = min(vocab_chunk_size or vocab, vocab)
        return FusedLinearPlan(chunk_rows, tile_rows, vocab_block)
    chunk_rows = min(max(budget_elems // vocab, 1), rows)
    if vocab_chunk_size is not None:
        vocab_block = min(vocab_chunk_size, vocab)
    elif rows * vocab <= budget_elems:
        vocab_block = vocab
    else:
        # one column of every blocked tile is the off-block padding column
        vocab_block = min(vocab, max(budget_elems // rows - 1, _MIN_VOCAB_BLOCK))
    tile_rows = min(rows, max(budget_elems // (vocab_block + 1), 1))
    return FusedLinearPlan(chunk_rows, tile_rows, vocab_block)


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    tokens: torch.Tensor,
    per_row: dict[str, Optional[torch.Tensor]],
    topk_ids: Optional[torch.Tensor],
    topk_logprobs: Optional[torch.Tensor],
) -> None:
    """Shape/dtype/device checks the per-chunk op cannot phrase in terms of the whole call."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be 2-D [V, H] with H={hidden.shape[1]} (hidden's last dim), got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype must equal hidden dtype {hidden.dtype}, got {weight.dtype}")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"hidden must be float32, float16, bfloat16 or float64, got {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight must be on hidden's device {hidden.device}, got {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] with V={weight.shape[0]}, got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(
                f"bias must have hidden's dtype {hidden.dtype} and device {hidden.device}, "
                f"got {bias.dtype} on {bias.device}"
            )
    n = hidden.shape[0]
    if tokens.shape != (n,):
        raise ValueError(f"tokens must be 1-D with N={n} rows (hidden's first dim), got shape {tuple(tokens.shape)}")
    for name, tensor in per_row.items():
        if tensor is not None and tensor.shape != (n,):
            raise ValueError(f"{name} must be 1-D with N={n} rows, got shape {tuple(tensor.shape)}")
    for name, tensor in (("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
        if tensor is not None and (tensor.dim() != 2 or tensor.shape[0] != n):
            raise ValueError(f"{name} must be 2-D [N={n}, K], got shape {tuple(tensor.shape)}")


def _rows(t: Optional[torch.Tensor], start: int, end: int) -> Optional[torch.Tensor]:
    return None if t is None else t[start:end]


class _FusedLinearDPPO(torch.autograd.Function):
    """Autograd function; see the module docstring for the forward/backward scheme."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        topk_ids: Optional[torch.Tensor],
        topk_logprobs: Optional[torch.Tensor],
        anchor_logprobs: Optional[torch.Tensor],
        mode: str,
        temperature: float,
        delta_low: float,
        delta_high: float,
        ratio_cap: float,
        compute_entropy: bool,
        plan: FusedLinearPlan,
        weight_context: Callable[[], ContextManager],
    ):
        n, vocab = hidden.shape[0], weight.shape[0]
        accum = _acc_dtype(hidden.dtype)
        outs = [torch.zeros(n, dtype=accum, device=hidden.device) for _ in range(7)]
        if n > 0:
            buf = hidden.new_empty(min(plan.chunk_rows, n), vocab)
            with weight_context():
                for start in range(0, n, plan.chunk_rows):
                    end = min(start + plan.chunk_rows, n)
                    logits = buf[: end - start]
                    torch.mm(hidden[start:end], weight.t(), out=logits)
                    if bias is not None:
                        logits.add_(bias)
                    chunk_outs = torch.ops.dppo.dppo_loss_forward(
                        logits,
                        tokens[start:end],
                        rollout_logprobs[start:end],
                        advantages[start:end],
                        _rows(topk_ids, start, end),
                        _rows(topk_logprobs, start, end),
                        _rows(anchor_logprobs, start, end),
                        mode,
                        temperature,
                        delta_low,
                        delta_high,
                        ratio_cap,
                        compute_entropy,
                    )
                    for out, chunk_out in zip(outs, chunk_outs):
                        out[start:end] = chunk_out
            del buf
        loss, logp, divergence, mask, row_weight, entropy, lse = outs
        ctx.save_for_backward(hidden, weight, bias, tokens, advantages, row_weight, mask, entropy, lse)
        ctx.temperature = temperature
        ctx.compute_entropy = compute_entropy
        ctx.plan = plan
        ctx.weight_context = weight_context
        ctx.mark_non_differentiable(divergence, mask, row_weight, lse)
        return loss, logp, divergence, mask, row_weight, entropy, lse

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD.format(what="fused_linear_dppo_loss"))
        hidden, weight, bias, tokens, advantages, row_weight, mask, entropy, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias is not None
        n, hidden_size = hidden.shape
        vocab = weight.shape[0]
        accum = _acc_dtype(hidden.dtype)
        temperature, plan = ctx.temperature, ctx.plan

        grad_target = torch.zeros(n, dtype=accum, device=hidden.device)
        if g_loss is not None:
            grad_target += g_loss * (-advantages.to(accum) * row_weight * mask)
        if g_logp is not None:
            grad_target += g_logp
        # Upstream grads may be expanded (stride 0) views, e.g. from ``entropy.sum()``.
        grad_entropy = g_entropy.to(accum).contiguous() if (ctx.compute_entropy and g_entropy is not None) else None
        entropy_arg = entropy if grad_entropy is not None else None

        # Contiguous gradients: the tiles' matmuls write row/column blocks of them in place.
        grad_hidden = torch.zeros(n, hidden_size, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(vocab, hidden_size, dtype=weight.dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(vocab, dtype=accum, device=hidden.device) if need_bias else None
        if n == 0 or not (need_hidden or need_weight or need_bias):
            return _grads(grad_hidden, grad_weight, grad_bias, bias)

        vocab_blocks = math.ceil(vocab / plan.vocab_block)
        row_tiles = math.ceil(n / plan.tile_rows)
        # float32 accumulators only where partial sums are added across tiles.
        hidden_acc = (
            torch.zeros(n, hidden_size, dtype=accum, device=hidden.device)
            if need_hidden and vocab_blocks > 1
            else None
        )
        blocked = vocab_blocks > 1
        tile_rows = min(plan.tile_rows, n)
        buf = hidden.new_empty(tile_rows, plan.vocab_block + (1 if blocked else 0))
        valid = tokens != -100
        with ctx.weight_context():
            for v0 in range(0, vocab, plan.vocab_block):
                v1 = min(v0 + plan.vocab_block, vocab)
                width = v1 - v0
                w_block = weight[v0:v1]
                weight_acc = (
                    torch.zeros(width, hidden_size, dtype=accum, device=hidden.device)
                    if need_weight and row_tiles > 1
                    else None
                )
                for r0 in range(0, n, tile_rows):
                    r1 = min(r0 + tile_rows, n)
                    h = hidden[r0:r1]
                    tile = buf[: r1 - r0, : width + (1 if blocked else 0)]
                    logits = tile[:, :width]
                    torch.mm(h, w_block.t(), out=logits)
                    if bias is not None:
                        logits.add_(bias[v0:v1])
                    tok = tokens[r0:r1]
                    if blocked:
                        in_block = (tok >= v0) & (tok < v1)
                        tok = torch.where(in_block, tok - v0, torch.full_like(tok, width))
                        tok = torch.where(valid[r0:r1], tok, torch.full_like(tok, -100))
                        tile[:, width] = (lse[r0:r1] - _OFF_BLOCK_GAP) * temperature
                    torch.ops.dppo.dppo_loss_backward_(
                        grad_target[r0:r1],
                        _rows(grad_entropy, r0, r1),
                        tile,
                        tok,
                        lse[r0:r1],
                        _rows(entropy_arg, r0, r1),
                        temperature,
                    )
                    g = tile[:, :width]
                    if need_hidden:
                        if hidden_acc is None:
                            torch.mm(g, w_block, out=grad_hidden[r0:r1])
                        else:
                            hidden_acc[r0:r1] += torch.mm(g, w_block)
                    if need_weight:
                        if weight_acc is None:
                            torch.mm(g.t(), h, out=grad_weight[v0:v1])
                        else:
                            weight_acc += torch.mm(g.t(), h)
                    if need_bias:
                        grad_bias[v0:v1] += g.sum(0, dtype=accum)
                if weight_acc is not None:
                    grad_weight[v0:v1] = weight_acc
        if hidden_acc is not None:
            grad_hidden.copy_(hidden_acc)
        return _grads(grad_hidden, grad_weight, grad_bias, bias)


def _grads(grad_hidden, grad_weight, grad_bias, bias):
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return (grad_hidden, grad_weight, grad_bias) + (None,) * 14


def fused_linear_dppo_loss_per_row(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logprobs: Optional[torch.Tensor] = None,
    anchor_logprobs: Optional[torch.Tensor] = None,
    mode: str = "binary_tv",
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    weight_context: Optional[Callable[[], ContextManager]] = None,
    vocab_parallel_group: Optional["torch.distributed.ProcessGroup"] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> DPPOOutputs:
    """DPPO per-row outputs of ``hidden @ weight^T (+ bias)`` without materialising the logits (lower level).

    Most callers want :func:`fused_linear_dppo_loss` (any leading shape, ``response_mask``, aggregation, metrics).

    Same contract and outputs as ``dppo_ext.ops.dppo_loss_forward`` applied to ``hidden @ weight.T + bias``
    (docs/contract.md), with exact gradients for ``hidden``, ``weight`` and ``bias`` through ``loss``, ``logp``
    and ``entropy``.

    Args:
        hidden: [N, H] last hidden states (float32/float16/bfloat16/float64).
        weight: [V, H] LM-head weight (same dtype/device as ``hidden``; may be a tied input embedding).
        tokens: [N] int64 sampled token ids; -100 marks padding rows (all outputs 0, no gradient).
        rollout_logprobs: [N] rollout log-probs of ``tokens``; advantages: [N].
        bias: optional [V] LM-head bias.
        topk_ids, topk_logprobs: [N, K] rollout top-K (top-K modes); anchor_logprobs: optional [N].
        mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy: as ``dppo_ext.ops.dppo_loss_forward``
            (mode aliases such as verl's ``dppo_tv`` are accepted; ``None`` thresholds -> ``DEFAULT_DELTAS[mode]``).
        chunk_size: rows per chunk (forward and backward); None chooses it from N, V, H and dtype.
        vocab_chunk_size: vocabulary columns per backward tile; None: automatic (all of V with ``chunk_size``).
        memory_budget_bytes: cap for one logits buffer in the automatic plan (default max(64 MiB, size of hidden)).
        weight_context: zero-argument callable returning a context manager entered around every use of
            ``weight``/``bias`` in forward and backward (e.g. a DeepSpeed ZeRO-3 gather).
        vocab_parallel_group: the tensor-parallel group when ``weight`` is this rank's ``[V_local, H]`` slice of
            a vocabulary-sharded LM head (``bias`` its ``[V_local]``); ``hidden`` and the per-row inputs are
            replicated, ids global. See ``dppo_ext.vocab_parallel.fused_linear_dppo_loss_vocab_parallel``
            (``vocab_chunk_size`` and ``weight_context`` do not apply there).
        vocab_offsets: ``[W + 1]`` global offsets of the ranks' slices; None derives them (one all-gather).

    Returns:
        ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each [N] in float32 (float64 for
        float64 inputs).
    """
    settings = resolve_op_settings(mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy)
    check_no_functorch("fused_linear_dppo_loss", hidden, weight, bias)
    if vocab_parallel_group is not None:
        if vocab_chunk_size is not None or weight_context is not None:
            raise ValueError("vocab_chunk_size and weight_context are not supported with vocab_parallel_group (each "
                             "rank's weight slice is used whole and must be materialised)")
        from .vocab_parallel import fused_linear_dppo_loss_vocab_parallel

        return fused_linear_dppo_loss_vocab_parallel(
            hidden, weight, tokens, rollout_logprobs, advantages, bias=bias, topk_ids=topk_ids,
            topk_logprobs=topk_logprobs, anchor_logprobs=anchor_logprobs, **settings._asdict(), chunk_size=chunk_size,
            memory_budget_bytes=memory_budget_bytes, group=vocab_parallel_group, vocab_offsets=vocab_offsets)
    _check_inputs(
        hidden,
        weight,
        bias,
        tokens,
        {
            "rollout_logprobs": rollout_logprobs,
            "advantages": advantages,
            "anchor_logprobs": anchor_logprobs,
        },
        topk_ids,
        topk_logprobs,
    )
    plan = plan_chunks(
        hidden.shape[0],
        weight.shape[0],
        hidden.shape[1],
        hidden.dtype,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        memory_budget_bytes=memory_budget_bytes,
    )
    outs = _FusedLinearDPPO.apply(
        hidden,
        weight,
        bias,
        tokens,
        rollout_logprobs,
        advantages,
        topk_ids,
        topk_logprobs,
        anchor_logprobs,
        *settings.op_args(),
        plan,
        weight_context or contextlib.nullcontext,
    )
    return DPPOOutputs(*outs)


def fused_linear_dppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    mode: str = "binary_tv",
    topk_ids: Optional[torch.Tensor] = None,
    topk_logprobs: Optional[torch.Tensor] = None,
    anchor_logprobs: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: Optional[float] = None,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    weight_context: Optional[Callable[[], ContextManager]] = None,
    vocab_parallel_group: Optional["torch.distributed.ProcessGroup"] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``dppo_ext.dppo_loss`` from hidden states and the LM-head weight, without an ``[N, V]`` logits tensor.

    Same arguments, per-mode defaults and result as :func:`dppo_ext.dppo_loss` (``response_mask``,
    ``loss_agg_mode``, ``None`` thresholds -> ``DEFAULT_DELTAS[mode]``, the same metrics dict), with ``logits``
    replaced by ``hidden`` and ``weight`` (+ ``bias``). There is no ``inplace_backward``: no logits buffer
    outlives the call.

    Args:
        hidden: ``[..., H]`` last hidden states at the response positions (``[B, T, H]`` or ``[N, H]``;
            float32/float16/bfloat16/float64). ``[B, T, H]`` allows per-sequence ``advantages [B]`` and the
            sequence aggregation modes.
        weight: ``[V, H]`` LM-head weight (same dtype/device as ``hidden``; may be a tied input embedding).
        tokens, rollout_logprobs, advantages, response_mask, mode, topk_ids, topk_logprobs, anchor_logprobs,
            temperature, delta_low, delta_high, ratio_cap, loss_agg_mode, loss_scale_factor, compute_entropy:
            as :func:`dppo_ext.dppo_loss` (shapes ``[...]`` = hidden's leading dims).
        bias: optional ``[V]`` LM-head bias.
        chunk_size, vocab_chunk_size, memory_budget_bytes, weight_context: chunking and weight gathering, see
            :func:`fused_linear_dppo_loss_per_row`.
        vocab_parallel_group, vocab_offsets: ``weight [V_local, H]`` (``bias [V_local]``) is this rank's slice of a
            vocabulary-sharded LM head (see :func:`fused_linear_dppo_loss_per_row`, docs/distributed.md).

    Returns:
        ``(loss, metrics)``: the scalar loss and the dict of 0-d metric tensors of :func:`dppo_ext.dppo_metrics`.
    """
    mode, delta_low, delta_high = resolve_loss_settings(mode, delta_low, delta_high, loss_agg_mode, loss_scale_factor)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [..., H] with at least 2 dims, got shape {tuple(hidden.shape)}")
    lead, hidden_size = hidden.shape[:-1], hidden.shape[-1]
    _check_row_shapes(lead, "hidden's leading dims", tokens=tokens, rollout_logprobs=rollout_logprobs,
                      response_mask=response_mask, anchor_logprobs=anchor_logprobs)
    check_token_ids("tokens", tokens)
    check_token_ids("topk_ids", topk_ids)
    advantages = broadcast_advantages(advantages, lead, "hidden")
    _check_topk_shapes(lead, topk_ids, topk_logprobs)
    rows = _flat_rows(lead, _acc_dtype(hidden.dtype), hidden.device, tokens, rollout_logprobs, advantages,
                      response_mask, topk_ids, topk_logprobs, anchor_logprobs)
    out = fused_linear_dppo_loss_per_row(
        hidden.reshape(lead.numel(), hidden_size),
        weight,
        rows.tokens,
        rows.rollout_logprobs,
        rows.advantages,
        bias=bias,
        topk_ids=rows.topk_ids,
        topk_logprobs=rows.topk_logprobs,
        anchor_logprobs=rows.anchor_logprobs,
        mode=mode,
        temperature=temperature,
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=ratio_cap,
        compute_entropy=compute_entropy,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        memory_budget_bytes=memory_budget_bytes,
        weight_context=weight_context,
        vocab_parallel_group=vocab_parallel_group,
        vocab_offsets=vocab_offsets,
    )
    loss = aggregate_loss(out.loss.reshape(lead), rows.valid, loss_agg_mode, loss_scale_factor)
    return loss, dppo_metrics(out, rows.rollout_logprobs, rows.advantages, rows.valid.reshape(lead.numel()))


class FusedLinearDPPOLoss(_LossModule):
    """``nn.Module`` form of :func:`fused_linear_dppo_loss` (as Liger's ``LigerFusedLinearGRPOLoss``).

    Holds the settings; ``forward`` takes the hidden states, the LM-head weight (and bias) and the rollout tensors.

    Example::

        crit = FusedLinearDPPOLoss(mode="binary_tv", loss_agg_mode="token-mean")
        hidden = model.model(input_ids).last_hidden_state[:, prompt_len - 1 : -1]  # [B, T, H]
        loss, metrics = crit(hidden, model.lm_head.weight, tokens, rollout_logprobs, advantages,
                             response_mask=mask)
    """

    def __init__(
        self,
        mode: str = "binary_tv",
        *,
        temperature: float = 1.0,
        delta_low: Optional[float] = None,
        delta_high: Optional[float] = None,
        ratio_cap: float = 10.0,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: Optional[float] = None,
        compute_entropy: bool = True,
        chunk_size: Optional[int] = None,
        vocab_chunk_size: Optional[int] = None,
        memory_budget_bytes: Optional[int] = None,
        vocab_parallel_group: Optional["torch.distributed.ProcessGroup"] = None,
        vocab_offsets: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(mode, temperature, delta_low, delta_high, ratio_cap, loss_agg_mode, loss_scale_factor,
                         compute_entropy, vocab_parallel_group, vocab_offsets)
        plan_chunks(1, 1, 1, torch.float32, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                    memory_budget_bytes=memory_budget_bytes)  # the chunking settings' own checks
        self.chunk_size = chunk_size
        self.vocab_chunk_size = vocab_chunk_size
        self.memory_budget_bytes = memory_budget_bytes

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        response_mask: Optional[torch.Tensor] = None,
        topk_ids: Optional[torch.Tensor] = None,
        topk_logprobs: Optional[torch.Tensor] = None,
        anchor_logprobs: Optional[torch.Tensor] = None,
        weight_context: Optional[Callable[[], ContextManager]] = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fused_linear_dppo_loss(
            hidden, weight, tokens, rollout_logprobs, advantages, bias=bias, response_mask=response_mask,
            topk_ids=topk_ids, topk_logprobs=topk_logprobs, anchor_logprobs=anchor_logprobs,
            chunk_size=self.chunk_size, vocab_chunk_size=self.vocab_chunk_size,
            memory_budget_bytes=self.memory_budget_bytes, weight_context=weight_context, **self._settings())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}"

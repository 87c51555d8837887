"""Fused LM-head + DPPO loss: the DPPO loss from the last hidden states, without an [N, V] logits tensor.

Math (docs/contract.md): ``logits = hidden @ weight^T (+ bias)``, then exactly ``torch.ops.dppo.dppo_loss_forward``
on those logits. Three entry points:

* :func:`fused_linear_dppo_loss` (and its module form ``dppo_ext.FusedLinearDPPOLoss``): ``dppo_ext.dppo_loss`` with
  ``logits`` replaced by ``hidden [..., H]`` and ``weight [V, H]`` (+ ``bias [V]``): same arguments, per-mode
  defaults and ``(loss, metrics)`` result.
* :func:`fused_linear_dppo_loss_per_row`: the lower level, on flat rows; returns the op's
  ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each ``[N]``, differentiable w.r.t.
  ``hidden [N, H]``, ``weight [V, H]`` and ``bias [V]`` through ``loss``, ``logp`` and ``entropy``, for any upstream
  gradient (for callers that aggregate themselves or also train on ``logp``, e.g. a KL term).

Design: two paths, both three LM-head products per training step where they can be.
  Gradients in the forward (``fused_linear_dppo_loss`` / ``FusedLinearDPPOLoss`` when autograd will differentiate
  the loss, the training step): the aggregated loss is linear in the per-row losses, so each row's upstream gradient
  is known in the forward up to the one scalar that reaches ``loss`` (``coef = d loss / d loss_rows``, from the
  aggregation itself). Per row chunk of ``plan_chunks(grads_in_forward=True)``: the chunk's logits, the loss op on
  them, ``torch.ops.dppo.dppo_loss_backward_`` overwriting them with ``d loss / d logits`` for ``coef``, then
  ``grad_hidden[c] = g @ W`` and ``grad_weight += g^T @ h_c`` (into the gradient itself; ``accum_dtype=float32``
  keeps float32 partial sums for bfloat16 inputs), ``grad_bias += g.sum(0)`` (in float32): three
  products in all, as the logits path, and no logits kept. The backward scales the forward's gradients by the
  upstream scalar in place and hands them to autograd (a second backward through the same graph recomputes them).
  Only ``loss`` is differentiable there (the metrics are computed without grad). float32, bfloat16 and float64 only:
  scaling after the products rounds as the logits path does (which scales the logits gradient before them) only
  where nothing leaves the dtype's exponent range, and float16's 6e-8..65504 is where an upstream scale such as AMP's
  GradScaler 2^16 decides what underflows (``_fused_autograd.GRADS_IN_FORWARD_DTYPES``).
  Recompute (``fused_linear_dppo_loss_per_row``, the vocabulary-parallel form, an explicit ``vocab_chunk_size``,
  float16, and no gradient in the forward): the per-row outputs may get any upstream gradient (the caller
  aggregates, may also use ``logp`` or ``entropy``), and ``grad_weight = sum_i g_i^T h_i`` cannot be formed from
  per-row summaries without storing the [N, V] gradient. So the forward only keeps the per-row ``lse`` and
  ``entropy`` ([N] each) and the backward recomputes the logits tile by tile: one extra LM-head product
  (4 N*V*H multiply-adds per step).

  Every pass iterates ``dppo_ext._lm_head_tiles.logits_tiles``, which computes each tile's logits into one reused
  buffer.
  Recompute forward: row chunks of ``chunk_rows`` rows: ``buf[:rows] = h_c @ W^T (+ b)`` into a ``[chunk_rows, V]``
  buffer, then the logits op on it (the op needs whole rows for the log-sum-exp and the top-K divergence).
  Recompute backward: tiles of ``tile_rows`` x ``vocab_block``, vocabulary blocks outermost. Per tile, the logits are
  recomputed and ``torch.ops.dppo.dppo_loss_backward_`` overwrites them in place with
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
pass ``weight_context`` to re-enter such a gather in the backward (the gradients-in-forward path uses ``weight``
in the forward only).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence

import torch

from . import ops  # noqa: F401  (loads dppo_ext._C, which registers torch.ops.dppo.*)
from ._agreement import vocab_parallel_call
from ._autograd import check_no_functorch
from ._fused_autograd import (
    FusedLinearGradsInForward,
    aggregation_coefficients,
    grads_in_forward_dtype,
    grads_will_be_needed,
)
from ._fused_rows import per_row_outputs
from ._lm_head_tiles import (
    check_fused_inputs,
    plan_chunks,
    resolve_accum_dtype,
    resolve_logits_dtype,
)
from ._rows import DPPOOutputs, LossSettings, RowInputs, check_tensors, prepare_rows
from ._vocab_split import check_split_args
from .aggregation import aggregate_with, compose_rows, dppo_metrics
from .contract import DEFAULT_AGG_MODE, DEFAULT_MASK_DIRECTION, DEFAULT_MODE, DEFAULT_RATIO_CAP, accumulation_dtype
from .sequence_mask import SequenceMask, lead_sequences, sequence_index

__all__ = ["fused_linear_dppo_loss", "fused_linear_dppo_loss_per_row"]


def fused_linear_dppo_loss_per_row(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    mode: str = DEFAULT_MODE,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logprobs: Optional[torch.Tensor] = None,
    anchor_logprobs: Optional[torch.Tensor] = None,
    kept_ids: Optional[torch.Tensor] = None,
    sequence_ids: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    logits_dtype: Optional[torch.dtype] = None,
    weight_context: Optional[Callable[[], ContextManager]] = None,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
    reduce_hidden_grad: bool = True,
) -> DPPOOutputs:
    """DPPO per-row outputs of ``hidden @ weight^T (+ bias)`` without materialising the logits (lower level).

    Most callers want :func:`fused_linear_dppo_loss` (any leading shape, ``response_mask``, aggregation, metrics).

    Same contract, argument names, per-mode defaults and outputs as :func:`dppo_ext.dppo_loss_per_row` applied to
    ``hidden @ weight.T + bias`` (docs/contract.md), with exact gradients for ``hidden``, ``weight`` and ``bias``
    through ``loss``, ``logp`` and ``entropy``.

    Args:
        hidden: [N, H] last hidden states (float32/float16/bfloat16/float64).
        weight: [V, H] LM-head weight (same dtype/device as ``hidden``; may be a tied input embedding).
        tokens: [N] int64 sampled token ids; ``IGNORE_INDEX`` (-100) marks padding rows (all outputs 0, no
            gradient).
        rollout_logprobs: [N] rollout log-probs of ``tokens``; advantages: [N].
        bias: optional [V] LM-head bias.
        topk_ids, topk_logprobs: [N, K] rollout top-K (top-K modes); anchor_logprobs: optional [N].
        mode, mask_direction, kl_tau, kl_mask_type, sequence_mask, sequence_ids, cu_seqlens, temperature, delta_low,
            delta_high, ratio_cap, compute_entropy: as :func:`dppo_ext.dppo_loss_per_row`
            (mode aliases such as verl's ``dppo_tv`` are accepted; ``None`` thresholds -> ``DEFAULT_DELTAS[mode]``).
        chunk_size: rows per chunk (forward and backward); None chooses it from N, V, H and dtype.
        vocab_chunk_size: vocabulary columns per backward tile; None: automatic (all of V with ``chunk_size``).
        memory_budget_bytes: cap for one logits buffer in the automatic plan (default max(64 MiB, size of hidden)).
        logits_dtype: the dtype of the logits tiles: None (default) or hidden's dtype, or ``torch.float32`` for
            bfloat16/float16 inputs: every LM-head product (the logits, ``g @ W``, ``g^T @ h``) is accumulated and kept
            in float32, each gradient rounded once to its dtype; the weight is widened a block at a time (16 MiB), never
            copied whole. The logits are then those of an fp32 LM head (vLLM's fp32 ``head_dtype``). Not with
            ``vocab_parallel_group`` yet.
        weight_context: zero-argument callable returning a context manager entered around every use of
            ``weight``/``bias`` in forward and backward (e.g. a DeepSpeed ZeRO-3 gather).
        vocab_parallel_group: the tensor-parallel group when ``weight`` is this rank's ``[V_local, H]`` slice of
            a vocabulary-sharded LM head (``bias`` its ``[V_local]``); ``hidden`` and the per-row inputs are
            replicated, ids global (``dppo_ext.vocab_parallel``, docs/distributed.md). Neither the logits nor the
            whole head exist on any rank: row chunks of ``hidden @ weight.T`` go through the statistics op, one
            all-gather merges them, the backward recomputes each chunk (``vocab_chunk_size`` and ``weight_context``
            do not apply there).
        vocab_offsets: ``[W + 1]`` global offsets of the ranks' slices; None derives them from the ranks' widths.
        reduce_hidden_grad: with ``vocab_parallel_group``, all-reduce the hidden-state gradient over the group (the
            sum of every slice's contribution), as Megatron's column-parallel linear does; pass False when the
            framework reduces it itself (e.g. a reduce-scatter under sequence parallelism). No effect without a
            group.

    Returns:
        ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each [N] in float32 (float64 for
        float64 inputs).
    """
    check_split_args(vocab_parallel_group, vocab_offsets)
    with vocab_parallel_call(vocab_parallel_group) as rendezvous:
        settings = LossSettings.resolve(
            mode,
            temperature,
            delta_low,
            delta_high,
            ratio_cap,
            compute_entropy,
            mask_direction=mask_direction,
            kl_tau=kl_tau,
            kl_mask_type=kl_mask_type,
            sequence_mask=sequence_mask,
        )
        check_tensors(hidden=hidden, weight=weight, bias=bias, sequence_ids=sequence_ids, cu_seqlens=cu_seqlens)
        check_no_functorch("fused_linear_dppo_loss", hidden, weight, bias)
        rows = RowInputs.of(tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, kept_ids)
        sequences = sequence_index(hidden.shape[0], hidden.device, sequence_ids, cu_seqlens)
        out = per_row_outputs(
            hidden,
            weight,
            bias,
            rows,
            settings,
            chunk_size,
            vocab_chunk_size,
            memory_budget_bytes,
            weight_context,
            rendezvous,
            vocab_offsets,
            reduce_hidden_grad,
            logits_dtype,
        )
        return compose_rows(out, rows, settings, *sequences)[0]


def fused_linear_dppo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    mode: str = DEFAULT_MODE,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
    topk_ids: Optional[torch.Tensor] = None,
    topk_logprobs: Optional[torch.Tensor] = None,
    anchor_logprobs: Optional[torch.Tensor] = None,
    kept_ids: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    loss_agg_mode: str = DEFAULT_AGG_MODE,
    loss_scale_factor: Optional[float] = None,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    accum_dtype: Optional[torch.dtype] = None,
    logits_dtype: Optional[torch.dtype] = None,
    weight_context: Optional[Callable[[], ContextManager]] = None,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``dppo_ext.dppo_loss`` from hidden states and the LM-head weight, without an ``[N, V]`` logits tensor.

    Same arguments, per-mode defaults and result as :func:`dppo_ext.dppo_loss` (``response_mask``,
    ``loss_agg_mode``, ``None`` thresholds -> ``DEFAULT_DELTAS[mode]``, the same metrics dict), with ``logits``
    replaced by ``hidden`` and ``weight`` (+ ``bias``). There is no ``inplace_backward``: no logits buffer
    outlives the call. When grad is enabled and ``hidden``, ``weight`` or ``bias`` requires grad, the forward also
    computes their gradients, chunk by chunk (three LM-head products per training step in all, as the logits path);
    evaluate under ``torch.no_grad()`` to skip that work. Except in float16: there the backward recomputes the
    logits and applies the upstream gradient (e.g. AMP's loss scale) before its products, as the logits path does,
    so that what underflows is the same (four products; float32 and bfloat16 give the logits path's gradients for
    any upstream scale with three). And with ``kl_tau`` or a ``sequence_mask``: every row's log-prob must be known
    before any row's gradient, so the backward recomputes the logits (four products; docs/contract.md).

    Args:
        hidden: ``[..., H]`` last hidden states at the response positions (``[B, T, H]`` or ``[N, H]``;
            float32/float16/bfloat16/float64). ``[B, T, H]`` allows per-sequence ``advantages [B]`` and the
            sequence aggregation modes.
        weight: ``[V, H]`` LM-head weight (same dtype/device as ``hidden``; may be a tied input embedding).
        tokens, rollout_logprobs, advantages, response_mask, mode, mask_direction, kl_tau, kl_mask_type,
            sequence_mask, topk_ids, topk_logprobs,
            anchor_logprobs, kept_ids, temperature, delta_low, delta_high, ratio_cap, loss_agg_mode, loss_scale_factor,
            compute_entropy: as :func:`dppo_ext.dppo_loss` (shapes ``[...]`` = hidden's leading dims).
        bias: optional ``[V]`` LM-head bias.
        chunk_size, vocab_chunk_size, memory_budget_bytes, weight_context: chunking and weight gathering, see
            :func:`fused_linear_dppo_loss_per_row` (with grad, ``chunk_size`` or ``memory_budget_bytes`` set the rows
            per chunk of the forward; an explicit ``vocab_chunk_size`` selects the recompute-in-backward path).
        accum_dtype: the dtype of the weight gradient's partial sums across the training forward's row chunks. None
            (default): ``hidden``'s dtype, i.e. each chunk's product is added into the gradient itself (Liger
            Kernel's default; in bfloat16 one rounding per chunk: measured +2% to +14% of the logits path's own
            weight-gradient error at H=512 over 8-256 chunks, +34% to +90% at H=64, docs/results.md).
            ``torch.float32`` for bfloat16 inputs: float32 partial sums, at the cost of a ``[V, H]`` float32
            accumulator beside the gradient (about 2.5x the peak memory, same time). The bias gradient is always
            summed in float32. No effect where the gradients are not computed in the forward (no grad, float16, an
            explicit ``vocab_chunk_size``, ``vocab_parallel_group``): the recompute path sums in float32 per
            vocabulary block.
        logits_dtype: None (default): the logits tiles in hidden's dtype. ``torch.float32`` with bfloat16/float16
            inputs: an fp32 LM head without an fp32 copy of the weight (see :func:`fused_linear_dppo_loss_per_row`);
            combine with ``accum_dtype=torch.float32`` to also keep the weight gradient's partial sums in float32.
        vocab_parallel_group, vocab_offsets: ``weight [V_local, H]`` (``bias [V_local]``) is this rank's slice of a
            vocabulary-sharded LM head (see :func:`fused_linear_dppo_loss_per_row`, docs/distributed.md).

    Returns:
        ``(loss, metrics)``: the scalar loss and the dict of 0-d metric tensors of :func:`dppo_ext.dppo_metrics`.
    """
    check_split_args(vocab_parallel_group, vocab_offsets)
    with vocab_parallel_call(vocab_parallel_group) as rendezvous:
        settings = LossSettings.resolve(
            mode,
            temperature,
            delta_low,
            delta_high,
            ratio_cap,
            compute_entropy,
            loss_agg_mode,
            loss_scale_factor,
            mask_direction=mask_direction,
            kl_tau=kl_tau,
            kl_mask_type=kl_mask_type,
            sequence_mask=sequence_mask,
        )
        check_tensors(hidden=hidden, weight=weight, bias=bias)
        if hidden.dim() < 2:
            raise ValueError(f"hidden must be [..., H] with at least 2 dims, got shape {tuple(hidden.shape)}")
        lead, hidden_size = hidden.shape[:-1], hidden.shape[-1]
        valid, rows = prepare_rows(
            lead,
            "hidden",
            accumulation_dtype(hidden.dtype),
            hidden.device,
            tokens,
            rollout_logprobs,
            advantages,
            response_mask,
            topk_ids,
            topk_logprobs,
            anchor_logprobs,
            kept_ids,
        )
        flat = hidden.reshape(lead.numel(), hidden_size)
        check_no_functorch("fused_linear_dppo_loss", flat, weight, bias)
        accum = resolve_accum_dtype(accum_dtype, hidden.dtype)
        wide_logits = resolve_logits_dtype(logits_dtype, hidden.dtype)
        # A sequence mask or penalty needs every row's logp before any gradient: the recompute path (docs/contract.md)
        in_forward = rendezvous is None and vocab_chunk_size is None and grads_in_forward_dtype(hidden.dtype)
        in_forward = in_forward and not settings.composes
        if in_forward and grads_will_be_needed(flat, weight, bias):
            check_fused_inputs(flat, weight, bias, rows)
            chunking = dict(chunk_size=chunk_size, memory_budget_bytes=memory_budget_bytes, grads_in_forward=True)
            plan = plan_chunks(
                flat.shape[0], weight.shape[0], hidden_size, hidden.dtype, logits_dtype=wide_logits, **chunking
            )
            loss, *outs = FusedLinearGradsInForward.apply(
                flat,
                weight,
                bias,
                rows,
                settings,
                plan,
                weight_context or contextlib.nullcontext,
                valid,
                aggregation_coefficients(valid, settings, rows.advantages.dtype),
                accum,
            )
            out = DPPOOutputs(*outs)
            return loss, dppo_metrics(out, rows.rollout_logprobs, rows.advantages, valid.reshape(lead.numel()))
        out = per_row_outputs(
            flat,
            weight,
            bias,
            rows,
            settings,
            chunk_size,
            vocab_chunk_size,
            memory_budget_bytes,
            weight_context,
            rendezvous,
            vocab_offsets,
            logits_dtype=wide_logits,
        )
        out, seq_frac = compose_rows(out, rows, settings, *lead_sequences(lead, flat.device))
        loss = aggregate_with(out.loss.reshape(lead), valid, settings)
        return loss, dppo_metrics(out, rows.rollout_logprobs, rows.advantages, valid.reshape(lead.numel()), seq_frac)

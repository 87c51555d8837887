"""The DPPO loss over a vocabulary sharded across a tensor-parallel group (Megatron-style or DTensor TP).

The entry points are the loss functions' own (``dppo_loss``, ``dppo_loss_per_row``, ``fused_linear_dppo_loss``,
``fused_linear_dppo_loss_per_row``, the modules), given ``vocab_parallel_group`` or a DTensor; this module is the
work below them. Each rank of the group holds the logits (or the LM-head rows) of one contiguous slice of the
vocabulary, ``[vocab_offsets[r], vocab_offsets[r + 1])`` on rank ``r``; tokens, rollout log-probs, advantages and the
rollout's top-K are global ids/values, identical on every rank. The result on every rank is bit-for-bit the
same and equals the single-device op on the gathered logits (to rounding: sums are merged in another order).

Forward, per call (``docs/distributed.md``):
  1. The call header (``dppo_ext._agreement.Rendezvous``): every rank all-gathers 16 int64 words (row count,
     K, slice width, statistics dtype, hashes of the split and the settings, a bitwise fingerprint of each
     per-row input, a failure flag) and checks every rank's; ranks whose calls differ all raise the same error,
     and a rank whose own checks failed (``agreed_failures``) still joins it, so no rank waits in a collective.
     Its size never depends on the inputs: the only way ranks with different row counts can meet.
  2. ``torch.ops.dppo.dppo_vocab_parallel_stats`` reads the local slice once and keeps, per row, the
     single-device kernel's state: max, non-target exp-sum, entropy moment, and the sampled token's and the
     top-K ids' logits where this rank owns them -- ``4 + K`` numbers.
  3. An all-gather of those ``[N, 4 + K]`` statistics over the group.
  4. ``torch.ops.dppo.dppo_vocab_parallel_epilogue`` merges the ranks' states and runs the per-row epilogue
     (divergence, mask, weight, loss, entropy, lse) -- the same code on every rank, on the same bytes.
Backward: no communication. Each rank writes only its slice's gradient with the single-device backward op
(``dppo_loss_backward``), fed the merged ``lse``/entropy. A row whose sampled token lives on another rank has
no ``1[j = a]`` term here: the op is pointed at column 0 and that column is then recomputed as an ordinary
column by the same op on a two-column copy (``_slice_backward``).

Bytes per row gathered by each rank: ``W * (4 + K) * 4`` (float32 statistics; 8 for float64 logits), e.g.
96 B for W = 4 binary modes, 384 B for W = 4, K = 20 -- against ``V * 2`` bytes to all-gather bf16 logits; plus
``W * 128`` B per call for the headers.
The fused-linear form (``fused_linear_dppo_loss(..., vocab_parallel_group=)``) runs the stats op on row chunks
of ``hidden @ weight.T`` (``dppo_ext._lm_head_tiles``'s tile loop) and additionally all-reduces the ``[N, H]``
hidden-state gradient in backward, as Megatron's column-parallel LM head does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops  # noqa: F401  (loads dppo_ext._C and registers the ops' fake kernels)
from ._agreement import Rendezvous, call_header, check_agreement, gather_settings
from ._autograd import (
    BACKWARD_CONSUMED,
    grad_args,
    input_grads,
    refuse_double_backward,
)
from ._lm_head_tiles import check_fused_inputs, head_backward, logits_tiles, plan_chunks
from ._rows import DPPOOutputs, LossSettings, RowInputs, check_row_counts
from ._vocab_split import (
    check_offsets,
    comm_device,
    even_vocab_offsets,
    gather_stats,
    gathered_bytes_per_row,
    group_rank,
    vocab_parallel_offsets,
)
from .contract import IGNORE_INDEX, accumulation_dtype

# The vocabulary split's public helpers that docs/distributed.md names here (their code: dppo_ext._vocab_split);
# the entry points are dppo_loss, dppo_loss_per_row, fused_linear_dppo_loss and fused_linear_dppo_loss_per_row
# with vocab_parallel_group=.
__all__ = [
    "even_vocab_offsets",
    "gathered_bytes_per_row",
    "vocab_parallel_offsets",
]


# ---- per-row op ------------------------------------------------------------------------------------


def _local_tokens(tokens: Tensor, start: int, local_vocab: int, replay: bool = False) -> tuple[Tensor, Tensor]:
    """(ids for the backward op on this slice, rows whose column 0 must be recomputed as a non-target column).

    Owned rows: the local id. Rows owned elsewhere: column 0 (fixed afterwards), or with sampling replay
    (``replay``) ``local_vocab``, an id outside the slice that the kept-set backward writes no column for (nothing
    to fix). Padding (-100) stays -100."""
    owned = (tokens >= start) & (tokens < start + local_vocab)
    pad = tokens == IGNORE_INDEX
    elsewhere = torch.full_like(tokens, local_vocab) if replay else torch.zeros_like(tokens)
    local = torch.where(owned, tokens - start, elsewhere)
    local = torch.where(pad, tokens, local)
    return local, ~owned & ~pad & (not replay)


def _local_kept(kept_ids: Optional[Tensor], start: int, local_vocab: int) -> Optional[Tensor]:
    """This slice's kept ids, local (-1 for the ids other ranks hold and for padding), or None."""
    if kept_ids is None:
        return None
    inside = (kept_ids >= start) & (kept_ids < start + local_vocab)
    return torch.where(inside, kept_ids - start, torch.full_like(kept_ids, -1))


def _slice_backward(
    grad_target: Tensor,
    grad_entropy: Optional[Tensor],
    entropy: Optional[Tensor],
    logits: Tensor,
    local_tokens: Tensor,
    foreign: Tensor,
    lse: Tensor,
    temperature: float,
    inplace: bool,
    kept: Optional[Tensor] = None,
) -> Tensor:
    """d loss / d logits for this rank's slice, written by ``dppo_loss_backward`` (in place into ``logits`` when
    ``inplace``). ``foreign`` rows (token on another rank) had the op's target column at 0; that column is then
    recomputed by the same op as a non-target column of a two-column copy whose column 1 plays the target.
    ``kept``: this slice's local kept ids (sampling replay; ``lse`` is then the kept set's, and ``_local_tokens``
    marked no row foreign)."""
    if kept is not None:
        args = (grad_target, grad_entropy, logits, local_tokens, lse, entropy, temperature, kept)
        if inplace:
            torch.ops.dppo.dppo_loss_backward_(*args)
            return logits
        return torch.ops.dppo.dppo_loss_backward(*args)
    col0 = logits[:, 0].clone()
    if inplace:
        torch.ops.dppo.dppo_loss_backward_(grad_target, grad_entropy, logits, local_tokens, lse, entropy, temperature)
        grad = logits
    else:
        grad = torch.ops.dppo.dppo_loss_backward(
            grad_target, grad_entropy, logits, local_tokens, lse, entropy, temperature
        )
    pair = torch.stack([col0, col0], dim=1)
    pair_tokens = torch.where(foreign, torch.ones_like(local_tokens), torch.full_like(local_tokens, IGNORE_INDEX))
    fixed = torch.ops.dppo.dppo_loss_backward(grad_target, grad_entropy, pair, pair_tokens, lse, entropy, temperature)
    grad[:, 0] = torch.where(foreign, fixed[:, 0], grad[:, 0])
    return grad


def _check_local(n: int, local_vocab: int, dtype: torch.dtype, device, rows: RowInputs, settings: LossSettings) -> None:
    """Every check this rank's statistics op would make, run before the call header is exchanged (the op itself runs
    after it, when a failure of one rank alone would leave the others waiting in the statistics all-gather): the
    rows' counts, then the op on zero rows (dtypes, devices, top-K shape)."""
    if local_vocab == 0:
        raise ValueError(
            "every rank of vocab_parallel_group must hold at least one vocabulary column (logits column or LM-head "
            f"row), this rank got {local_vocab}"
        )
    check_row_counts(n, rows)
    topk = None if rows.topk_ids is None else rows.topk_ids[:0]
    kept = None if rows.kept_ids is None else rows.kept_ids[:0]
    empty = torch.empty((0, local_vocab), dtype=dtype, device=device)
    torch.ops.dppo.dppo_vocab_parallel_stats(empty, rows.tokens[:0], topk, 0, *settings.stats_args(), kept)


def _agreed_offsets(
    rendezvous: Rendezvous,
    rows: RowInputs,
    settings: LossSettings,
    n: int,
    local_vocab: int,
    dtype,
    device,
    offsets,
    reduced=(),
    hidden: Optional[Tensor] = None,
) -> tuple[list[int], int]:
    """``(offsets, this rank's first column)`` once every rank's call header agrees (else the same error on every
    rank): the forward's first collective and its one host sync. ``reduced``: ``(name, dtype, shape)`` of what a
    later collective reduces; ``hidden``: the fused path's replicated hidden states (see ``call_header``)."""
    world, rank = group_rank(rendezvous.group)
    header = call_header(
        rows,
        n,
        local_vocab,
        accumulation_dtype(dtype),
        offsets,
        settings,
        comm_device(rendezvous.group, device),
        dtype=dtype,
        reduced=reduced,
        hidden=hidden,
    )
    offsets = check_agreement(
        rendezvous.exchange(header), offsets, world, lambda: gather_settings(settings, rendezvous.group)
    )
    return offsets, offsets[rank]


def _merged_outputs(stats: Tensor, offsets: list[int], group, rows: RowInputs, settings: LossSettings):
    """The seven per-row outputs from this rank's statistics: the statistics all-gather, then the epilogue op."""
    gathered = gather_stats(stats, len(offsets) - 1, group)
    return torch.ops.dppo.dppo_vocab_parallel_epilogue(
        gathered, offsets, *rows.op_inputs, *settings.epilogue_args(), rows.kept_ids, settings.mask_direction
    )


def _topk_only(rows: RowInputs, settings: LossSettings) -> RowInputs:
    """The rows with the top-K dropped unless the mode reads it (the stats op then gathers no top-K logits)."""
    return rows if settings.uses_topk else rows._replace(topk_ids=None, topk_logprobs=None)


class _VocabParallelDPPO(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows: RowInputs, settings: LossSettings, rendezvous: Rendezvous, offsets, inplace):
        n, local_vocab = logits.shape
        offsets, start = _agreed_offsets(
            rendezvous, rows, settings, n, local_vocab, logits.dtype, logits.device, offsets
        )
        stats = torch.ops.dppo.dppo_vocab_parallel_stats(
            logits, rows.tokens, rows.topk_ids, start, *settings.stats_args(), rows.kept_ids
        )
        outs = _merged_outputs(stats, offsets, rendezvous.group, rows, settings)
        _loss, _logp, divergence, mask, weight, entropy, lse = outs
        replay = rows.kept_ids is not None
        local_tokens, foreign = _local_tokens(rows.tokens, start, local_vocab, replay)
        kept = (_local_kept(rows.kept_ids, start, local_vocab),) if replay else ()
        ctx.save_for_backward(logits, local_tokens, foreign, rows.advantages, mask, weight, entropy, lse, *kept)
        ctx.settings, ctx.inplace, ctx.consumed = settings, inplace, False
        ctx.mark_non_differentiable(divergence, mask, weight, lse)
        return outs

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):
        refuse_double_backward("the vocab-parallel DPPO loss")
        if ctx.consumed:  # the same rule as the single-device in-place backward
            raise RuntimeError(BACKWARD_CONSUMED)
        logits, local_tokens, foreign, adv, mask, weight, entropy, lse, *kept = ctx.saved_tensors
        settings = ctx.settings
        gt, ge, ent = grad_args(settings.compute_entropy, adv, mask, weight, g_loss, g_logp, g_entropy, entropy)
        grad = _slice_backward(
            gt,
            ge,
            ent,
            logits,
            local_tokens,
            foreign,
            lse,
            float(settings.temperature),
            ctx.inplace,
            kept[0] if kept else None,
        )
        if ctx.inplace:  # autograd must know the logits were overwritten, as for the single-device op
            torch.autograd.graph.increment_version(logits)
            ctx.consumed = True
        return input_grads(ctx, grad)


def forward_rows(
    logits: Tensor,
    rows: RowInputs,
    settings: LossSettings,
    inplace: bool,
    rendezvous: Rendezvous,
    vocab_offsets: Optional[Sequence[int]],
) -> DPPOOutputs:
    """``dppo_loss_per_row(..., vocab_parallel_group=)`` on ``logits [N, V_local]`` and ``rows`` with resolved
    ``settings`` (``inplace`` decided by ``inplace_applies``), inside ``agreed_failures(group)`` (``rendezvous``): for
    the entry points (``dppo_ext.loss``), which checked the rest already."""
    world, _rank = group_rank(rendezvous.group)
    offsets = None if vocab_offsets is None else check_offsets(vocab_offsets, world)
    rows = _topk_only(rows, settings)
    _check_local(logits.shape[0], logits.shape[1], logits.dtype, logits.device, rows, settings)
    return DPPOOutputs(*_VocabParallelDPPO.apply(logits, rows, settings, rendezvous, offsets, bool(inplace)))


# ---- fused linear: LM-head rows sharded over the group -----------------------------------------------


class _FusedLinearVocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        rows: RowInputs,
        settings: LossSettings,
        chunk_rows,
        rendezvous: Rendezvous,
        offsets,
        reduce_hidden_grad,
    ):
        n, local_vocab = hidden.shape[0], weight.shape[0]
        # the backward all-reduces the hidden-state gradient ([N, H], hidden's dtype) on the ranks that reduce it
        reduces = bool(reduce_hidden_grad and ctx.needs_input_grad[0])
        reduced = [("grad_hidden", hidden.dtype, hidden.shape if reduces else ())]
        offsets, start = _agreed_offsets(
            rendezvous, rows, settings, n, local_vocab, hidden.dtype, hidden.device, offsets, reduced, hidden
        )
        group = rendezvous.group
        k = 0 if rows.topk_ids is None else rows.topk_ids.shape[1]
        s = 0 if rows.kept_ids is None else rows.kept_ids.shape[1]
        stats = torch.empty((n, 4 + k + s), dtype=accumulation_dtype(hidden.dtype), device=hidden.device)
        for tile in logits_tiles(hidden, weight, bias, chunk_rows):
            chunk = rows.narrow(tile.rows)
            stats[tile.rows] = torch.ops.dppo.dppo_vocab_parallel_stats(
                tile.logits, chunk.tokens, chunk.topk_ids, start, *settings.stats_args(), chunk.kept_ids
            )
        outs = _merged_outputs(stats, offsets, group, rows, settings)
        _loss, _logp, divergence, mask, row_weight, entropy, lse = outs
        replay = rows.kept_ids is not None
        local_tokens, foreign = _local_tokens(rows.tokens, start, local_vocab, replay)
        kept = (_local_kept(rows.kept_ids, start, local_vocab),) if replay else ()
        ctx.save_for_backward(
            hidden, weight, bias, local_tokens, foreign, rows.advantages, mask, row_weight, entropy, lse, *kept
        )
        ctx.settings, ctx.chunk_rows = settings, chunk_rows
        ctx.group, ctx.reduce_hidden_grad = group, reduce_hidden_grad
        ctx.mark_non_differentiable(divergence, mask, row_weight, lse)
        return outs

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):
        refuse_double_backward("fused_linear_dppo_loss (vocab-parallel)")
        hidden, weight, bias, local_tokens, foreign, adv, mask, row_weight, entropy, lse, *kept = ctx.saved_tensors
        settings = ctx.settings
        gt, ge, ent = grad_args(settings.compute_entropy, adv, mask, row_weight, g_loss, g_logp, g_entropy, entropy)

        def tile_grad(tile):
            r = tile.rows
            return _slice_backward(
                gt[r],
                None if ge is None else ge[r],
                None if ent is None else ent[r],
                tile.logits,
                local_tokens[r],
                foreign[r],
                lse[r],
                float(settings.temperature),
                True,
                kept[0][r] if kept else None,
            )

        grad_hidden, grad_weight, grad_bias = head_backward(
            hidden, weight, bias, ctx.needs_input_grad[:3], ctx.chunk_rows, None, tile_grad
        )
        if grad_hidden is not None and ctx.reduce_hidden_grad:
            # hidden feeds every rank's slice of the head: its gradient is the sum over the group.
            dist.all_reduce(grad_hidden, group=ctx.group)
        return input_grads(ctx, grad_hidden, grad_weight, grad_bias)


def fused_linear_rows(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    rows: RowInputs,
    settings: LossSettings,
    *,
    chunk_size: Optional[int],
    memory_budget_bytes: Optional[int],
    rendezvous: Rendezvous,
    vocab_offsets: Optional[Sequence[int]],
    reduce_hidden_grad: bool = True,
) -> DPPOOutputs:
    """``fused_linear_dppo_loss_per_row(..., vocab_parallel_group=)`` on ``rows`` with resolved ``settings``, inside
    ``agreed_failures(group)`` (``rendezvous``): for the entry points (``dppo_ext.fused_linear``), which resolved the
    settings already. ``weight`` is this rank's ``[V_local, H]`` slice (``bias`` its ``[V_local]``), ``hidden
    [N, H]`` is replicated. Neither the logits nor the whole head exist on any rank: row chunks of ``hidden @
    weight.T`` go through the stats op, one all-gather merges them, the backward recomputes each chunk and writes
    its gradient in place. ``reduce_hidden_grad``: all-reduce the hidden-state gradient over the group (the sum of
    every slice's contribution), as Megatron's column-parallel linear does."""
    check_fused_inputs(hidden, weight, bias, rows)
    world, _rank = group_rank(rendezvous.group)
    offsets = None if vocab_offsets is None else check_offsets(vocab_offsets, world)
    rows = _topk_only(rows, settings)
    _check_local(hidden.shape[0], weight.shape[0], hidden.dtype, hidden.device, rows, settings)
    plan = plan_chunks(
        hidden.shape[0],
        weight.shape[0],
        hidden.shape[1],
        hidden.dtype,
        chunk_size=chunk_size,
        memory_budget_bytes=memory_budget_bytes,
    )
    return DPPOOutputs(
        *_FusedLinearVocabParallel.apply(
            hidden, weight, bias, rows, settings, plan.chunk_rows, rendezvous, offsets, bool(reduce_hidden_grad)
        )
    )

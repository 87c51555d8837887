"""The user-facing DPPO loss on logits: ``dppo_loss`` (its module form ``dppo_ext.DPPOLoss``) and
``dppo_loss_per_row`` (the per-row outputs below them, without aggregation).

Takes the policy's logits for the response tokens in any leading layout (``[N, V]``, ``[B, T, V]``)
plus what the rollout engine returned, runs the fused op (``dppo_ext.ops``; ``dppo_ext.vocab_parallel`` for
logits sharded over a tensor-parallel group) on the flattened rows, aggregates the per-token loss the way verl
does (``dppo_ext.aggregation``), and returns the scalar loss with a dict of metrics. Padding
(``response_mask == 0``) rows are skipped inside the kernels and get a zero gradient.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import ops, vocab_parallel
from ._agreement import Rendezvous, vocab_parallel_call
from ._autograd import check_no_functorch, inplace_applies
from ._dtensor import replicated_local, vocab_shard
from ._rows import DPPOOutputs, LossSettings, RowInputs, check_tensors, prepare_rows
from ._vocab_split import check_split_args
from .aggregation import aggregate_with, compose_rows, dppo_metrics
from .contract import (
    DEFAULT_AGG_MODE,
    DEFAULT_MASK_DIRECTION,
    DEFAULT_MODE,
    DEFAULT_RATIO_CAP,
    accumulation_dtype,
)
from .sequence_mask import SequenceMask, lead_sequences, sequence_index

# dppo_loss, dppo_loss_per_row and DPPOLoss, and the names other modules define that this one has always offered.
__all__ = ["dppo_loss", "dppo_loss_per_row"]


def dppo_loss(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    *,
    response_mask: Optional[Tensor] = None,
    mode: str = DEFAULT_MODE,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    kept_ids: Optional[Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    loss_agg_mode: str = DEFAULT_AGG_MODE,
    loss_scale_factor: Optional[float] = None,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO policy loss from the policy's logits and the rollout engine's log-probs.

    Args:
        logits: ``[..., V]`` policy logits at the response positions (any float dtype; never
            upcast or copied). For ``[B, T, V]`` the sequence modes of ``loss_agg_mode`` apply.
        tokens: ``[...]`` sampled token ids.
        rollout_logprobs: ``[...]`` log mu(token) from the rollout engine (e.g. vLLM), of the
            temperature-processed distribution.
        advantages: ``[...]`` per token, or ``[B]`` per sequence for ``[B, T, V]`` logits.
        response_mask: ``[...]`` 1/True for response tokens; padding rows cost no compute and get a
            zero gradient. Default: all tokens are valid.
        mode: ``binary_tv`` | ``binary_kl`` | ``topk_tv`` | ``topk_kl`` (DPPO), ``ratio`` (PPO/GRPO
            clip as a mask) or ``none`` (PG-IS / CISPO style: never masked); verl's ``dppo_tv`` /
            ``dppo_kl`` and the other names of ``dppo_ext.contract.MODE_ALIASES`` are accepted too.
        mask_direction: ``"advantage"`` (the paper's: mask a token that left the trust region on the side its
            advantage pushes towards) or ``"symmetric"`` (on either side, whatever the advantage: prime-rl's IPO is
            ``binary_tv`` symmetric, IcePop is ``ratio`` symmetric with ``delta_low, delta_high =
            dppo_ext.icepop_deltas(low, high)``); docs/contract.md, "Mask".
        kl_tau: add ``kl_tau * delta^2`` (``delta = clamp(log pi - log mu, -20, 20)``, differentiable) to the loss of
            the response tokens ``kl_mask_type`` picks: ``"all"`` (prime-rl's default), ``"unmasked"`` (the tokens the
            masks keep) or ``"masked"``; 0 (default): no penalty. docs/contract.md, "Log-ratio penalty".
        sequence_mask: a :class:`dppo_ext.SequenceMask`: drop whole sequences (each row along the last leading dim,
            ``[B, T]``: each ``b``) whose reduced per-token statistic leaves its bounds; docs/contract.md, "Sequence
            masks". Its share of dropped sequences is the ``seq_masked_frac`` metric.
        topk_ids, topk_logprobs: ``[..., K]`` the rollout's top-K ids and log-probs (top-K modes).
        anchor_logprobs: ``[...]`` recomputed old-policy log-probs replacing mu in the mask test
            only (the "recompute" ablations); the importance weight always uses mu.
        kept_ids: ``[..., S]`` integer ids that the rollout's top-k / top-p / min-p truncation kept at each position
            (-1 padding): sampling replay, pi (its ratio, divergence and entropy) renormalised over the kept set
            (docs/contract.md). Without it a truncated rollout's mu is compared with the full softmax.
        temperature: the rollout temperature; logits are divided by it.
        delta_low, delta_high: trust-region thresholds; ``None`` takes ``DEFAULT_DELTAS[mode]``.
        ratio_cap: cap C on the importance weight min(pi / mu, C).
        loss_agg_mode: one of ``AGG_MODES``, see :func:`aggregate_loss`.
        loss_scale_factor: the horizon of the ``-norm`` aggregation modes (default: the padded length T).
        compute_entropy: compute the policy entropy (``entropy_mean`` metric); else it reads 0.
        inplace_backward: write the logits gradient into the logits buffer during backward
            (no ``[N, V]`` allocation; the logits are consumed, do not reuse them).
        vocab_parallel_group: the tensor-parallel group when ``logits`` is ``[..., V_local]``, this rank's
            contiguous slice of the vocabulary (Megatron-style vocab-parallel logits); ids stay global and every
            other input is replicated. One all-gather of ``4 + K`` numbers per row in forward, none in backward;
            the loss and metrics are identical on every rank (``dppo_ext.vocab_parallel``,
            docs/distributed.md). A ``DTensor`` sharded on the vocabulary dim needs neither argument.
        vocab_offsets: ``[W + 1]`` global column offsets of the ranks' slices (group-rank order); None
            derives them from the slice widths the ranks exchange anyway. Refused without a group.

    Returns:
        ``(loss, metrics)``: the scalar loss and a dict of 0-d metric tensors (see
        :func:`dppo_metrics`).
    """
    check_split_args(vocab_parallel_group, vocab_offsets)
    shard = vocab_shard(logits, vocab_parallel_group, vocab_offsets)
    with vocab_parallel_call(shard.group) as rendezvous:
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
        logits = shard.logits
        check_tensors(logits=logits)
        if logits.dim() < 2:
            raise ValueError(f"logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
        named = _local_inputs(
            rendezvous,
            tokens=tokens,
            rollout_logprobs=rollout_logprobs,
            advantages=advantages,
            response_mask=response_mask,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            anchor_logprobs=anchor_logprobs,
            kept_ids=kept_ids,
        )
        lead, vocab = logits.shape[:-1], logits.shape[-1]
        valid, rows = prepare_rows(lead, "logits", accumulation_dtype(logits.dtype), logits.device, **named)
        flat = logits.reshape(lead.numel(), vocab)
        offsets = shard.vocab_offsets
        out = _forward_rows("dppo_loss", logits, flat, rows, settings, inplace_backward, rendezvous, offsets)
        out, seq_frac = compose_rows(out, rows, settings, *lead_sequences(lead, flat.device))
        loss = aggregate_with(out.loss.reshape(lead), valid, settings)
        return loss, dppo_metrics(out, rows.rollout_logprobs, rows.advantages, valid.reshape(lead.numel()), seq_frac)


def dppo_loss_per_row(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    *,
    mode: str = DEFAULT_MODE,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    kept_ids: Optional[Tensor] = None,
    sequence_ids: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> DPPOOutputs:
    """The DPPO op's per-row outputs on flat rows, without aggregation (lower level; see ``docs/contract.md``).

    Most callers want :func:`dppo_loss` (any leading shape, ``response_mask``, aggregation, metrics). The same
    argument names and per-mode defaults as :func:`dppo_loss`, with no ``response_mask`` (a padding row has the
    token ``IGNORE_INDEX``) and no aggregation.

    Args:
        logits: ``[N, V]`` float32/float16/bfloat16/float64; stride(1) must be 1 (row views are fine). With
            ``vocab_parallel_group``: ``[N, V_local]``, this rank's contiguous slice of the vocabulary; a
            ``DTensor`` sharded on its last dim needs neither ``vocab_parallel_group`` nor ``vocab_offsets``.
        tokens: ``[N]`` int64 sampled token ids (global ids when sharded); ``IGNORE_INDEX`` (-100) marks a padding
            row (zero outputs and gradient).
        rollout_logprobs: ``[N]`` rollout (behaviour) log-prob of each token, float32 (float64 for float64
            logits). ``-inf`` is allowed.
        advantages: ``[N]`` same dtype as ``rollout_logprobs``.
        mode: one of ``MODES`` or an alias of ``MODE_ALIASES`` (verl's ``dppo_tv``/``dppo_kl``).
        mask_direction, kl_tau, kl_mask_type: as :func:`dppo_loss`; the rows' ``loss`` includes the penalty.
        sequence_mask: as :func:`dppo_loss`; the sequences are named by ``sequence_ids [N]`` (non-negative ints) or
            ``cu_seqlens [S + 1]`` (packed rows; neither: all rows are one sequence). A dropped row's ``loss`` is 0 and
            its ``mask`` 0.
        topk_ids, topk_logprobs: ``[N, K]`` the rollout's top-K ids and log-probs (top-K modes).
        anchor_logprobs: ``[N]`` optional mask anchor replacing the rollout log-probs in the mask.
        kept_ids: ``[N, S]`` int64 ids the rollout's truncation kept per row (-1 padding): sampling replay, every
            output over the softmax renormalised on the kept set (docs/contract.md).
        temperature: logits are divided by it (must match the rollout's temperature).
        delta_low, delta_high: trust-region thresholds (A <= 0 and A > 0 sides); ``None`` takes
            ``DEFAULT_DELTAS[mode]`` (``dppo_ext.contract``), as every other entry point does.
        ratio_cap: cap C of the importance weight.
        compute_entropy: also compute the entropy of softmax(logits / T) (else zeros).
        inplace_backward: write the gradient into ``logits`` during backward (consumes the logits; see
            ``dppo_ext.ops`` for the uses it refuses).
        vocab_parallel_group, vocab_offsets: as :func:`dppo_loss`: the tensor-parallel group when ``logits`` is
            this rank's vocabulary slice (every other input replicated), and the ``[W + 1]`` global offsets of
            the ranks' slices (None: derived from the slice widths). The backward writes only this slice, with no
            communication (``dppo_ext.vocab_parallel``, docs/distributed.md).

    Returns:
        ``DPPOOutputs(loss, logp, divergence, mask, weight, entropy, lse)``, each ``[N]`` (identical on every rank
        when sharded); ``loss``, ``logp`` and ``entropy`` are differentiable w.r.t. the logits. A row whose scaled
        logits hold a NaN or +inf or are all -inf has NaN outputs (docs/contract.md).
    """
    check_split_args(vocab_parallel_group, vocab_offsets)
    shard = vocab_shard(logits, vocab_parallel_group, vocab_offsets)
    with vocab_parallel_call(shard.group) as rendezvous:
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
        logits = shard.logits
        check_tensors(logits=logits)
        if logits.dim() != 2:
            width = "V" if rendezvous is None else "V_local"
            raise ValueError(f"logits must be 2-D [N, {width}], got shape {tuple(logits.shape)}")
        named = _local_inputs(
            rendezvous,
            tokens=tokens,
            rollout_logprobs=rollout_logprobs,
            advantages=advantages,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            anchor_logprobs=anchor_logprobs,
            kept_ids=kept_ids,
        )
        rows = RowInputs.of(**named)
        check_tensors(sequence_ids=sequence_ids, cu_seqlens=cu_seqlens)
        sequences = sequence_index(logits.shape[0], logits.device, sequence_ids, cu_seqlens)
        out = _forward_rows(
            "dppo_loss_per_row", logits, logits, rows, settings, inplace_backward, rendezvous, shard.vocab_offsets
        )
        return compose_rows(out, rows, settings, *sequences)[0]


def _local_inputs(rendezvous: Optional[Rendezvous], **tensors: Optional[Tensor]) -> dict[str, Optional[Tensor]]:
    """The inputs besides the logits, as given (single device) or each replicated DTensor as its local tensor."""
    if rendezvous is None:
        return tensors
    return {name: replicated_local(t, name) for name, t in tensors.items()}


def _forward_rows(
    api: str,
    logits: Tensor,
    flat: Tensor,
    rows: RowInputs,
    settings: LossSettings,
    inplace_backward: bool,
    rendezvous: Optional[Rendezvous],
    vocab_offsets: Optional[Sequence[int]],
) -> DPPOOutputs:
    """The op on ``flat`` (``[N, V]`` rows of ``logits``, the tensor the in-place rule is checked on): on one device
    (``rendezvous`` None) or on this rank's vocabulary slice."""
    check_no_functorch(api, flat)
    inplace = inplace_applies(inplace_backward, logits)
    if rendezvous is None:
        return ops.forward_rows(flat, rows, settings, inplace)
    return vocab_parallel.forward_rows(flat, rows, settings, inplace, rendezvous, vocab_offsets)

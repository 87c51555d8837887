"""From per-token results to what a trainer uses: the scalar loss, its metrics, and its split into micro-batches.

- :func:`aggregate_loss`: a per-token loss to a scalar, with verl's mode names and formulas (docs/aggregation.md).
- :func:`dppo_metrics`: the op's per-row outputs summarised over the response tokens (no host sync).
- :func:`compose_rows`: the sequence mask and the log-ratio penalty composed on the op's per-row outputs.
- :func:`micro_batch_scale`: the weight of one micro-batch's aggregated loss in the loss of the batch it was split
  from, so that gradient accumulation over micro-batches reproduces the whole batch's loss.

Pure PyTorch: nothing here loads the compiled library.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from ._rows import DPPOOutputs, LossSettings, RowInputs
from .contract import DEFAULT_AGG_MODE, IGNORE_INDEX, LOG_RATIO_CLAMP, SUM_AGG_MODES, check_aggregation
from .sequence_mask import log_ratio, sequence_keep, token_statistic

__all__ = [
    "MISMATCH_EXTRA",
    "aggregate_loss",
    "aggregate_with",
    "compose_rows",
    "dppo_metrics",
    "micro_batch_scale",
    "mismatch_metrics",
]


def compose_rows(
    out: DPPOOutputs, rows: RowInputs, settings: LossSettings, index: Tensor, num_sequences: int
) -> tuple[DPPOOutputs, Optional[Tensor]]:
    """``(out, seq_masked_frac)``: the op's per-row outputs with ``settings``' sequence mask and log-ratio penalty
    composed on them (docs/contract.md, "Sequence masks", "Log-ratio penalty"): ``mask`` times the rows' sequence keep
    (a constant), ``loss`` zero on a masked row plus ``kl_tau * delta^2`` on the rows ``kl_mask_type`` selects
    (differentiable through ``logp``). ``index [N]``: each row's sequence in ``[0, num_sequences)``.
    ``seq_masked_frac``: the share of sequences with a response token that the mask drops (None without one).
    The outputs unchanged when ``settings.composes`` is false."""
    if not settings.composes:
        return out, None
    valid = rows.tokens != IGNORE_INDEX
    delta = log_ratio(out.logp, rows.rollout_logprobs, valid)
    loss, mask, seq_frac = out.loss, out.mask, None
    if settings.sequence_mask is not None:
        stat = token_statistic(settings.sequence_mask.statistic, delta, out.logp, rows.rollout_logprobs, valid)
        keep, _value, dropped = sequence_keep(
            settings.sequence_mask, stat, valid, rows.advantages, index, num_sequences
        )
        present = torch.zeros(num_sequences, dtype=torch.bool, device=keep.device)
        present[index[valid]] = True
        seq_frac = dropped.sum().to(keep.dtype) / present.sum().clamp(min=1).to(keep.dtype)
        mask = mask * keep
        loss = torch.where(keep > 0, loss, torch.zeros_like(loss))
    if settings.kl_tau != 0:
        kept = mask.detach() > 0
        select = {"all": valid, "unmasked": valid & kept, "masked": valid & ~kept}[settings.kl_mask_type]
        penalty = settings.kl_tau * delta * delta
        loss = loss + torch.where(select, penalty, torch.zeros_like(penalty))
    return out._replace(loss=loss, mask=mask), seq_frac


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, loss_agg_mode: str = DEFAULT_AGG_MODE, loss_scale_factor: Optional[float] = None
) -> Tensor:
    """Aggregate a per-token loss into a scalar, with verl's mode names and formulas.

    With ``l[b, t]`` the per-token loss, ``m[b, t]`` the mask, ``S_b = sum_t m l`` the sequence sums,
    ``n_b = sum_t m`` the token counts, ``B' = #{b : n_b > 0}`` the non-empty sequences and ``C`` the
    horizon (``loss_scale_factor``, default ``T = mask.shape[-1]``):

    - ``token-mean``: ``sum_b S_b / sum_b n_b``
    - ``token-sum``: ``sum_b S_b``
    - ``seq-mean-token-sum``: ``sum_b S_b / B'``
    - ``seq-mean-token-mean``: ``sum_{b: n_b > 0} (S_b / n_b) / B'``
    - ``seq-mean-token-sum-norm``: ``sum_b S_b / (B' * C)`` (Dr. GRPO; current verl)
    - ``token-sum-norm``: ``sum_b S_b / C`` (what the paper's verl fork computes under the name
      ``seq-mean-token-sum-norm``: ``B'`` times the current verl value)

    Args:
        loss_mat: ``[B, T]`` (or ``[N]``, treated as one sequence) per-token loss.
        mask: same shape, 1 for response tokens, 0 for padding.
        loss_agg_mode: one of ``AGG_MODES``.
        loss_scale_factor: ``C`` of the ``-norm`` modes (verl's ``loss_scale_factor``; pass a constant such
            as the maximum response length when micro-batches are padded to different lengths). Only for
            those modes.
    An empty batch (no response token) gives 0 in every mode.
    """
    check_aggregation(loss_agg_mode, loss_scale_factor)
    if mask.shape != loss_mat.shape:  # a broadcast mask would silently change the normaliser
        raise ValueError(f"mask must have the loss's shape {tuple(loss_mat.shape)}, got {tuple(mask.shape)}")
    return _aggregate(loss_mat, mask, loss_agg_mode, loss_scale_factor)


def aggregate_with(loss_mat: Tensor, mask: Tensor, settings: LossSettings) -> Tensor:
    """:func:`aggregate_loss` with the aggregation of ``settings``, which :meth:`LossSettings.resolve` checked (an
    entry point's rows: ``mask`` has the loss's shape)."""
    return _aggregate(loss_mat, mask, settings.loss_agg_mode, settings.loss_scale_factor)


def _aggregate(loss_mat: Tensor, mask: Tensor, loss_agg_mode: str, loss_scale_factor: Optional[float]) -> Tensor:
    if loss_mat.dim() == 1:
        loss_mat, mask = loss_mat.unsqueeze(0), mask.unsqueeze(0)
    mask = mask.to(loss_mat.dtype)
    seq_sum = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "token-mean":
        return seq_sum.sum() / mask.sum().clamp(min=1)
    if loss_agg_mode == "token-sum":
        return seq_sum.sum()
    horizon = float(max(loss_mat.shape[-1], 1) if loss_scale_factor is None else loss_scale_factor)
    if loss_agg_mode == "token-sum-norm":
        return seq_sum.sum() / horizon
    tokens_per_seq = mask.sum(-1)
    non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum = seq_sum / tokens_per_seq.clamp(min=1)
    seq_mean = (seq_sum * non_empty).sum() / non_empty.sum().clamp(min=1)
    return seq_mean / horizon if loss_agg_mode == "seq-mean-token-sum-norm" else seq_mean


# The mismatch metrics beyond |pi - mu| (docs/contract.md, "Mismatch metrics"), in every entry point's dict and in
# the trainer's, TRL's and verl's logs.
MISMATCH_EXTRA = ("mismatch_k3", "log_ratio_min", "log_ratio_max", "log_ratio_outlier_frac", "ess")


@torch.no_grad()
def mismatch_metrics(logp: Tensor, rollout_logprobs: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The training-inference mismatch between ``logp`` (log pi) and ``rollout_logprobs`` (log mu) over the valid
    rows (any shape, all three alike), as 0-d tensors (no host sync).

    Keys: ``mismatch_mean`` / ``mismatch_max`` (|pi - mu|, the paper's mismatch), ``ratio_max`` (pi / mu, log-ratio
    clamped at 20), and over ``delta = clamp(log pi - log mu, -20, 20)`` (0 where both are -inf), ``r = exp(delta)``:
    ``mismatch_k3`` (mean of ``r - 1 - delta``, the k3 estimate of KL(mu || pi)), ``log_ratio_min`` /
    ``log_ratio_max``, ``log_ratio_outlier_frac`` (share with ``|delta| > ln 2``) and ``ess`` (``(sum r)^2 /
    (n sum r^2)``, the normalised effective sample size of the importance weights). docs/contract.md, "Mismatch
    metrics".
    """
    v = valid.to(logp.dtype)
    n = v.sum()

    def mean(x: Tensor, w: Tensor) -> Tensor:  # a padding row's inputs hold anything (a NaN): never multiplied in
        return (torch.where(valid, x, 0.0) * w).sum() / w.sum().clamp(min=1)

    def vextreme(x: Tensor, reduce, fill: float) -> Tensor:
        if x.numel() == 0:
            return x.new_zeros(())
        return torch.where(valid.any(), reduce(torch.where(valid, x, torch.full_like(x, fill))), 0.0)

    mismatch = (logp.exp() - rollout_logprobs.exp()).abs()
    # A token impossible under both policies (both log-probs -inf) has ratio 0, as its weight (docs/contract.md);
    # a row without a distribution keeps its NaN, so the metric shows it.
    impossible = torch.isneginf(logp) & torch.isneginf(rollout_logprobs)
    ratio = torch.where(impossible, 0.0, torch.exp((logp - rollout_logprobs).clamp(max=LOG_RATIO_CLAMP)))
    delta = torch.where(impossible, 0.0, (logp - rollout_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    r = torch.exp(delta)
    r_valid = torch.where(valid, r, 0.0)  # never a padding row's NaN times 0
    r_sq = (r_valid * r_valid).sum()
    return {
        "mismatch_mean": mean(mismatch, v),
        "mismatch_max": vextreme(mismatch, torch.amax, 0.0),
        "ratio_max": vextreme(ratio, torch.amax, 0.0),
        "mismatch_k3": mean(r - 1 - delta, v),
        "log_ratio_min": vextreme(delta, torch.amin, math.inf),
        "log_ratio_max": vextreme(delta, torch.amax, -math.inf),
        "log_ratio_outlier_frac": mean((delta.abs() > math.log(2.0)).to(delta.dtype), v),
        "ess": torch.where(r_sq > 0, r_valid.sum() ** 2 / (n * r_sq), torch.zeros_like(r_sq)),
    }


@torch.no_grad()
def dppo_metrics(
    out: DPPOOutputs,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    valid: Tensor,
    seq_masked_frac: Optional[Tensor] = None,
) -> dict[str, Tensor]:
    """The op's per-row outputs summarised over valid rows, as 0-d tensors (no host sync).

    Keys: ``masked_frac`` (all / ``_pos`` A > 0 / ``_neg`` A < 0), ``divergence_mean``, ``entropy_mean``,
    ``num_tokens``, and the mismatch metrics of :func:`mismatch_metrics` (``mismatch_mean``, ``mismatch_max``,
    ``ratio_max``, ``mismatch_k3``, ``log_ratio_min`` / ``log_ratio_max``, ``log_ratio_outlier_frac``, ``ess``), and
    ``seq_masked_frac`` (the share of sequences a sequence mask drops: :func:`compose_rows`'s, 0 without one).
    Per-row work only.
    """
    v = valid.to(out.loss.dtype)

    def mean(x: Tensor, w: Tensor) -> Tensor:  # a padding row's inputs hold anything (a NaN): never multiplied in
        return (torch.where(valid, x, 0.0) * w).sum() / w.sum().clamp(min=1)

    masked = 1.0 - out.mask
    mismatch = mismatch_metrics(out.logp, rollout_logprobs, valid)
    return {
        "masked_frac": mean(masked, v),
        "masked_frac_pos": mean(masked, v * (advantages > 0)),
        "masked_frac_neg": mean(masked, v * (advantages < 0)),
        "mismatch_mean": mismatch["mismatch_mean"],
        "mismatch_max": mismatch["mismatch_max"],
        "divergence_mean": mean(out.divergence, v),
        "entropy_mean": mean(out.entropy, v),
        "ratio_max": mismatch["ratio_max"],
        "num_tokens": v.sum(),
        **{name: mismatch[name] for name in MISMATCH_EXTRA},
        "seq_masked_frac": v.sum().new_zeros(()) if seq_masked_frac is None else seq_masked_frac.to(v.dtype),
    }


def micro_batch_scale(
    loss_agg_mode: str,
    micro_mask: Tensor,
    batch_tokens: Union[float, Tensor],
    batch_sequences: Union[float, Tensor],
) -> Tensor:
    """Weight of one micro-batch's ``aggregate_loss`` in the loss of the batch it was split from.

    For a batch split into micro-batches ``i`` (rows of ``[B, T]``, each possibly trimmed to its own longest
    response), ``sum_i micro_batch_scale(mode, mask_i, ...) * aggregate_loss(loss_i, mask_i, mode, C)`` equals
    ``aggregate_loss(loss, mask, mode, C)`` of the whole batch (docs/aggregation.md): the means weigh each
    micro-batch by its share of the batch's response tokens (``token-mean``) or of its non-empty sequences
    (``seq-mean-*``); the sums (``token-sum``, ``token-sum-norm``) add up (weight 1). The ``-norm`` modes need the
    same constant horizon ``C`` (``loss_scale_factor``, e.g. the maximum response length) in every micro-batch,
    not each one's padded length. Scale each micro-batch's loss by this before its ``backward()`` to accumulate
    the whole batch's gradient.

    Args:
        loss_agg_mode: one of ``AGG_MODES``.
        micro_mask: ``[b, t]`` (or ``[n]``, one sequence) this micro-batch's response mask.
        batch_tokens: the whole batch's number of response tokens (``mask.sum()``), a number or a 0-d tensor.
        batch_sequences: the whole batch's number of sequences with at least one response token.

    Returns:
        The weight as a 0-d float64 tensor on ``micro_mask``'s device (no host sync).
    """
    check_aggregation(loss_agg_mode)
    if loss_agg_mode in SUM_AGG_MODES:
        return torch.ones((), dtype=torch.float64, device=micro_mask.device)
    counts = micro_mask.to(torch.float64)
    if loss_agg_mode == "token-mean":
        share, total = counts.sum(), batch_tokens
    else:  # a sequence counts when it has a response token, as in aggregate_loss's B'
        share, total = (counts.sum(-1) > 0).sum().to(torch.float64), batch_sequences
    return share / torch.as_tensor(total, dtype=torch.float64, device=micro_mask.device).clamp(min=1)

"""DPPO's diagnostics in verl's ``actor/`` namespace (docs/verl.md, "Metrics"; docs/names.md): what the plugin's
loss (:mod:`dppo_ext.integrations.verl.loss`) logs beside verl's own metrics, per micro-batch, each with verl's
reduction over the micro-batches."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from dppo_ext.aggregation import MISMATCH_EXTRA, mismatch_metrics
from dppo_ext.contract import IGNORE_INDEX
from dppo_ext.sequence_mask import SequenceMask, log_ratio, sequence_index, sequence_keep, token_statistic

__all__ = ["DIAGNOSTICS", "diagnostics", "sequence_dropped"]


@torch.no_grad()
def sequence_dropped(
    mask: SequenceMask, logp: Tensor, mu: Tensor, tokens: Tensor, advantages: Tensor, sequence_ids: Tensor
) -> Tensor:
    """``[N]``: 1 on the response rows of a sequence the sequence mask drops, else 0 -- the op's own decision
    (``dppo_ext.aggregation.compose_rows``: the same statistic of the same log-probs over the same sequences),
    which the per-row outputs fold into ``mask``; the diagnostic ``actor/dppo_seq_masked_frac`` reads it."""
    valid = tokens != IGNORE_INDEX
    index, count = sequence_index(tokens.shape[0], tokens.device, sequence_ids, None)
    delta = log_ratio(logp, mu, valid)
    stat = token_statistic(mask.statistic, delta, logp, mu, valid)
    _keep, _value, dropped = sequence_keep(mask, stat, valid, advantages, index, count)
    return (dropped[index] & valid).to(logp.dtype)


# The DPPO diagnostics in verl's actor/ namespace (docs/verl.md, docs/names.md): name -> how verl reduces the
# micro-batches' values (the TRL integration's dppo/<name> are the same quantities).
DIAGNOSTICS = {
    "actor/dppo_masked_frac": "mean",
    "actor/dppo_masked_frac_pos": "mean",
    "actor/dppo_masked_frac_neg": "mean",
    "actor/dppo_mismatch_mean": "mean",
    "actor/dppo_mismatch_max": "max",
    "actor/dppo_mismatch_k3": "mean",
    "actor/dppo_log_ratio_min": "min",
    "actor/dppo_log_ratio_max": "max",
    "actor/dppo_log_ratio_outlier_frac": "mean",
    "actor/dppo_ess": "mean",
    "actor/dppo_divergence_mean": "mean",
    "actor/dppo_entropy_mean": "mean",
    "actor/dppo_seq_masked_frac": "mean",
}


@torch.no_grad()
def diagnostics(per_token: dict[str, Tensor], padded: TensorDict, response_mask: Tensor) -> dict[str, Any]:
    """DPPO's per-micro-batch diagnostics as verl ``Metric`` objects (:data:`DIAGNOSTICS`).

    ``masked_frac``: share of response tokens the trust region masks (all, advantage > 0, advantage < 0; a
    micro-batch without tokens of that sign counts 0); ``mismatch``: ``|pi - mu|`` against the rollout's
    ``rollout_log_probs`` (only when the batch carries them), its mean and max; ``divergence_mean``: the mode's
    divergence (TV or KL; top-K or binary) against its anchor; ``entropy``: the policy's token entropy; with the
    rollout's log-probs also the mismatch metrics of :func:`dppo_ext.aggregation.mismatch_metrics` (k3, log-ratio
    min / max, the share beyond ln 2, the ESS; per micro-batch, averaged over them as verl does); ``seq_masked_frac``:
    the share of sequences the sequence mask drops (``dppo_sequence_mask``; 0 without one), the op's own metric.
    """
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.torch_functional import masked_mean

    masked = 1.0 - per_token["dppo_mask"]
    advantages = padded["advantages"]
    values = {
        "actor/dppo_masked_frac": masked_mean(masked, response_mask),
        "actor/dppo_masked_frac_pos": masked_mean(masked, response_mask & (advantages > 0)),
        "actor/dppo_masked_frac_neg": masked_mean(masked, response_mask & (advantages < 0)),
        "actor/dppo_divergence_mean": masked_mean(per_token["dppo_divergence"], response_mask),
        "actor/dppo_entropy_mean": masked_mean(per_token["dppo_entropy"], response_mask),
        # the share of the micro-batch's sequences the sequence mask drops (0 without one), as the op's metric
        "actor/dppo_seq_masked_frac": ((per_token["dppo_seq_dropped"] > 0) & response_mask).any(-1).sum()
        / response_mask.any(-1).sum().clamp(min=1),
    }
    if "rollout_log_probs" in padded.keys():
        mismatch = mismatch_metrics(per_token["dppo_logp"].detach(), padded["rollout_log_probs"], response_mask)
        values.update({f"actor/dppo_{name}": mismatch[name] for name in ("mismatch_mean", "mismatch_max")})
        values.update({f"actor/dppo_{name}": mismatch[name] for name in MISMATCH_EXTRA})
    reduce = {"mean": AggregationType.MEAN, "max": AggregationType.MAX, "min": AggregationType.MIN}
    return {name: Metric(value=value.item(), aggregation=reduce[DIAGNOSTICS[name]]) for name, value in values.items()}

"""Readable float64 reference of what the entry points compose on the op's per-row outputs: the sequence masks and
the squared-log-ratio penalty (docs/contract.md, "Sequence masks", "Log-ratio penalty").

The test oracle of ``dppo_ext.sequence_mask`` / ``dppo_ext.aggregation.compose_rows``, written independently of
them: one Python loop over the sequences, each reduced with plain tensor ops, on top of ``dppo_ext.reference``'s
per-row outputs. Never imports the compiled extension.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .contract import IGNORE_INDEX, LOG_RATIO_CLAMP
from .reference import aggregate_loss_reference, dppo_loss_reference
from .sequence_mask import SequenceMask

__all__ = ["composed_rows_reference", "dppo_loss_composed_reference", "sequence_keep_reference"]


def _delta(logp: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``clamp(logp - m, -20, 20)``, 0 where both are -inf (a token impossible under both policies)."""
    both = torch.isneginf(logp) & torch.isneginf(m)
    d = torch.where(both, torch.zeros_like(logp), logp) - torch.where(both, torch.zeros_like(m), m)
    return d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def sequence_keep_reference(
    mask: SequenceMask,
    logp: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    sequence_of_row: list[int],
) -> tuple[torch.Tensor, dict[int, float]]:
    """``(keep [N], value by sequence)``: 1 for the rows the sequence mask keeps, and each sequence's reduced statistic
    over its response rows (a sequence without one: 0, never masked). ``sequence_of_row``: each row's sequence id."""
    logp, m = logp.detach().double(), rollout_logprobs.double()
    keep = torch.ones_like(logp)
    values: dict[int, float] = {}
    for seq in sorted(set(sequence_of_row)):
        rows = [i for i, s in enumerate(sequence_of_row) if s == seq and bool(valid[i])]
        if not rows:
            values[seq] = 0.0
            continue
        d = _delta(logp[rows], m[rows])
        per_token = {
            "k1": -d,
            "k2": d**2 / 2,
            "k3": torch.exp(d) - 1 - d,
            "tv": (torch.exp(logp[rows]) - torch.exp(m[rows])).abs(),
        }[mask.statistic]
        value = {"sum": per_token.sum(), "mean": per_token.mean(), "max": per_token.max()}[mask.reduce].item()
        values[seq] = value
        out = (mask.high is not None and value > mask.high) or (mask.low is not None and value < mask.low)
        if out:
            for i in rows:
                if not mask.negative_advantages_only or float(advantages[i]) < 0:
                    keep[i] = 0.0
    return keep, values


def composed_rows_reference(
    out: dict[str, torch.Tensor],
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    sequence_of_row: list[int],
    *,
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
) -> tuple[dict[str, torch.Tensor], float]:
    """``(out, seq_masked_frac)``: ``dppo_loss_reference``'s per-row outputs with the sequence mask (a constant) and
    ``kl_tau * delta^2`` (differentiable through ``logp``) composed on them; ``seq_masked_frac`` over the sequences
    with a response row."""
    out = dict(out)
    frac = 0.0
    if sequence_mask is not None:
        keep, values = sequence_keep_reference(
            sequence_mask, out["logp"], rollout_logprobs, advantages, valid, sequence_of_row
        )
        present = {s for i, s in enumerate(sequence_of_row) if bool(valid[i])}
        dropped = [s for s in present if (keep[[i for i, t in enumerate(sequence_of_row) if t == s]] == 0).any()]
        if sequence_mask.negative_advantages_only:  # dropped means its statistic left the bounds
            dropped = [
                s
                for s in present
                if (sequence_mask.high is not None and values[s] > sequence_mask.high)
                or (sequence_mask.low is not None and values[s] < sequence_mask.low)
            ]
        frac = len(dropped) / max(len(present), 1)
        out["mask"] = out["mask"] * keep
        out["loss"] = torch.where(keep > 0, out["loss"], torch.zeros_like(out["loss"]))
    if kl_tau:
        m = torch.where(valid, rollout_logprobs.double(), torch.zeros_like(out["logp"]))
        d = _delta(out["logp"], m)
        kept = out["mask"].detach() > 0
        select = {"all": valid, "unmasked": valid & kept, "masked": valid & ~kept}[kl_mask_type]
        out["loss"] = out["loss"] + torch.where(select, kl_tau * d**2, torch.zeros_like(d))
    return out, frac


def dppo_loss_composed_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    kl_tau: float = 0.0,
    kl_mask_type: str = "all",
    sequence_mask: Optional[SequenceMask] = None,
    **op_settings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """End-to-end reference of ``dppo_ext.dppo_loss`` on ``[B, T, V]`` logits with a sequence mask and the penalty:
    ``(loss, {"masked_frac", "seq_masked_frac"})``. ``advantages``: ``[B, T]`` or ``[B]``; ``op_settings``: the
    op's (``mode``, ``mask_direction``, thresholds, ...)."""
    b, t, v = logits.shape
    if advantages.shape == (b,):
        advantages = advantages[:, None].expand(b, t)
    valid = response_mask.bool() & (tokens != IGNORE_INDEX)
    flat_tokens = torch.where(valid, tokens, torch.full_like(tokens, IGNORE_INDEX)).reshape(-1)
    out = dppo_loss_reference(
        logits.reshape(-1, v), flat_tokens, rollout_logprobs.reshape(-1), advantages.reshape(-1), **op_settings
    )
    out, frac = composed_rows_reference(
        out,
        rollout_logprobs.reshape(-1),
        advantages.reshape(-1),
        valid.reshape(-1),
        [i // t for i in range(b * t)],
        kl_tau=kl_tau,
        kl_mask_type=kl_mask_type,
        sequence_mask=sequence_mask,
    )
    loss = aggregate_loss_reference(out["loss"].reshape(b, t), valid, loss_agg_mode)
    flat_valid = valid.reshape(-1)
    n = max(int(flat_valid.sum()), 1)
    masked = float(((1 - out["mask"].detach()) * flat_valid).sum()) / n
    return loss, {
        "masked_frac": torch.tensor(masked, dtype=torch.float64),
        "seq_masked_frac": torch.tensor(frac if not math.isnan(frac) else 0.0, dtype=torch.float64),
    }

"""Per-step metrics that show the trust-region mechanism at work (docs/sanity.md, "Metrics").

The trainer fills one :class:`MechanismStats` per RL step from two kinds of no-grad passes of
``dppo_loss_per_row`` (the op's per-row outputs) over each micro-batch:

- the loss's own inputs, before the mini-batch's optimizer step: the mask the loss applied, split
  into the first mini-batch of the step (before any update of the step: masking caused by the
  rollout mismatch alone) and the later ones (masking caused by the step's own updates), and
  binned by the rollout probability mu of the token x the advantage's sign;
- the same tokens right after the optimizer step (the policy pi_new, against pi_old, the same
  tokens' probabilities just before that step): the post-update drift ``|pi_new - mu|``, the
  probability mass ``pi_old - pi_new`` that the step removed from negative-advantage samples the
  rollout found likely (mu > 0.5), and the fraction of bad updates.

A **bad update** is a token that an optimizer step pushed further outside the total-variation
trust region around the rollout policy, on the side its advantage pushes it to: with
``away = pi - mu`` for A > 0 and ``mu - pi`` for A < 0, ``away_new > 0.15`` and
``away_new > away_old`` (0.15: DPPO Binary-TV's threshold, the same for every method). Masked
tokens count too: their probability still moves with the shared weights. It is what the paper
says destabilises training: steps that move a sampled token's probability ever further from the
distribution it was sampled from.

The **pre-update mismatch** ``pre_mismatch_mean`` / ``pre_mismatch_max`` is ``|pi - mu|`` of the first
mini-batch's tokens before the step's first update, mu the rollout engine's probability: the same
quantity for every loss (the loss's own ``mismatch_mean`` compares pi with what the op was fed, which
is pi_old for ``pg_pi_old``).

A **bad negative update** (``bad_neg_frac``, experiments/sanity/results/staleness/PREREGISTRATION.md, part 5): a
token-update with A < 0 and mu > 0.5 that left the token's probability more than 0.15 below mu and
lower than before the update (``pi_new < mu - 0.15`` and ``pi_new < pi_old``), as a fraction of the
token-updates with A < 0 and mu > 0.5 (``neg_high_tokens``). Unlike ``bad_update_frac`` it cannot
count a positive-advantage token being learned. Under a rollout lag it is close to tautological for DPPO: it also
counts tokens already beyond ``mu - 0.15`` before the update, exactly those DPPO masks.

A **crossing bad negative update** (``bad_neg_cross_frac``, experiments/sanity/collapse/PREREGISTRATION.md): the same
token-updates (A < 0, mu > 0.5) whose update carried the token across the threshold, ``pi_old >= mu - 0.15 >
pi_new``; same denominator. It counts only what this step's update did.

Counts are over tokens x updates (a token is seen once per epoch), so fractions are token means.
"""

from __future__ import annotations

from typing import Any

import torch

from dppo_ext.contract import IGNORE_INDEX
from dppo_ext.trainer.batch import RolloutBatch

__all__ = ["BAD_UPDATE_DELTA", "HIGH_MU", "MU_BIN_EDGES", "MechanismStats", "op_rows", "token_logprobs"]

# Bins of the rollout probability mu of a sampled token: rare (< 1e-3) ... near-certain (>= 0.9).
MU_BIN_EDGES = (0.0, 1e-3, 1e-2, 0.1, 0.5, 0.9, 1.0)
BAD_UPDATE_DELTA = 0.15
HIGH_MU = 0.5


@torch.no_grad()
def token_logprobs(logits: torch.Tensor, micro: RolloutBatch, temperature: float) -> torch.Tensor:
    """``[b, T]`` log pi of ``micro``'s tokens from its response ``logits`` ``[b, T, V]``: the softmax of logits / T,
    renormalised over each position's kept set under sampling replay (``micro.kept_ids``), as the loss scores it."""
    if micro.kept_ids is not None:
        return op_rows(logits, micro, "none", temperature, {})[0].logp.reshape(micro.tokens.shape)
    scaled = logits.float() / temperature
    return torch.log_softmax(scaled, dim=-1).gather(-1, micro.tokens.unsqueeze(-1)).squeeze(-1)


def op_rows(logits: torch.Tensor, micro: RolloutBatch, mode: str, temperature: float, settings: dict[str, object]):
    """The op's per-row outputs for ``micro`` (no grad): ``(outputs, valid [N], mu [N], advantages [N])``.

    ``logits``: ``[b, T, V]`` response logits of ``micro``. The rows and settings are the loss's.
    """
    from dppo_ext import dppo_loss_per_row

    valid = micro.response_mask.reshape(-1)
    tokens = torch.where(micro.response_mask, micro.tokens, torch.full_like(micro.tokens, IGNORE_INDEX)).reshape(-1)
    rows = valid.numel()
    advantages = micro.advantages.float()[:, None].expand(micro.tokens.shape).reshape(-1)

    def flat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(rows, *t.shape[2:])

    with torch.no_grad():
        out = dppo_loss_per_row(
            logits.detach().reshape(rows, logits.shape[-1]),
            tokens,
            flat(micro.rollout_logprobs).float(),
            advantages,
            topk_ids=flat(micro.topk_ids),
            topk_logprobs=None if micro.topk_logprobs is None else flat(micro.topk_logprobs).float(),
            anchor_logprobs=None if micro.anchor_logprobs is None else flat(micro.anchor_logprobs).float(),
            kept_ids=flat(micro.kept_ids),
            mode=mode,
            temperature=temperature,
            compute_entropy=False,
            sequence_ids=torch.arange(micro.tokens.shape[0]).repeat_interleave(micro.tokens.shape[1]).to(valid.device),
            **settings,
        )
    return out, valid, flat(micro.rollout_logprobs).float().exp(), advantages


class MechanismStats:
    """One RL step's mechanism counters; :meth:`record` gives the metrics.jsonl fields."""

    def __init__(self) -> None:
        bins = len(MU_BIN_EDGES) - 1
        self.edges = torch.tensor(MU_BIN_EDGES[1:-1])
        self.masked = {"first": 0.0, "later": 0.0}
        self.tokens = {"first": 0.0, "later": 0.0}
        self.bin_masked = {"pos": [0] * bins, "neg": [0] * bins}
        self.bin_tokens = {"pos": [0] * bins, "neg": [0] * bins}
        self.drift_sum = 0.0
        self.drift_max = 0.0
        self.drift_tokens = 0.0
        self.bad = 0.0
        self.neg_high_removed = 0.0
        self.neg_high_tokens = 0.0
        self.bad_neg = 0.0
        self.bad_neg_cross = 0.0
        self.pre_mismatch_sum = 0.0
        self.pre_mismatch_max = 0.0
        self.pre_tokens = 0.0
        self.clipped_updates = 0

    def add_mask(
        self, mask: torch.Tensor, valid: torch.Tensor, mu: torch.Tensor, advantages: torch.Tensor, *, first: bool
    ) -> None:
        """The loss's mask ``[N]`` (1 = trained, 0 = masked) over valid rows, before an optimizer step."""
        masked = (mask < 0.5) & valid
        key = "first" if first else "later"
        self.masked[key] += float(masked.sum())
        self.tokens[key] += float(valid.sum())
        bins = torch.bucketize(mu, self.edges, right=True)
        for sign, side in (("pos", advantages > 0), ("neg", advantages < 0)):
            rows = valid & side
            self._add_counts(self.bin_tokens[sign], bins[rows])
            self._add_counts(self.bin_masked[sign], bins[rows & masked])

    def add_pre_update(self, logp: torch.Tensor, valid: torch.Tensor, mu: torch.Tensor) -> None:
        """The first mini-batch's tokens ``[N]`` before the step's first update: ``logp`` = log pi, ``mu`` the rollout
        probabilities."""
        gap = torch.where(valid, (logp.float().exp() - mu).abs(), torch.zeros_like(mu))
        self.pre_mismatch_sum += float(gap.sum())
        self.pre_mismatch_max = max(self.pre_mismatch_max, float(gap.max())) if gap.numel() else self.pre_mismatch_max
        self.pre_tokens += float(valid.sum())

    def _add_counts(self, counts: list[int], bins: torch.Tensor) -> None:
        for b, c in enumerate(torch.bincount(bins, minlength=len(counts)).tolist()):
            counts[b] += int(c)

    def add_post_update(
        self,
        logp_new: torch.Tensor,
        logp_old: torch.Tensor,
        valid: torch.Tensor,
        mu: torch.Tensor,
        advantages: torch.Tensor,
    ) -> None:
        """The tokens ``[N]`` right after the optimizer step that trained them (``logp_new``) and just before it
        (``logp_old``), as log-probs."""
        pi, pi_old = logp_new.float().exp(), logp_old.float().exp()
        drift = torch.where(valid, (pi - mu).abs(), torch.zeros_like(pi))
        self.drift_sum += float(drift.sum())
        self.drift_max = max(self.drift_max, float(drift.max())) if drift.numel() else self.drift_max
        self.drift_tokens += float(valid.sum())
        sign = torch.where(advantages > 0, 1.0, -1.0)
        away_new, away_old = sign * (pi - mu), sign * (pi_old - mu)
        self.bad += float((valid & (advantages != 0) & (away_new > BAD_UPDATE_DELTA) & (away_new > away_old)).sum())
        high_neg = valid & (advantages < 0) & (mu > HIGH_MU)
        self.neg_high_removed += float((pi_old - pi)[high_neg].sum())
        self.neg_high_tokens += float(high_neg.sum())
        self.bad_neg += float((high_neg & (pi < mu - BAD_UPDATE_DELTA) & (pi < pi_old)).sum())
        self.bad_neg_cross += float((high_neg & (pi_old >= mu - BAD_UPDATE_DELTA) & (pi < mu - BAD_UPDATE_DELTA)).sum())

    def record(self) -> dict[str, Any]:
        """The step's fields (fractions are NaN, i.e. null in the JSONL, when nothing was counted)."""
        frac = lambda num, den: num / den if den else float("nan")  # noqa: E731
        return {
            "masked_frac_first": frac(self.masked["first"], self.tokens["first"]),
            "masked_frac_later": frac(self.masked["later"], self.tokens["later"]),
            "masked_by_mu_pos": list(self.bin_masked["pos"]),
            "masked_by_mu_neg": list(self.bin_masked["neg"]),
            "tokens_by_mu_pos": list(self.bin_tokens["pos"]),
            "tokens_by_mu_neg": list(self.bin_tokens["neg"]),
            "drift_mean": frac(self.drift_sum, self.drift_tokens),
            "drift_max": self.drift_max if self.drift_tokens else float("nan"),
            "bad_update_frac": frac(self.bad, self.drift_tokens),
            "neg_high_removed": frac(self.neg_high_removed, self.neg_high_tokens),
            "neg_high_tokens": int(self.neg_high_tokens),
            "bad_neg_frac": frac(self.bad_neg, self.neg_high_tokens),
            "bad_neg_cross_frac": frac(self.bad_neg_cross, self.neg_high_tokens),
            "pre_mismatch_mean": frac(self.pre_mismatch_sum, self.pre_tokens),
            "pre_mismatch_max": self.pre_mismatch_max if self.pre_tokens else float("nan"),
            "clipped_updates": self.clipped_updates,
        }

"""One RL step's loss metrics, gathered over its micro-batches and optimizer steps (the record's core fields).

The loss's per-call metrics are token means, so the step's are weighted by each call's ``num_tokens``;
``ratio_max`` is the largest over the step. The mismatch metrics (:data:`FIRST_BATCH`: ``mismatch_mean`` /
``mismatch_max``, ``mismatch_k3``, ``log_ratio_min`` / ``log_ratio_max``, ``log_ratio_outlier_frac``, ``ess``) come
from the step's first mini-batch only, scored before any optimizer step of the step, when the engine's weights and
the trainer's agree (``dppo_ext.trainer.loop``). ``loss`` and ``grad_norm`` are means over the optimizer steps, the
skipped ones (a non-finite gradient) included. :class:`~dppo_ext.trainer.mechanism.MechanismStats` adds the
mechanism's fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["FIRST_BATCH", "TOKEN_MEANS", "StepStats", "nan_max"]

# The loss metrics a step reports as token means over all of its micro-batches.
# seq_masked_frac: the share of sequences a sequence mask drops (0 for a loss without one), weighted by the tokens.
TOKEN_MEANS = (
    "masked_frac",
    "masked_frac_pos",
    "masked_frac_neg",
    "entropy_mean",
    "divergence_mean",
    "seq_masked_frac",
)
# The mismatch metrics of the first mini-batch and how its micro-batches combine: a token-weighted mean (the ESS's
# too), or the extreme (a NaN kept).
FIRST_BATCH = {
    "mismatch_mean": "mean",
    "mismatch_max": "max",
    "mismatch_k3": "mean",
    "log_ratio_min": "min",
    "log_ratio_max": "max",
    "log_ratio_outlier_frac": "mean",
    "ess": "mean",
}


def nan_max(a: float, b: float) -> float:
    """max() that keeps a NaN (Python's max(0.0, nan) is 0.0, which would hide a NaN step)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def nan_min(a: float, b: float) -> float:
    """min() that keeps a NaN."""
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


class StepStats:
    """One RL step's counters; :meth:`record` gives the metrics.jsonl fields."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(TOKEN_MEANS, 0.0)
        self.tokens = 0.0
        self.ratio_max = 0.0
        self.first: dict[str, float] = {}  # FIRST_BATCH's sums (means) or extremes
        self.first_tokens = 0.0
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.skipped = 0

    def add_micro_batch(self, metrics: Mapping[str, Any], *, first: bool) -> None:
        """One loss call's ``metrics``; ``first``: the call belongs to the step's first mini-batch."""
        tokens = float(metrics["num_tokens"])
        self.tokens += tokens
        for key in TOKEN_MEANS:
            self.sums[key] += float(metrics[key]) * tokens
        self.ratio_max = nan_max(self.ratio_max, float(metrics["ratio_max"]))
        if first:
            self.first_tokens += tokens
            for key, how in FIRST_BATCH.items():
                value = float(metrics[key])
                if how == "mean":
                    self.first[key] = self.first.get(key, 0.0) + value * tokens
                elif key in self.first:
                    self.first[key] = (nan_max if how == "max" else nan_min)(self.first[key], value)
                else:
                    self.first[key] = value

    def add_optimizer_step(self, loss: float, grad_norm: float, *, skipped: bool) -> None:
        """One mini-batch's loss and gradient norm; ``skipped``: its optimizer step was not taken."""
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        self.skipped += int(skipped)

    def record(self, lr: float) -> dict[str, float]:
        """The step's fields (``lr``: the learning rate it trained with)."""
        out = {key: value / max(self.tokens, 1.0) for key, value in self.sums.items()}
        out.update(
            ratio_max=self.ratio_max,
            loss=sum(self.losses) / len(self.losses),
            grad_norm=sum(self.grad_norms) / len(self.grad_norms),
            **{
                key: self.first.get(key, 0.0) / max(self.first_tokens, 1.0)
                if how == "mean"
                else self.first.get(key, 0.0)
                for key, how in FIRST_BATCH.items()
            },
            optimizer_steps=len(self.losses) - self.skipped,
            skipped_optimizer_steps=self.skipped,
            lr=lr,
        )
        return out

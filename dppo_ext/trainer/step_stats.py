"""One RL step's loss metrics, gathered over its micro-batches and optimizer steps (the record's core fields).

The loss's per-call metrics are token means, so the step's are weighted by each call's ``num_tokens``;
``ratio_max`` is the largest over the step. ``mismatch_mean`` / ``mismatch_max`` come from the step's first
mini-batch only, scored before any optimizer step of the step, when the engine's weights and the trainer's agree
(``dppo_ext.trainer.loop``). ``loss`` and ``grad_norm`` are means over the optimizer steps, the skipped ones (a
non-finite gradient) included. :class:`~dppo_ext.trainer.mechanism.MechanismStats` adds the mechanism's fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["TOKEN_MEANS", "StepStats", "nan_max"]

# The loss metrics a step reports as token means over all of its micro-batches.
TOKEN_MEANS = ("masked_frac", "masked_frac_pos", "masked_frac_neg", "entropy_mean", "divergence_mean")


def nan_max(a: float, b: float) -> float:
    """max() that keeps a NaN (Python's max(0.0, nan) is 0.0, which would hide a NaN step)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


class StepStats:
    """One RL step's counters; :meth:`record` gives the metrics.jsonl fields."""

    def __init__(self) -> None:
        self.sums = dict.fromkeys(TOKEN_MEANS, 0.0)
        self.tokens = 0.0
        self.ratio_max = 0.0
        self.mismatch_sum = 0.0
        self.mismatch_max = 0.0
        self.mismatch_tokens = 0.0
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
            self.mismatch_sum += float(metrics["mismatch_mean"]) * tokens
            self.mismatch_max = nan_max(self.mismatch_max, float(metrics["mismatch_max"]))
            self.mismatch_tokens += tokens

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
            mismatch_mean=self.mismatch_sum / max(self.mismatch_tokens, 1.0),
            mismatch_max=self.mismatch_max,
            optimizer_steps=len(self.losses) - self.skipped,
            skipped_optimizer_steps=self.skipped,
            lr=lr,
        )
        return out

"""StepStats: a step's loss metrics from its loss calls and optimizer steps, checked against sums by hand."""

from __future__ import annotations

import math

import pytest

from dppo_ext.trainer.step_stats import FIRST_BATCH, TOKEN_MEANS, StepStats


def _metrics(tokens: float, value: float, ratio_max: float, mismatch: float) -> dict[str, float]:
    return {
        "num_tokens": tokens,
        **{key: value + i for i, key in enumerate(TOKEN_MEANS)},
        "ratio_max": ratio_max,
        "mismatch_mean": mismatch,
        "mismatch_max": 2 * mismatch,
        "mismatch_k3": mismatch / 2,
        "log_ratio_min": -3 * mismatch,
        "log_ratio_max": 3 * mismatch,
        "log_ratio_outlier_frac": 10 * mismatch,
        "ess": 1 - mismatch,
    }


def test_token_means_weigh_each_call_by_its_tokens_and_the_mismatch_is_the_first_mini_batchs():
    stats = StepStats()
    stats.add_micro_batch(_metrics(3, 0.1, 1.5, 1e-6), first=True)
    stats.add_micro_batch(_metrics(1, 0.5, 1.2, 4e-6), first=True)
    stats.add_optimizer_step(0.25, 0.5, skipped=False)
    stats.add_micro_batch(_metrics(4, 0.2, 3.0, 0.3), first=False)  # after an update: not the engine's mismatch
    stats.add_optimizer_step(0.75, 1.5, skipped=True)
    record = stats.record(lr=1e-4)
    assert list(record) == [
        *TOKEN_MEANS,
        "ratio_max",
        "loss",
        "grad_norm",
        *FIRST_BATCH,
        "optimizer_steps",
        "skipped_optimizer_steps",
        "lr",
    ]
    for i, key in enumerate(TOKEN_MEANS):
        assert record[key] == pytest.approx((3 * (0.1 + i) + 1 * (0.5 + i) + 4 * (0.2 + i)) / 8)
    assert record["ratio_max"] == 3.0
    assert record["mismatch_mean"] == pytest.approx((3 * 1e-6 + 1 * 4e-6) / 4)
    assert record["mismatch_max"] == 8e-6
    assert record["mismatch_k3"] == pytest.approx((3 * 0.5e-6 + 1 * 2e-6) / 4)
    assert (record["log_ratio_min"], record["log_ratio_max"]) == (-12e-6, 12e-6)
    assert record["log_ratio_outlier_frac"] == pytest.approx((3 * 1e-5 + 1 * 4e-5) / 4)
    assert record["ess"] == pytest.approx((3 * (1 - 1e-6) + 1 * (1 - 4e-6)) / 4)
    assert (record["loss"], record["grad_norm"]) == (0.5, 1.0)
    assert (record["optimizer_steps"], record["skipped_optimizer_steps"], record["lr"]) == (1, 1, 1e-4)


def test_a_nan_ratio_max_is_kept_whatever_comes_after_it():
    stats = StepStats()
    stats.add_micro_batch(_metrics(2, 0.1, math.nan, 1e-6), first=True)
    stats.add_micro_batch(_metrics(2, 0.1, 2.0, 1e-6), first=True)
    stats.add_optimizer_step(math.nan, math.inf, skipped=True)
    record = stats.record(lr=1e-4)
    assert math.isnan(record["ratio_max"]) and math.isnan(record["loss"])
    assert record["optimizer_steps"] == 0 and record["skipped_optimizer_steps"] == 1

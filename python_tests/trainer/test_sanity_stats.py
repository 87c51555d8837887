"""The sanity test's summaries, intervals and decision rules (docs/sanity.md, "Rules") on hand-made runs
whose answers are known, and the collected data format (bins summed per evaluation window)."""

from __future__ import annotations

import math
import statistics

import pytest

from experiments.sanity import stats
from experiments.sanity.sweep import BIN_COLUMNS, COLUMNS, data_file_rows


def _run(
    start: float,
    evals: list[float],
    *,
    mismatch: tuple[float, float] = (1e-3, 1e-3),
    masked_first: float = 0.0,
    steps: int = 200,
) -> list[dict]:
    """Records of a run: accuracy ``start`` at step 0, then ``evals`` spread evenly up to ``steps``; the pre-update
    mismatch moves linearly from ``mismatch[0]`` to ``mismatch[1]``; a constant first-mini-batch masked fraction."""
    every = steps // len(evals)
    records = [{"step": 0, "eval_acc": start}]
    for step in range(1, steps + 1):
        r = {
            "step": step,
            "mismatch_mean": mismatch[0] + (mismatch[1] - mismatch[0]) * step / steps,
            "masked_frac_first": masked_first,
            "grad_norm": 1.0,
            "trained_seqs": 10,
            "optimizer_steps": 8,
        }
        if step % every == 0:
            r["eval_acc"] = evals[step // every - 1]
        records.append(r)
    return records


def test_run_summary_endpoints_and_collapse():
    s = stats.run_summary(_run(0.10, [0.2, 0.3, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.12, 0.14]))
    assert s["start_acc"] == 0.10 and s["peak_acc"] == 0.4
    assert s["final_acc"] == pytest.approx((0.1 + 0.12 + 0.14) / 3)  # the last three evaluations
    assert s["gain"] == pytest.approx(s["final_acc"] - 0.10)
    assert s["collapsed"]  # 0.12 < half of the 0.4 peak
    assert not stats.run_summary(_run(0.10, [0.2] * 10))["collapsed"]
    grown = stats.run_summary(_run(0.1, [0.2] * 10, mismatch=(0.01, 0.03)))
    # mean over steps 151-200 / mean over steps 1-50 of a linear ramp 0.01 -> 0.03
    assert grown["mismatch_growth"] == pytest.approx((0.01 + 0.02 * 175.5 / 200) / (0.01 + 0.02 * 25.5 / 200))
    nan_run = _run(0.1, [0.2] * 10)
    nan_run[5]["grad_norm"] = None  # a non-finite gradient norm (null in the JSONL)
    assert stats.run_summary(nan_run)["collapsed"]


def test_interval_and_power():
    values = [0.1, 0.14, 0.09]
    ci = stats.interval(values)
    assert ci.mean == pytest.approx(statistics.mean(values))
    assert ci.half == pytest.approx(4.303 * statistics.stdev(values) / math.sqrt(3))
    assert stats.interval([0.2]).text() == "20.0" and math.isnan(stats.interval([]).mean)
    # 3 paired seeds, paired sd 3 points: (4.303 + 1.061) * 3 / sqrt(3) = 9.3 points
    assert stats.minimal_detectable(0.03, 3) == pytest.approx(0.0929, abs=1e-4)


def _arm(pg_top: list[float], pg_control: list[float], *, pg_growth: float = 2.0, dppo_mask: float = 0.2) -> dict:
    """Summaries of the noise arm: DPPO Binary-TV ends at 0.25 in every seed and condition."""
    dppo = {
        s: stats.run_summary(_run(0.08, [0.25] * 10, mismatch=(0.05, 0.05), masked_first=dppo_mask)) for s in range(3)
    }
    return {
        "sigma0": {
            "dppo_binary_tv": dppo,
            "pg_is": {s: stats.run_summary(_run(0.08, [v] * 10)) for s, v in enumerate(pg_control)},
        },
        "sigma1": {
            "dppo_binary_tv": dppo,
            "pg_is": {
                s: stats.run_summary(_run(0.08, [v] * 10, mismatch=(0.05, 0.05 * pg_growth)))
                for s, v in enumerate(pg_top)
            },
        },
    }


def test_mechanism_rule_confirms_refutes_or_stays_inconclusive():
    verdict = lambda arm: stats.mechanism_verdict(arm, "sigma0", "sigma1")[0]  # noqa: E731
    # PG-IS 10+ points below DPPO in 2 of 3 seeds at the top dose, its mismatch doubling, level in the control
    assert verdict(_arm([0.10, 0.15, 0.24], [0.24, 0.26, 0.22])) == "confirmed"
    # the same outcome but PG-IS's mismatch flat: the mechanism is not what separated them
    assert verdict(_arm([0.10, 0.15, 0.24], [0.24, 0.26, 0.22], pg_growth=1.0)) == "inconclusive"
    # the control separates too: not the mismatch
    assert verdict(_arm([0.10, 0.15, 0.24], [0.10, 0.12, 0.22])) == "inconclusive"
    # level at the top dose although DPPO's mask switched on from step 1: refuted
    assert verdict(_arm([0.24, 0.27, 0.22], [0.24, 0.26, 0.22])) == "refuted"
    # level, but DPPO's mask never responded: the dose did not test the mechanism
    assert verdict(_arm([0.24, 0.27, 0.22], [0.24, 0.26, 0.22], dppo_mask=0.01)) == "inconclusive"
    assert verdict({}) == "inconclusive"


def test_tail_rule():
    def runs(rare: float, common: float, final: float) -> dict:
        out = {}
        for s in range(3):
            summary = stats.run_summary(_run(0.05, [final] * 10))
            summary.update(masked_rare=rare, masked_common=common)
            out[s] = summary
        return out

    arm = {"tail_sigma0.3": {"grpo_clip_higher": runs(0.4, 0.05, 0.10), "dppo_binary_tv": runs(0.0, 0.02, 0.20)}}
    masking, learning, _ = stats.tail_verdict(arm, "tail_sigma0.3")
    assert (masking, learning) == ("confirmed", "confirmed")
    arm = {"tail_sigma0.3": {"grpo_clip_higher": runs(0.05, 0.05, 0.2), "dppo_binary_tv": runs(0.0, 0.02, 0.21)}}
    assert stats.tail_verdict(arm, "tail_sigma0.3")[:2] == ("refuted", "refuted")


def test_collected_rows_sum_the_bins_over_each_evaluation_window():
    bins = {key: [1, 0, 0, 0, 0, 2] for key in BIN_COLUMNS}
    evaluation = {"eval_acc": 0.12375}
    records = [{"step": 0, "eval_acc": 0.1}] + [
        {"step": s, "reward": 1 / 3, "mismatch_mean": 0.0123456, **bins, **(evaluation if s % 2 == 0 else {})}
        for s in (1, 2, 3, 4)
    ]
    rows = data_file_rows(records)
    at = {name: i for i, name in enumerate([*COLUMNS, *BIN_COLUMNS])}
    assert rows[0][at["eval_acc"]] == 0.1 and rows[0][at["masked_by_mu_pos"]] is None
    assert rows[1][at["reward"]] == pytest.approx(1 / 3, rel=1e-12)  # kept exactly
    assert rows[1][at["mismatch_mean"]] == 0.0123  # 3 significant digits
    assert rows[1][at["tokens_by_mu_neg"]] is None  # not an evaluation step: the bins wait for the window's end
    assert rows[2][at["eval_acc"]] == 0.12375 and rows[2][at["tokens_by_mu_neg"]] == [2, 0, 0, 0, 0, 4]
    assert rows[4][at["masked_by_mu_pos"]] == [2, 0, 0, 0, 0, 4]  # steps 3-4 only


def test_verdict_table_gives_each_rule_its_verdict_and_effect():
    from experiments.sanity.report import verdict_table

    # PG-IS ends 15, 10 and 1 points below DPPO Binary-TV (0.25) at sigma1, level in the control
    table = verdict_table(_arm([0.10, 0.15, 0.24], [0.24, 0.26, 0.22]))
    row = next(line for line in table.splitlines() if line.startswith("| 1 (noise, sigma1) | pg_is"))
    assert "**confirmed**" in row and "| 2 / 1 / 3 |" in row
    assert f"| {100 * statistics.mean([-0.15, -0.10, -0.01]):.1f} ± " in row  # the paired mean difference, points
    assert f"| {100 * statistics.mean([-0.01, 0.01, -0.03]):.1f} ± " in row  # the control's
    assert "**inconclusive**" in next(line for line in table.splitlines() if line.startswith("| 2 (lag"))

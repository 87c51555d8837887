"""The collapse replication (experiments/sanity/collapse/PREREGISTRATION.md): the exact tests and intervals against
textbook values and brute-force enumeration, the collapse endpoint (its tie included), the decision rule, the plan,
the crossing bad-negative-update metric, and the report on synthetic data files."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest
import torch

from dppo_ext.trainer.losses import LOSSES
from dppo_ext.trainer.mechanism import MechanismStats
from experiments.sanity import collapse
from experiments.sanity.conditions import COLLAPSE_CONDITION, COLLAPSE_SEEDS, CONDITIONS, STALE_SEEDS
from experiments.sanity.counts import (
    clopper_pearson,
    fisher_greater,
    fisher_power,
    holm,
    kaplan_meier,
    logrank,
    mcnemar_greater,
    newcombe,
    signed_rank,
    wilson,
)


# ---------------------------------------------------------------- exact tests and intervals
def test_fisher_matches_the_tea_tasting_lady_and_direct_enumeration():
    assert fisher_greater(4, 4, 0, 4) == pytest.approx(1 / 70, rel=1e-12)  # Fisher (1935): 1 table of 70
    assert fisher_greater(3, 4, 1, 4) == pytest.approx(17 / 70, rel=1e-12)  # 16 + 1 of 70
    # independent: enumerate which units carry the k events (the hypergeometric's definition) on a small case
    n1, n2, k = 5, 6, 4
    units = [1] * n1 + [2] * n2
    draws = list(itertools.combinations(range(n1 + n2), k))
    for x1 in range(k + 1):
        hits = sum(sum(units[i] == 1 for i in d) >= x1 for d in draws)
        assert fisher_greater(x1, n1, k - x1, n2) == pytest.approx(hits / len(draws), rel=1e-12)
    with pytest.raises(ValueError, match="group 1 must be a count"):
        fisher_greater(5, 4, 0, 4)


def test_wilson_and_newcombe_match_newcombes_published_examples():
    assert wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)  # Newcombe (1998a), example
    # Newcombe (1998b), Statistics in Medicine 17:873, table II, method 10
    assert newcombe(56, 70, 48, 80) == pytest.approx((0.2, 0.0524, 0.3339), abs=1e-4)
    assert newcombe(9, 10, 3, 10) == pytest.approx((0.6, 0.1705, 0.8090), abs=1e-4)
    assert newcombe(0, 10, 0, 20) == pytest.approx((0.0, -0.1611, 0.2775), abs=1e-4)


def test_mcnemar_is_the_binomial_tail_of_the_discordant_pairs():
    assert mcnemar_greater(9, 1) == pytest.approx(11 / 1024, rel=1e-12)
    assert mcnemar_greater(0, 0) == 1.0 and mcnemar_greater(0, 5) == 1.0


def test_clopper_pearson_matches_its_closed_forms_and_a_textbook_value():
    assert clopper_pearson(0, 48)[1] == pytest.approx(1 - 0.025 ** (1 / 48), abs=1e-9)  # x = 0: closed form
    assert clopper_pearson(48, 48)[0] == pytest.approx(0.025 ** (1 / 48), abs=1e-9)
    assert clopper_pearson(1, 10) == pytest.approx((0.0025, 0.4450), abs=1e-4)
    # the bound solves its defining equation: P(X <= 3 | n = 48, upper) = 0.025
    hi = clopper_pearson(3, 48)[1]
    assert sum(math.comb(48, i) * hi**i * (1 - hi) ** (48 - i) for i in range(4)) == pytest.approx(0.025, abs=1e-9)


def test_holm_adjusts_step_down_and_keeps_monotone():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize(
    "diffs",
    [[0.3, -0.1, 0.2, 0.5, -0.4, 0.7, 0.05], [1, 1, -1, 2, 2, -2, 3, 0, 0.5, -0.5], [-1, -2, 0.5, -3, -0.5]],
)
def test_signed_rank_matches_brute_force_over_every_sign_pattern(diffs):
    w, n, p = signed_rank(diffs, "greater")
    nonzero = [d for d in diffs if d != 0]
    ranks = {}  # mid-ranks by brute force: the mean position of each |d|
    ordered = sorted(abs(d) for d in nonzero)
    for value in set(ordered):
        where = [i + 1 for i, v in enumerate(ordered) if v == value]
        ranks[value] = Fraction(sum(where), len(where))
    observed = sum(ranks[abs(d)] for d in nonzero if d > 0)
    patterns = list(itertools.product((0, 1), repeat=len(nonzero)))
    stats = [sum(ranks[abs(d)] for d, s in zip(nonzero, sign) if s) for sign in patterns]
    assert w == float(observed) and n == len(nonzero)
    assert p == pytest.approx(sum(s >= observed for s in stats) / len(patterns), rel=1e-12)
    assert signed_rank(diffs, "less")[2] == pytest.approx(sum(s <= observed for s in stats) / len(patterns))


def test_signed_rank_textbook_corner_and_errors():
    assert signed_rank([float(i) for i in range(1, 11)])[2] == pytest.approx(1 / 1024)  # all 10 positive
    with pytest.raises(ValueError, match="alternative"):
        signed_rank([1.0], "two")


# Freireich et al. (1963), 6-MP vs placebo (remission weeks; False = censored), the survival textbooks' example
SIX_MP = [6, 6, 6, 6, 7, 9, 10, 10, 11, 13, 16, 17, 19, 20, 22, 23, 25, 32, 32, 34, 35]
SIX_MP_EVENT = [1, 1, 1, 0, 1, 0, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]
PLACEBO = [1, 1, 2, 2, 3, 4, 4, 5, 5, 8, 8, 8, 8, 11, 11, 12, 12, 15, 17, 22, 23]


def test_kaplan_meier_and_logrank_match_the_leukaemia_example():
    curve = dict(kaplan_meier(SIX_MP, [bool(e) for e in SIX_MP_EVENT]))
    expected = {6: 0.857, 7: 0.807, 10: 0.753, 13: 0.690, 16: 0.627, 22: 0.538, 23: 0.448}
    assert curve == pytest.approx(expected, abs=5e-4)
    o1, e1, v, chi2, p = logrank(PLACEBO, [True] * 21, SIX_MP, [bool(e) for e in SIX_MP_EVENT])
    assert (o1, e1) == pytest.approx((21, 10.75), abs=5e-3)
    assert chi2 == pytest.approx(16.79, abs=0.01)  # R: survdiff -> Chisq = 16.8
    assert p == pytest.approx(0.5 * math.erfc(math.sqrt(chi2) / math.sqrt(2)))


def test_power_of_the_fisher_test_matches_the_pre_registered_table():
    assert fisher_power(48, 0.25, 0.04) == pytest.approx(0.79, abs=0.005)
    assert fisher_power(48, 0.30, 0.04) == pytest.approx(0.92, abs=0.005)
    assert fisher_power(32, 0.25, 0.04) < fisher_power(40, 0.25, 0.04) < fisher_power(48, 0.25, 0.04)


# ---------------------------------------------------------------- the endpoint
def _records(evals: list[float], start: float = 0.1, nan_at: int | None = None, key: str = "grad_norm") -> list:
    """A 300-step run evaluated every 20 steps (``evals``: steps 20..300), a non-finite ``key`` at ``nan_at``."""
    assert len(evals) == 15
    records = [{"step": 0, "eval_acc": start}]
    for step in range(1, 301):
        r = {"step": step, "trained_seqs": 4, "loss": 0.1, "grad_norm": 1.0}
        if step == nan_at:
            del r[key]
        if step % 20 == 0:
            r["eval_acc"] = evals[step // 20 - 1]
        records.append(r)
    return records


def test_collapse_endpoint_tie_floor_and_non_finite():
    # final (steps 240-300) exactly half the peak: a tie is NOT a collapse ("<")
    tie = collapse.endpoint(_records([0.3, 0.4, 0.3] + [0.2] * 8 + [0.2, 0.2, 0.2, 0.2]))
    assert tie["final"] == 0.2 and tie["peak"] == 0.4 and not tie["collapsed"]
    # scores that are not exact in binary floating point still tie exactly: 0.19 / 2 = 0.095
    assert not collapse.endpoint(_records([0.19] + [0.1] * 10 + [0.095] * 4, start=0.05))["collapsed"]
    # one sample below the tie is a collapse
    below = collapse.endpoint(_records([0.3, 0.4, 0.3] + [0.2] * 8 + [0.2, 0.2, 0.2, 0.19875]))
    assert below["collapsed"] and below["time"] == 300.0
    # below half the peak but less than 5 points under it: not a collapse (a near-floor seed)
    assert not collapse.endpoint(_records([0.08] + [0.035] * 14, start=0.05))["collapsed"]
    assert collapse.endpoint(_records([0.1] + [0.04] * 14))["collapsed"]  # 6 points under a peak of 10
    # the time: the first evaluation below half the peak so far, 5 points under it
    fall = collapse.endpoint(_records([0.3, 0.5, 0.3, 0.2] + [0.1] * 11))
    assert fall["collapsed"] and fall["time"] == 80.0
    assert fall["ratio"] == pytest.approx(math.log(0.1 / 0.5))
    # a non-finite loss or gradient norm on a step that trained: a collapse, at that step
    for key in ("grad_norm", "loss"):
        bad = collapse.endpoint(_records([0.3] * 15, nan_at=123, key=key))
        assert bad["collapsed"] and bad["non_finite"] and bad["time"] == 123.0
    # files that never collected the loss are judged on the gradient norm alone
    assert not collapse.endpoint(_records([0.3] * 15, nan_at=7, key="loss"), check_loss=False)["collapsed"]
    with pytest.raises(ValueError, match="evaluations at steps 240-300"):
        collapse.endpoint(_records([0.3] * 15)[:200])


def test_the_decision_rule():
    assert collapse.decide(0.02, 0.15, 0.3) == "confirmed"
    assert collapse.decide(0.025, 0.20, 0.4) == "confirmed"  # p <= alpha
    assert collapse.decide(0.02, 0.14, 0.3) == "inconclusive"  # significant but below 15 points
    assert collapse.decide(0.03, 0.20, 0.4) == "inconclusive"
    assert collapse.decide(0.5, 0.02, 0.149) == "refuted at this scale"
    assert collapse.decide(0.5, 0.02, 0.15) == "inconclusive"
    assert collapse.dppo_stable(0, 48) == (pytest.approx(0.0740, abs=1e-4), True)
    assert not collapse.dppo_stable(4, 48)[1]  # upper bound 0.200


def test_design_a_is_new_seeds_lag_32_three_arms_seed_major():
    runs = collapse.planned_runs()
    assert len(runs) == 3 * 48 and COLLAPSE_SEEDS == tuple(range(200, 248))
    assert not set(COLLAPSE_SEEDS) & {0, 1, 2, 100, 101, *STALE_SEEDS}
    assert [r.seed for r in runs] == [s for s in COLLAPSE_SEEDS for _ in range(3)]
    assert [r.method for r in runs[:3]] == ["pg_is", "dppo_binary_tv", "cispo"]
    condition = CONDITIONS[COLLAPSE_CONDITION]
    stale32 = CONDITIONS["stale32"]
    assert condition.flags == stale32.flags and condition.flags["rollout_lag"] == 32
    assert condition.flags["steps"] == 300 and condition.flags["eval_samples"] == 4
    assert LOSSES["cispo"].ratio_cap == 10.0 and LOSSES["dppo_binary_tv"].ratio_cap == 10.0


# ---------------------------------------------------------------- the crossing bad-negative-update metric
def test_crossing_bad_negative_updates_count_only_this_updates_crossings():
    stats = MechanismStats()
    #     crossed  already out  rose back  A > 0   mu < 0.5  stays in  padding
    mu = torch.tensor([0.9, 0.9, 0.9, 0.9, 0.4, 0.9, 0.9])
    old = torch.tensor([0.8, 0.6, 0.6, 0.9, 0.3, 0.85, 0.8])
    new = torch.tensor([0.7, 0.5, 0.7, 0.6, 0.1, 0.80, 0.5])
    adv = torch.tensor([-1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0])
    valid = torch.tensor([True, True, True, True, True, True, False])
    stats.add_post_update(new.log(), old.log(), valid, mu, adv)
    record = stats.record()
    assert record["neg_high_tokens"] == 4
    assert record["bad_neg_cross_frac"] == pytest.approx(1 / 4)  # only the first crossed mu - 0.15 in this update
    assert record["bad_neg_frac"] == pytest.approx(2 / 4)  # the old definition also counts the one already out


# ---------------------------------------------------------------- the report on synthetic data files
def _write(data, method, seed, evals, cost=165.0):
    from experiments.sanity.sweep import BIN_COLUMNS, COLUMNS, data_file_rows

    meta = {"run": f"{COLLAPSE_CONDITION}/{method}/seed{seed}", "columns": [*COLUMNS, *BIN_COLUMNS], "hosts": []}
    meta["cost"] = {"cpu_s": cost, "wall_s": 2 * cost}
    path = data / COLLAPSE_CONDITION / method / f"seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = data_file_rows(_records(evals))
    path.write_text(json.dumps({"meta": meta}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_withholds_then_applies_the_rules_and_regenerates_byte_for_byte(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    fine, falls = [0.3] * 15, [0.4] * 5 + [0.05] * 10
    # PG-IS collapses on 16 of 48 seeds, cispo on 4, DPPO never
    for i, seed in enumerate(COLLAPSE_SEEDS):
        _write(data, "pg_is", seed, falls if i % 3 == 0 else fine)
        _write(data, "dppo_binary_tv", seed, fine)
        if seed != COLLAPSE_SEEDS[-1]:
            _write(data, "cispo", seed, falls if i % 12 == 0 else fine)
    collapse.report(data, out, tmp_path / "no-ladder")
    tables = (out / "tables.md").read_text()
    assert "143 of 144 runs finished; 47 of 48 seeds complete" in tables
    assert "withheld" in tables and "pg_is |" not in tables and not (out / "figure_collapse.png").exists()
    _write(data, "cispo", COLLAPSE_SEEDS[-1], fine)
    collapse.report(data, out, tmp_path / "no-ladder")
    tables = (out / "tables.md").read_text()
    assert "| pg_is | 16/48 |" in tables and "| dppo_binary_tv | 0/48 |" in tables and "| cispo | 4/48 |" in tables
    # 16/48 vs 0/48: Fisher p = C(48,16)/C(96,16) ~ 6e-6, excess 33 points
    assert "Primary: PG-IS vs DPPO Binary-TV — **confirmed**" in tables
    assert f"p = {fisher_greater(16, 48, 0, 48):.1e}" in tables
    assert "DPPO stable (95% Clopper-Pearson upper bound of its rate < 15%): yes (upper bound 7.4%)" in tables
    assert "144 runs: 6.60 CPU-hours in all" in tables
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"tables.md", "figure_collapse.png"}
    collapse.report(data, out, tmp_path / "no-ladder")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_a_declared_cut_shows_outcomes_on_whole_seed_blocks_only(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    for seed in COLLAPSE_SEEDS[:33]:
        for method in ("pg_is", "dppo_binary_tv", "cispo"):
            _write(data, method, seed, [0.3] * 15)
    _write(data, "pg_is", COLLAPSE_SEEDS[33], [0.3] * 15)  # an unfinished seed block is left out
    out.mkdir()
    (out / collapse.STOP_FILE).write_text("cut: compute\n")
    collapse.report(data, out, tmp_path / "no-ladder")
    tables = (out / "tables.md").read_text()
    # 0/33 vs 0/33: the Newcombe upper bound is Wilson's 3.84 / (33 + 3.84) = 10.4 points < 15
    assert "| pg_is | 0/33 |" in tables and "Binary-TV — **refuted at this scale**" in tables


def test_the_cli_report_only_reads_the_data_folder_and_trains_nothing(tmp_path, monkeypatch):
    from experiments.sanity import cli

    def no_training(*args, **kwargs):
        raise AssertionError("--report-only must not launch workers")

    monkeypatch.setattr(cli, "launch_workers", no_training)
    data, out = tmp_path / "data", tmp_path / "out"
    _write(data, "pg_is", 200, [0.3] * 15)
    argv = ["--experiment", "collapse", "--report-only", "--data", str(data), "--report-dir", str(out)]
    assert cli.main(argv) == 0
    assert "1 of 144 runs finished; 0 of 48 seeds complete" in (out / "tables.md").read_text()


def test_the_cli_skips_runs_whose_data_files_are_complete(tmp_path, monkeypatch):
    from experiments.sanity import cli

    launched = []
    monkeypatch.setattr(cli, "launch_workers", lambda runs, *a, **k: launched.extend(runs) or [])
    data = tmp_path / "data"
    _write(data, "pg_is", 200, [0.3] * 15)
    argv = ["--experiment", "collapse", "--seeds", "200", "201", "--data", str(data), "--report-dir", str(tmp_path)]
    assert cli.main([*argv, "--work", str(tmp_path / "work")]) == 0
    assert [(r.method, r.seed) for r in launched] == [
        ("dppo_binary_tv", 200),
        ("cispo", 200),
        ("pg_is", 201),
        ("dppo_binary_tv", 201),
        ("cispo", 201),
    ]

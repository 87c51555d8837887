"""The precision-dose pilot (experiments/sanity/precision/PREREGISTRATION.md): the plan, the measures and the dose
rule on hand-made records whose answer is known (its edges included), and the report on synthetic data files."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from experiments.sanity import precision
from experiments.sanity.conditions import (
    COLLAPSE_CONDITION,
    CONDITIONS,
    PRECISION_SEEDS,
    precision_condition,
    run_config,
)


def _records(mismatch, evals=None) -> list:
    """A 300-step run evaluated every 20 steps; ``mismatch(step)`` its pre-update mismatch (None: not recorded)."""
    evals = evals or [0.3] * 15
    records = [{"step": 0, "eval_acc": 0.1}]
    for step in range(1, 301):
        r = {"step": step, "trained_seqs": 4, "loss": 0.1, "grad_norm": 1.0}
        value = mismatch(step)
        if value is not None:
            r["pre_mismatch_mean"] = value
        if step % 20 == 0:
            r["eval_acc"] = evals[step // 20 - 1]
        records.append(r)
    return records


def test_the_pilot_is_new_seeds_two_doses_two_arms_seed_major_and_the_replications_setting_without_a_lag():
    runs = precision.planned_runs()
    assert len(runs) == 16 and PRECISION_SEEDS == (300, 301, 302, 303)
    committed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True).stdout.splitlines()
    elsewhere = [f for f in committed if not f.startswith(f"{precision.DATA}/")]  # no other experiment used them
    assert not any(f"seed{s}." in f or f"seed{s}/" in f for f in elsewhere for s in PRECISION_SEEDS)
    assert [(r.condition, r.method) for r in runs[:4]] == [
        ("quant_int4", "pg_is"),
        ("quant_int4", "dppo_binary_tv"),
        ("quant_int3", "pg_is"),
        ("quant_int3", "dppo_binary_tv"),
    ]
    assert [r.seed for r in runs] == [s for s in PRECISION_SEEDS for _ in range(4)]
    replication = dict(CONDITIONS[COLLAPSE_CONDITION].flags)
    for bits in (4, 3):
        flags = dict(CONDITIONS[precision_condition(bits)].flags)
        assert flags.pop("rollout_weight_bits") == bits and flags.pop("rollout_weight_group") == 128
        assert flags == {**replication, "rollout_lag": 0}
    config = run_config(runs[2], precision.Path("/tmp/w"), {})
    assert config.rollout_weight_bits == 3 and config.rollout_lag == 0 and config.loss == "pg_is"


def test_the_windows_the_growth_and_the_first_step():
    # early (1-60) 0.02, late (241-300) 0.06, step 1 recorded as 0.01, nothing recorded at steps 100-120
    records = _records(lambda s: 0.01 if s == 1 else None if 100 <= s <= 120 else 0.02 if s <= 240 else 0.06)
    m = precision.run_measures(records)
    assert m["first"] == 0.01
    assert m["early"] == pytest.approx((0.01 + 59 * 0.02) / 60)
    assert m["late"] == pytest.approx(0.06) and m["growth"] == pytest.approx(0.06 / m["early"])
    assert m["collapsed"] is False and m["peak"] == 0.3
    empty = precision.run_measures(_records(lambda s: None))
    assert math.isnan(empty["early"]) and math.isnan(empty["growth"]) and math.isnan(empty["first"])


def _measures(late, growth):
    return [{"late": x, "growth": g} for x, g in zip(late, growth)]


def test_the_dose_rule_needs_both_the_reach_and_the_growth_at_their_edges():
    # medians exactly at the rule's edges qualify
    assert precision.dose_rule(_measures([0.04, 0.05, 0.05, 0.09], [1.0, 1.5, 1.5, 3.0])) == (0.05, 1.5, True)
    reach, grows, ok = precision.dose_rule(_measures([0.04, 0.0499, 0.0499, 0.09], [2.0] * 4))
    assert not ok and reach == pytest.approx(0.0499)  # reaches too little
    assert not precision.dose_rule(_measures([0.1] * 4, [1.49] * 4))[2]  # saturates: no growth
    assert precision.dose_rule(_measures([math.nan, 0.1, 0.1], [math.nan, 2.0, 2.0]))[2]  # a run without data
    nothing = precision.dose_rule([])
    assert math.isnan(nothing[0]) and nothing[2] is False


def _write(data, bits, method, seed, mismatch, evals=None):
    from experiments.sanity.sweep import BIN_COLUMNS, COLUMNS, data_file_rows

    condition = precision_condition(bits)
    meta = {"run": f"{condition}/{method}/seed{seed}", "columns": [*COLUMNS, *BIN_COLUMNS], "hosts": []}
    meta["cost"] = {"cpu_s": 200.0, "wall_s": 400.0}
    path = data / condition / method / f"seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = data_file_rows(_records(mismatch, evals))
    path.write_text(json.dumps({"meta": meta}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_applies_the_rule_per_dose_and_regenerates_byte_for_byte(tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    falls = [0.4] * 5 + [0.05] * 10
    for seed in PRECISION_SEEDS:
        for method in ("pg_is", "dppo_binary_tv"):
            _write(data, 4, method, seed, lambda s: 0.01 + 0.0001 * s)  # grows 3.6x, reaches 0.039: short of 0.05
            collapsed = method == "pg_is" and seed != 303
            _write(data, 3, method, seed, lambda s: 0.02 + 0.0002 * s, falls if collapsed else None)  # 0.074, 3.6x
    precision.report(data, out)
    tables = (out / "tables.md").read_text()
    assert "16 of 16 runs finished." in tables
    int4, int3 = tables.split("### int4")[1].split("### int3")
    assert "**does not qualify**" in int4 and "median late mismatch 0.037 " in int4
    assert "**qualifies**" in int3 and "pg_is 3/4, dppo_binary_tv 0/4" in int3
    assert "| pg_is | 300 | 0.0202 | 0.0261 | 0.0741 | 2.84 | 40.0 | 5.0 | yes |" in int3
    assert "16 runs: 0.89 CPU-hours in all" in tables
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"tables.md", "figure_precision.png"}
    precision.report(data, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first


def test_the_cli_trains_the_pilots_missing_runs_in_order(tmp_path, monkeypatch):
    from experiments.sanity import cli

    launched = []
    monkeypatch.setattr(cli, "launch_workers", lambda runs, *a, **k: launched.extend(runs) or [])
    data = tmp_path / "data"
    _write(data, 4, "pg_is", 300, lambda s: 0.01)
    argv = ["--experiment", "precision", "--seeds", "300", "--data", str(data), "--report-dir", str(tmp_path)]
    assert cli.main([*argv, "--work", str(tmp_path / "work")]) == 0
    assert [(r.condition, r.method, r.seed) for r in launched] == [
        ("quant_int4", "dppo_binary_tv", 300),
        ("quant_int3", "pg_is", 300),
        ("quant_int3", "dppo_binary_tv", 300),
    ]
    assert "1 of 16 runs finished." in (tmp_path / "tables.md").read_text()

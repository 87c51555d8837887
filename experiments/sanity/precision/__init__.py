"""The precision-dose pilot (experiments/sanity/precision/PREREGISTRATION.md): plan, measures, rule, report.

``python -m experiments.sanity --experiment precision`` trains the pilot seed-major (a run whose data file is
complete is skipped, each finished run's data file is written at once); ``--report-only`` redraws this folder's
``tables.md`` and ``figure_precision.png`` from the data files alone.

The pilot asks whether fake-quantised rollout weights give a mismatch that **reaches** 0.05 and **grows** over
training (where a rollout lag saturates): per dose, the median over its runs of the pre-update ``|pi - mu|`` over
steps 241-300 must be >= 0.05, and the median of each run's late / early ratio (steps 241-300 over steps 1-60) >= 1.5.
Only a dose that passes both is a candidate for a pre-registered quantisation arm. Collapse counts (the replication's
endpoint) are reported descriptively, without a test.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..collapse import endpoint
from ..conditions import PRECISION_BITS, PRECISION_METHODS, PRECISION_SEEDS, Run, precision_condition

DATA = "experiments/sanity/precision/data"
REPORT_DIR = "experiments/sanity/precision"

STEPS = 300
EARLY = (1, 60)  # the early window of the pre-update mismatch (steps, inclusive)
LATE = (241, 300)  # the late window, the same span as the collapse endpoint's final score
REACH = 0.05  # the median late mismatch a dose must reach
GROWTH = 1.5  # the median late / early ratio it must reach
MISMATCH = "pre_mismatch_mean"  # |pi - mu| of the first mini-batch, before the step's update, for every loss


def planned_runs(seeds: list[int] | None = None) -> list[Run]:
    """Seed-major: for each seed, int4 then int3, each with PG-IS then DPPO Binary-TV."""
    return [
        Run(precision_condition(bits), method, seed)
        for seed in seeds or PRECISION_SEEDS
        for bits in PRECISION_BITS
        for method in PRECISION_METHODS
    ]


def window_mean(records: list[dict[str, Any]], key: str, window: tuple[int, int]) -> float:
    """The mean of ``key`` over the records of steps ``window[0]..window[1]`` that hold it (NaN when none does)."""
    values = [r[key] for r in records if window[0] <= r["step"] <= window[1] and r.get(key) is not None]
    return statistics.mean(values) if values else math.nan


def run_measures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's early and late mismatch, their ratio, its first step's mismatch and its collapse endpoint."""
    early, late = window_mean(records, MISMATCH, EARLY), window_mean(records, MISMATCH, LATE)
    first = next((r[MISMATCH] for r in records if r["step"] > 0 and r.get(MISMATCH) is not None), math.nan)
    return {
        "early": early,
        "late": late,
        "growth": late / early if early > 0 else math.nan,
        "first": first,
        **endpoint(records),
    }


def _median(runs: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` over the runs that measured it (NaN when none did)."""
    values = [r[key] for r in runs if not math.isnan(r[key])]
    return statistics.median(values) if values else math.nan


def dose_rule(measures: list[dict[str, Any]]) -> tuple[float, float, bool]:
    """``(median late mismatch, median growth, qualifies)`` of one dose's runs: it qualifies for a pre-registered
    quantisation arm when the median late mismatch is >= ``REACH`` and the median growth >= ``GROWTH``."""
    reach, grows = _median(measures, "late"), _median(measures, "growth")
    return reach, grows, reach >= REACH and grows >= GROWTH  # False when either is NaN (no run measured it)


Measures = dict[int, dict[str, dict[int, dict[str, Any]]]]  # bits -> method -> seed -> run_measures


def load_measures(data: Path) -> tuple[Measures, dict[str, Any], dict[int, dict[str, dict[int, list]]]]:
    """``(measures, metas by condition, records)`` of the complete data files of the pilot under ``data``."""
    from ..report import load_data
    from ..staleness import data_file_complete

    runs, metas = load_data(data) if data.is_dir() else ({}, {})
    measures: Measures = {}
    records: dict[int, dict[str, dict[int, list]]] = {}
    for bits in PRECISION_BITS:
        condition = precision_condition(bits)
        for method, seeds in runs.get(condition, {}).items():
            for seed, recs in seeds.items():
                if data_file_complete(data / condition / method / f"seed{seed}.jsonl", STEPS):
                    measures.setdefault(bits, {}).setdefault(method, {})[seed] = run_measures(recs)
                    records.setdefault(bits, {}).setdefault(method, {})[seed] = recs
    return measures, {c: m for c, m in metas.items() if c.startswith("quant_")}, records


def _f(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}g}"


def _pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{100 * value:.1f}"


def dose_lines(measures: Measures) -> list[str]:
    """Per dose: one row per run, then the dose's rule and collapse counts by arm."""
    lines = []
    for bits in PRECISION_BITS:
        by_method = measures.get(bits, {})
        runs = [by_method[m][s] for m in PRECISION_METHODS for s in sorted(by_method.get(m, {}))]
        lines += [
            f"### int{bits}",
            "",
            "| arm | seed | step-1 mismatch | early (1-60) | late (241-300) | late / early | peak % | final % | "
            "collapsed |",
            "|---|--:|--:|--:|--:|--:|--:|--:|---|",
        ]
        for method in PRECISION_METHODS:
            for seed, m in sorted(by_method.get(method, {}).items()):
                lines.append(
                    f"| {method} | {seed} | {_f(m['first'])} | {_f(m['early'])} | {_f(m['late'])} | "
                    f"{_f(m['growth'])} | {_pct(m['peak'])} | {_pct(m['final'])} | "
                    f"{'yes' + (' (non-finite)' if m['non_finite'] else '') if m['collapsed'] else 'no'} |"
                )
        reach, grows, ok = dose_rule(runs)
        counts = ", ".join(
            f"{m} {sum(r['collapsed'] for r in by_method.get(m, {}).values())}/{len(by_method.get(m, {}))}"
            for m in PRECISION_METHODS
        )
        lines += [
            "",
            f"Over {len(runs)} runs: median step-1 mismatch {_f(_median(runs, 'first'))}, median early mismatch "
            f"{_f(_median(runs, 'early'))}; median late mismatch {_f(reach)} (rule: >= {REACH:g}), median late / early "
            f"{_f(grows)} (rule: >= {GROWTH:g}): **{'qualifies' if ok else 'does not qualify'}** for a "
            f"pre-registered quantisation arm. Collapses (descriptive, no test): {counts}.",
            "",
        ]
    return lines


def figure(records: dict[int, dict[str, dict[int, list]]], path: Path) -> Path:
    """Per dose: the pre-update mismatch by step (top) and the held-out accuracy (bottom), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PRECISION_BITS), figsize=(10, 6.4), sharex=True, squeeze=False)
    colours = {"pg_is": "tab:red", "dppo_binary_tv": "tab:blue"}
    for col, bits in enumerate(PRECISION_BITS):
        for method, seeds in records.get(bits, {}).items():
            for i, (_seed, recs) in enumerate(sorted(seeds.items())):
                label = method if i == 0 else None
                steps = [r["step"] for r in recs if r["step"] > 0 and r.get(MISMATCH) is not None]
                values = [r[MISMATCH] for r in recs if r["step"] > 0 and r.get(MISMATCH) is not None]
                axes[0][col].plot(steps, values, color=colours.get(method), alpha=0.6, lw=0.8, label=label)
                evals = [(r["step"], 100 * r["eval_acc"]) for r in recs if r.get("eval_acc") is not None]
                axes[1][col].plot(*zip(*evals), color=colours.get(method), alpha=0.7, lw=1.0, label=label)
        axes[0][col].axhline(REACH, color="grey", ls="--", lw=0.8)
        axes[0][col].set_title(f"int{bits} rollout weights", fontsize=10)
        axes[0][col].set_ylabel("pre-update mean |π − μ|")
        axes[1][col].set_ylabel("held-out accuracy (%)")
        axes[1][col].set_xlabel("RL step")
        if records.get(bits):
            axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def report(data: Path, out: Path) -> list[Path]:
    """``tables.md`` and, once a run is complete, ``figure_precision.png``, from the data files alone."""
    from ..collapse import cost_lines
    from ..report import host_lines

    measures, metas, records = load_measures(data)
    finished = sum(len(s) for by_method in measures.values() for s in by_method.values())
    planned = len(planned_runs())
    parts = [
        "Generated by `python -m experiments.sanity --experiment precision --report-only` from the committed data "
        f"files (`{DATA}/`). Plan and rule: PREREGISTRATION.md (a non-confirmatory pilot).",
        "",
        "## Progress",
        "",
        f"{finished} of {planned} runs finished.",
        "",
        "## Mismatch and collapse by dose",
        "",
        "Mismatch: the pre-update mean |π − μ| (`pre_mismatch_mean`: the first mini-batch of each step, before the "
        "step's update). Peak and final: the collapse replication's endpoint (final = mean of the evaluations at "
        "steps 240-300; collapsed = final < half the peak and >= 5 points under it, or a non-finite step).",
        "",
        *dose_lines(measures),
        "## Compute",
        "",
        *cost_lines({f"{c}/{m}": seeds for c, methods in metas.items() for m, seeds in methods.items()}),
        "",
        "## Hosts",
        "",
        *host_lines(metas),
        "",
    ]
    written = [figure(records, out / "figure_precision.png")] if finished else []
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text("\n".join(parts))
    return [*written, out / "tables.md"]

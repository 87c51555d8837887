"""The earlier sweeps' report (bf16 / fp16 rollouts, docs/sanity.md "History"): unchanged, so that
``--report-only --data experiments/sanity/results/history/data --report-dir experiments/sanity/results/history``
redraws their published figures and table from the committed data.

Collapse (table column): a run collapses when its last held-out accuracy is below half its peak
held-out accuracy, or when it records a non-finite loss or gradient norm.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from .conditions import CONDITIONS, METHODS


def history_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Final and peak held-out accuracy, collapse, median |pi - mu| and step times of one run."""
    evals = [r["eval_acc"] for r in records if r.get("eval_acc") is not None]
    steps = [r for r in records if r["step"] > 0]
    non_finite = any(r.get(k, 0.0) is None for r in steps for k in ("loss", "grad_norm") if k in r)
    final, peak = (evals[-1], max(evals)) if evals else (math.nan, math.nan)

    def median(key: str, rows: list[dict[str, Any]] = steps) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else math.nan

    trained = [r for r in steps if r.get("trained_seqs", 0) > 0]  # steps whose groups all tied skip update and sync

    return {
        "final_acc": final,
        "peak_acc": peak,
        "collapsed": bool(non_finite or (evals and final < 0.5 * peak)),
        "mismatch_mean_median": median("mismatch_mean"),
        "mismatch_max_median": median("mismatch_max"),
        "mismatch_max_max": max(
            (r["mismatch_max"] for r in steps if r.get("mismatch_max") is not None), default=math.nan
        ),
        "rollout_s": median("rollout_s"),
        "update_s": median("update_s", trained),
        "sync_s": median("sync_s", trained),
        "steps": len(steps),
    }


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{values[0]:.3f}" if len(values) == 1 else f"{statistics.mean(values):.3f} ± {sd:.3f}"


def history_table(condition: str, runs: dict[str, dict[int, list[dict[str, Any]]]]) -> str:
    """Markdown table of one condition: one row per method, seeds aggregated."""
    lines = [
        f"**{condition}**: {CONDITIONS[condition].description if condition in CONDITIONS else ''}",
        "",
        "| method | seeds | steps | final acc | peak acc | collapsed | median mean \\|pi-mu\\| "
        "| median max \\|pi-mu\\| "
        "| largest \\|pi-mu\\| | s/step rollout / update / sync (median; update and sync over steps that trained) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method in [m for m in METHODS if m in runs] + sorted(set(runs) - set(METHODS)):
        per_seed = [history_summary(records) for _, records in sorted(runs[method].items())]
        med = lambda key, per_seed=per_seed: statistics.median([s[key] for s in per_seed])  # noqa: E731
        lines.append(
            f"| {method} | {len(per_seed)} | {min(s['steps'] for s in per_seed)} "
            f"| {_mean_sd([s['final_acc'] for s in per_seed])} | {_mean_sd([s['peak_acc'] for s in per_seed])} "
            f"| {sum(s['collapsed'] for s in per_seed)}/{len(per_seed)} "
            f"| {med('mismatch_mean_median'):.2e} | {med('mismatch_max_median'):.2e} "
            f"| {max(s['mismatch_max_max'] for s in per_seed):.2e} "
            f"| {med('rollout_s'):.3f} / {med('update_s'):.3f} / {med('sync_s'):.3f} |"
        )
    return "\n".join(lines) + "\n"


PANELS = (
    ("reward", "train reward", False),
    ("eval_acc", "held-out accuracy", False),
    ("mismatch_mean", "mean |pi - mu|", True),
    ("mismatch_max", "max |pi - mu|", True),
    ("entropy_mean", "entropy (nats)", False),
    ("masked_frac", "masked fraction", False),
)


SMOOTH = 5  # per-step curves: trailing mean over this many steps (held-out accuracy is drawn as measured)


def _smooth(values: list[float], key: str) -> list[float]:
    if key == "eval_acc":
        return values
    return [statistics.mean(values[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(values))]


def history_figure(condition: str, runs: dict[str, dict[int, list[dict[str, Any]]]], path: Path) -> Path:
    """The paper's layout: six panels vs step, a line per method (mean over seeds), a min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    colors = plt.get_cmap("tab10")
    methods = [m for m in METHODS if m in runs]
    for ax, (key, title, log_scale) in zip(axes.flat, PANELS):
        for i, method in enumerate(methods):
            series: dict[int, list[float]] = {}
            for records in runs[method].values():
                for r in records:
                    value = r.get(key)
                    if value is not None and (key == "eval_acc" or r["step"] > 0):
                        series.setdefault(r["step"], []).append(value)
            if not series:
                continue
            steps = sorted(series)
            mean = _smooth([statistics.mean(series[s]) for s in steps], key)
            lo = _smooth([min(series[s]) for s in steps], key)
            hi = _smooth([max(series[s]) for s in steps], key)
            style = "--" if method in ("pg_is", "cispo", "minirl", "minirl_tis") else "-"
            ax.plot(
                steps,
                mean,
                style,
                color=colors(i),
                label=method,
                lw=1.4,
                marker="o" if key == "eval_acc" else None,
                ms=3,
            )
            ax.fill_between(steps, lo, hi, color=colors(i), alpha=0.08, lw=0)
        ax.set_title(title)
        ax.set_xlabel("step")
        if log_scale:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    seeds = sorted({seed for m in runs.values() for seed in m})
    desc = CONDITIONS[condition].description if condition in CONDITIONS else condition
    fig.suptitle(
        f"Sanity test, {desc}\n(seeds {seeds}; line = mean over seeds, band = min-max; per-step curves "
        f"smoothed over {SMOOTH} steps)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def history_audit(runs_by_condition: dict[str, dict[str, dict[int, list[dict[str, Any]]]]]) -> list[str]:
    """Why the earlier sweeps could not separate the methods (docs/sanity.md, "History"), from their data."""
    lines = []

    def steps(condition: str, method: str | None = None) -> list[dict[str, Any]]:
        runs = runs_by_condition.get(condition, {})
        return [
            r
            for m, seeds in runs.items()
            if method in (None, m)
            for records in seeds.values()
            for r in records
            if r["step"] > 0
        ]

    if "learn_bf16" in runs_by_condition:
        rows = steps("learn_bf16")
        lines.append(
            f"- learn_bf16: {sum((r.get('mismatch_max') or 0.0) > 0.15 for r in rows)} of {len(rows)} steps "
            "had a token with |pi - mu| > 0.15 (DPPO Binary-TV's threshold) before the step's update"
        )
    for condition in ("learn_bf16", "learn_fp32"):
        rows = [r for r in steps(condition, "dppo_binary_tv") if "masked_frac" in r]
        if rows:
            masked = 100 * statistics.mean(r["masked_frac"] for r in rows)
            lines.append(
                f"- {condition}: DPPO Binary-TV masked {masked:.2f}% of its tokens (mean over steps and seeds)"
            )
    for condition in runs_by_condition:
        rows = [r for r in steps(condition) if r.get("grad_norm") is not None]
        if rows:
            lines.append(
                f"- {condition}: the mean pre-clipping gradient norm of a step exceeded the clipping norm "
                f"1.0 on {100 * sum(r['grad_norm'] > 1.0 for r in rows) / len(rows):.1f}% of its steps"
            )
    for condition in ("bf16_lr3e-4", "fp32_lr3e-4"):
        rows = steps(condition)
        if rows:
            idle = 100 * sum(r.get("trained_seqs", 0) == 0 for r in rows) / len(rows)
            lines.append(
                f"- {condition}: median {statistics.median(r.get('trained_seqs', 0) for r in rows):g} of 128 "
                f"sequences per step carried a non-zero advantage; {idle:.1f}% of the steps trained nothing"
            )
    runs = runs_by_condition.get("bf16_lr3e-4", {})
    if runs:
        finals = {
            m: {
                s: [r for r in records if r.get("eval_acc") is not None][-1]["eval_acc"] for s, records in seeds.items()
            }
            for m, seeds in runs.items()
        }
        text = ", ".join(
            f"{m} {100 * statistics.mean(v for s, v in f.items() if s != 0):.1f}%"
            for m, f in finals.items()
            if len(f) > 1
        )
        if text:
            lines.append(
                "- bf16_lr3e-4 without seed 0 (the exploration's seed, on which lr 3e-4 was chosen): final "
                f"held-out accuracy, mean of seeds 1-2: {text}"
            )
    return lines


def history_report(
    runs_by_condition: dict[str, dict[str, dict[int, list[dict[str, Any]]]]], data: Path, out: Path
) -> list[Path]:
    """Write ``figure_<condition>.png`` and ``table.md`` for every earlier-sweep condition."""
    written, tables = [], []
    for condition, runs in runs_by_condition.items():
        written.append(history_figure(condition, runs, out / f"figure_{condition}.png"))
        tables.append(history_table(condition, runs))
    (out / "table.md").write_text(
        "Generated by `python -m experiments.sanity --report-only` from the JSONL files under "
        f"`{data.name}/`. Collapsed: last held-out accuracy < half its peak, or a non-finite loss.\n\n"
        + "\n".join(tables)
        + '\n**Audit** (docs/sanity.md, "History")\n\n'
        + "\n".join(history_audit(runs_by_condition))
        + "\n"
    )
    written.append(out / "table.md")
    return written

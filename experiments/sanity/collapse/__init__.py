"""The collapse replication (experiments/sanity/collapse/PREREGISTRATION.md): plan, endpoint, rules, report.

``python -m experiments.sanity --experiment collapse`` trains design A seed-major (each seed's three arms before
the next seed; a run whose data file is complete is skipped, each finished run's data file is written at once),
``--report-only`` redraws this folder's ``tables.md`` and ``figure_collapse.png`` from the data files alone.

A run **collapsed** when its final score (the mean of its evaluations at steps 240-300) is below half its peak
(its largest evaluation, step 0 included) and at least 5 points below it, or when a step that trained recorded a
non-finite loss or gradient norm. The comparisons and the decision rule are ``primary`` and ``secondary``.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..conditions import COLLAPSE_CONDITION, COLLAPSE_METHODS, COLLAPSE_SEEDS, Run
from ..counts import (
    clopper_pearson,
    fisher_greater,
    fisher_power,
    holm,
    kaplan_meier,
    logrank,
    mcnemar_greater,
    newcombe,
    signed_rank,
)

DATA = "experiments/sanity/collapse/data"
REPORT_DIR = "experiments/sanity/collapse"
STOP_FILE = "STOP.md"  # the lead's declared cut (PREREGISTRATION.md, "Cut rule"): outcomes are shown from then on

STEPS = 300
FINAL_FROM = 240  # final = the mean of the evaluations at steps 240, 260, 280, 300
HALF = Fraction(1, 2)
MIN_DROP = Fraction(5, 100)  # and at least 5 points below the peak
ALPHA = 0.025  # one-sided
EXCESS = 0.15  # the smallest excess of collapse rate that counts: 15 percentage points
STABLE = 0.15  # "DPPO stable": the Clopper-Pearson upper bound of its collapse rate below 15%
MIN_SEEDS = 32  # the cut rule's floor: no verdict on fewer complete seeds
PRIMARY, REFERENCE, SECONDARY = "pg_is", "dppo_binary_tv", "cispo"
ACC_FLOOR = 1 / 800  # one sample of an evaluation (200 problems x k = 4): log(final/peak) of a score of 0


def _exact(value: float) -> Fraction:
    """The decimal a collected score reads as (a fraction of 800 samples is a terminating decimal): ties exact."""
    return Fraction(repr(value))


def endpoint(records: list[dict[str, Any]], check_loss: bool = True) -> dict[str, Any]:
    """A run's primary endpoint from its collected records (step 0: the start evaluation).

    ``check_loss``: the data file collects ``loss`` (files written before it did only have ``grad_norm``); a
    non-finite value is collected as null, so a step that trained (``trained_seqs > 0``) without it is non-finite.
    Returns final, peak (floats), collapsed, non_finite, ``time`` (the step of the collapse: the first non-finite
    step, else the first evaluation below half the peak so far and 5 points under it; else the last step) and
    ``ratio`` = log(final / peak) with scores floored at one sample."""
    evals = [(r["step"], _exact(r["eval_acc"])) for r in records if r.get("eval_acc") is not None]
    trained = [r for r in records if r["step"] > 0 and r.get("trained_seqs", 0) > 0]
    keys = ("loss", "grad_norm") if check_loss else ("grad_norm",)
    bad_steps = [r["step"] for r in trained if any(r.get(k) is None for k in keys)]
    last = max((r["step"] for r in records), default=0)
    window = [acc for step, acc in evals if FINAL_FROM <= step <= STEPS]
    if not evals or not window:
        raise ValueError(
            f"records must hold evaluations at steps {FINAL_FROM}-{STEPS}, got steps {[s for s, _ in evals]}"
        )
    final = sum(window) / len(window)
    peak = max(acc for _, acc in evals)
    dropped = final < HALF * peak and peak - final >= MIN_DROP
    collapsed = bool(bad_steps) or dropped
    time = float(last)
    if bad_steps:
        time = float(bad_steps[0])
    elif collapsed:
        running = Fraction(0)
        for step, acc in evals:
            running = max(running, acc)
            if acc < HALF * running and running - acc >= MIN_DROP:
                time = float(step)
                break
    floor = lambda v: max(float(v), ACC_FLOOR)  # noqa: E731
    return {
        "final": float(final),
        "peak": float(peak),
        "collapsed": collapsed,
        "non_finite": bool(bad_steps),
        "time": time,
        "ratio": math.log(floor(final) / floor(peak)),
    }


def planned_runs(seeds: list[int] | None = None) -> list[Run]:
    """Design A seed-major: every arm of a seed before the next seed."""
    return [Run(COLLAPSE_CONDITION, m, s) for s in seeds or COLLAPSE_SEEDS for m in COLLAPSE_METHODS]


# ---------------------------------------------------------------------------- the rules
def decide(p: float, excess: float, upper: float) -> str:
    """The decision rule of a comparison: confirmed (p <= 0.025 and an excess of >= 15 points of collapse rate),
    refuted at this scale (the 95% interval's upper bound < 15 points), otherwise inconclusive."""
    if p <= ALPHA and excess >= EXCESS - 1e-12:
        return "confirmed"
    if upper < EXCESS:
        return "refuted at this scale"
    return "inconclusive"


Endpoints = dict[str, dict[int, dict[str, Any]]]  # method -> seed -> endpoint


def complete_seeds(endpoints: Endpoints) -> list[int]:
    """The seeds every arm finished (the analysis uses whole seed blocks only)."""
    sets = [set(endpoints.get(m, {})) for m in COLLAPSE_METHODS]
    return sorted(set.intersection(*sets))


def compare(endpoints: Endpoints, method: str, seeds: list[int]) -> dict[str, Any]:
    """``method`` against DPPO Binary-TV on ``seeds``: counts, one-sided Fisher p, Newcombe interval of the
    difference of rates, exact McNemar on the pairs, the paired Wilcoxon on log(final/peak), the log-rank test."""
    a, b = endpoints[method], endpoints[REFERENCE]
    n = len(seeds)
    x1, x2 = sum(a[s]["collapsed"] for s in seeds), sum(b[s]["collapsed"] for s in seeds)
    diff, lo, hi = newcombe(x1, n, x2, n)
    only_a = sum(a[s]["collapsed"] and not b[s]["collapsed"] for s in seeds)
    only_b = sum(b[s]["collapsed"] and not a[s]["collapsed"] for s in seeds)
    w, used, p_w = signed_rank([b[s]["ratio"] - a[s]["ratio"] for s in seeds], "greater")
    o1, e1, _, chi2, p_lr = logrank(
        [a[s]["time"] for s in seeds],
        [a[s]["collapsed"] for s in seeds],
        [b[s]["time"] for s in seeds],
        [b[s]["collapsed"] for s in seeds],
    )
    return {
        "method": method,
        "n": n,
        "x": x1,
        "x_ref": x2,
        "fisher_p": fisher_greater(x1, n, x2, n),
        "diff": diff,
        "lo": lo,
        "hi": hi,
        "only_method": only_a,
        "only_ref": only_b,
        "mcnemar_p": mcnemar_greater(only_a, only_b),
        "wilcoxon_w": w,
        "wilcoxon_n": used,
        "wilcoxon_p": p_w,
        "logrank_observed": o1,
        "logrank_expected": e1,
        "logrank_chi2": chi2,
        "logrank_p": p_lr,
    }


def primary(endpoints: Endpoints, seeds: list[int]) -> tuple[str, dict[str, Any]]:
    """The primary comparison (PG-IS vs DPPO Binary-TV) and its verdict."""
    c = compare(endpoints, PRIMARY, seeds)
    return decide(c["fisher_p"], c["diff"], c["hi"]), c


def secondary(endpoints: Endpoints, seeds: list[int]) -> list[tuple[str, float, float, str]]:
    """The secondary family under Holm (familywise one-sided 0.025): ``[(name, p, Holm-adjusted p, verdict)]``;
    the CISPO-vs-DPPO comparison's verdict is the decision rule on its Holm-adjusted p, the others' "significant"
    or "not significant"."""
    cispo, pg = compare(endpoints, SECONDARY, seeds), compare(endpoints, PRIMARY, seeds)
    tests = [
        ("cispo-10 vs DPPO: collapse rate (Fisher)", cispo["fisher_p"]),
        ("PG-IS vs DPPO: log(final/peak) (Wilcoxon)", pg["wilcoxon_p"]),
        ("cispo-10 vs DPPO: log(final/peak) (Wilcoxon)", cispo["wilcoxon_p"]),
        ("PG-IS vs DPPO: time to collapse (log-rank)", pg["logrank_p"]),
        ("cispo-10 vs DPPO: time to collapse (log-rank)", cispo["logrank_p"]),
    ]
    adjusted = holm([p for _, p in tests])
    out = []
    for i, ((name, p), adj) in enumerate(zip(tests, adjusted)):
        verdict = (
            decide(adj, cispo["diff"], cispo["hi"])
            if i == 0
            else ("significant" if adj <= ALPHA else "not significant")
        )
        out.append((name, p, adj, verdict))
    return out


def dppo_stable(x: int, n: int) -> tuple[float, bool]:
    """``(the 95% Clopper-Pearson upper bound of DPPO's collapse rate, whether it is below 15%)``."""
    upper = clopper_pearson(x, n)[1]
    return upper, upper < STABLE


# ---------------------------------------------------------------------------- report
def load_endpoints(data: Path) -> tuple[Endpoints, dict[str, dict[int, dict[str, Any]]], dict[str, Any]]:
    """``(endpoints, metas, records)`` of the complete data files of design A under ``data``."""
    from ..report import load_data
    from ..staleness import data_file_complete

    runs, metas = load_data(data) if data.is_dir() else ({}, {})
    endpoints: Endpoints = {}
    records: dict[str, dict[int, Any]] = {}
    for method, seeds in runs.get(COLLAPSE_CONDITION, {}).items():
        for seed, recs in seeds.items():
            path = data / COLLAPSE_CONDITION / method / f"seed{seed}.jsonl"
            if data_file_complete(path, STEPS):
                columns = metas[COLLAPSE_CONDITION][method][seed].get("columns", [])
                endpoints.setdefault(method, {})[seed] = endpoint(recs, check_loss="loss" in columns)
                records.setdefault(method, {})[seed] = recs
    return endpoints, metas.get(COLLAPSE_CONDITION, {}), records


def _pct(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


def _p(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.4f}" if value >= 1e-4 else f"{value:.1e}"


def _mechanism(records: dict[str, dict[int, Any]], method: str, seeds: list[int], key: str) -> float:
    """The median over ``seeds`` of each run's mean of ``key`` over its trained steps."""
    means = []
    for s in seeds:
        values = [r[key] for r in records[method][s] if r["step"] > 0 and r.get(key) is not None]
        if values:
            means.append(statistics.mean(values))
    return statistics.median(means) if means else math.nan


def outcome_lines(endpoints: Endpoints, records: dict[str, dict[int, Any]], seeds: list[int]) -> list[str]:
    """Per arm: collapses, rate with its Clopper-Pearson interval, the median final / peak, the mechanism metrics;
    then the primary comparison, its verdict and the secondary family."""
    n = len(seeds)
    lines = [
        "| method | collapsed | rate (%) [95% Clopper-Pearson] | non-finite | median final / peak (%) | "
        "bad negative updates, crossing (%) | bad negative updates, old definition (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in COLLAPSE_METHODS:
        e = endpoints[method]
        x = sum(e[s]["collapsed"] for s in seeds)
        lo, hi = clopper_pearson(x, n)
        lines.append(
            f"| {method} | {x}/{n} | {_pct(x / n)} [{_pct(lo)}, {_pct(hi)}] | {sum(e[s]['non_finite'] for s in seeds)} "
            f"| {_pct(statistics.median(e[s]['final'] / e[s]['peak'] if e[s]['peak'] else 1.0 for s in seeds))} "
            f"| {_pct(_mechanism(records, method, seeds, 'bad_neg_cross_frac'), 2)} "
            f"| {_pct(_mechanism(records, method, seeds, 'bad_neg_frac'), 2)} |"
        )
    name, c = primary(endpoints, seeds)
    upper, stable = dppo_stable(c["x_ref"], n)
    lines += [
        "",
        f"## Primary: PG-IS vs DPPO Binary-TV — **{name}**",
        "",
        f"- collapses {c['x']}/{n} vs {c['x_ref']}/{n}: excess {_pct(c['diff'])} points of collapse rate, Newcombe "
        f"95% interval [{_pct(c['lo'])}, {_pct(c['hi'])}]",
        f"- one-sided Fisher exact p = {_p(c['fisher_p'])} (α = {ALPHA}); confirmed needs p <= {ALPHA} and an excess "
        f">= {100 * EXCESS:.0f} points, refuted at this scale an upper bound < {100 * EXCESS:.0f} points",
        f"- sensitivity, exact McNemar on the {n} paired seeds: PG-IS alone collapsed on {c['only_method']}, DPPO "
        f"alone on {c['only_ref']}; one-sided p = {_p(c['mcnemar_p'])}",
        f"- DPPO stable (95% Clopper-Pearson upper bound of its rate < {100 * STABLE:.0f}%): "
        f"{'yes' if stable else 'no'} (upper bound {_pct(upper)}%)",
        "",
        "## Secondary (Holm, familywise one-sided α = 0.025)",
        "",
        "| comparison | p | Holm-adjusted p | verdict |",
        "|---|---|---|---|",
    ]
    for test, p, adj, verdict in secondary(endpoints, seeds):
        lines.append(f"| {test} | {_p(p)} | {_p(adj)} | {verdict} |")
    cispo = compare(endpoints, SECONDARY, seeds)
    lines += [
        "",
        f"cispo-10 vs DPPO: collapses {cispo['x']}/{n} vs {cispo['x_ref']}/{n}, excess {_pct(cispo['diff'])} points "
        f"[{_pct(cispo['lo'])}, {_pct(cispo['hi'])}]; McNemar one-sided p = {_p(cispo['mcnemar_p'])} "
        f"({cispo['only_method']} vs {cispo['only_ref']} discordant seeds).",
        "",
    ]
    for c in (compare(endpoints, PRIMARY, seeds), cispo):
        lines.append(
            f"{c['method']} vs DPPO: Wilcoxon W+ = {c['wilcoxon_w']:g} over {c['wilcoxon_n']} non-zero pairs "
            f"(DPPO's log(final/peak) minus {c['method']}'s); log-rank: {c['logrank_observed']:.0f} collapses "
            f"observed, {c['logrank_expected']:.2f} expected, χ² = {c['logrank_chi2']:.2f}."
        )
    return lines


def survival_figure(endpoints: Endpoints, seeds: list[int], path: Path) -> Path:
    """Kaplan-Meier curves of the share of runs not yet collapsed, one per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for method in COLLAPSE_METHODS:
        e = endpoints[method]
        curve = kaplan_meier([e[s]["time"] for s in seeds], [e[s]["collapsed"] for s in seeds])
        xs, ys = [0.0], [1.0]
        for t, surv in curve:
            xs += [t, t]
            ys += [ys[-1], surv]
        xs.append(float(STEPS))
        ys.append(ys[-1])
        ax.plot(xs, [100 * y for y in ys], label=f"{method} ({sum(e[s]['collapsed'] for s in seeds)}/{len(seeds)})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("runs not collapsed (%)")
    ax.set_xlim(0, STEPS)
    ax.set_ylim(0, 102)
    ax.set_title(f"Kaplan-Meier, lag {COLLAPSE_CONDITION.removeprefix('collapse')}, {len(seeds)} seeds", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def ladder_lines(staleness_data: Path) -> list[str]:
    """The controls and the exploratory counts from the staleness ladder's committed data, by this endpoint and by
    the ladder's own rule (final < half the peak, final the mean of the last four evaluations)."""
    from ..report import load_data

    if not staleness_data.is_dir():
        return [f"No staleness data at `{staleness_data}`."]
    runs, metas = load_data(staleness_data)
    lines = [
        "| condition | method | collapsed (this endpoint) | collapsed (the ladder's rule) |",
        "|---|---|---|---|",
    ]
    totals: dict[str, list[int]] = {}
    by_seed: dict[int, list[int]] = {}
    ties = []
    for condition in ("stale0", "stale16", "stale32", "stale64", "steplr3e-4"):
        for method, seeds in runs.get(condition, {}).items():
            ends = [
                endpoint(r, check_loss="loss" in metas[condition][method][s].get("columns", []))
                for s, r in seeds.items()
            ]
            old = [_ladder_rule(r) for r in seeds.values()]
            ties += [
                f"{condition}/{method}/seed{s}"
                for s, e in zip(seeds, ends)
                if _exact(e["final"]) == HALF * _exact(e["peak"])
            ]
            if condition not in ("stale0", "steplr3e-4"):
                for s, e, o in zip(seeds, ends, old):
                    counts = by_seed.setdefault(s, [0, 0])
                    counts[0] += e["collapsed"]
                    counts[1] += o
            lines.append(
                f"| {condition} | {method} | {sum(e['collapsed'] for e in ends)}/{len(ends)} | {sum(old)}/{len(old)} |"
            )
            if condition.startswith("stale") and condition != "stale0":
                t = totals.setdefault(method, [0, 0, 0])
                t[0] += sum(e["collapsed"] for e in ends)
                t[1] += sum(old)
                t[2] += len(ends)
    lines += [
        "",
        "Lagged runs (lags 16, 32, 64) together: "
        + "; ".join(f"{m} {t[0]}/{t[2]} ({t[1]}/{t[2]} by the ladder's rule)" for m, t in totals.items())
        + ".",
        "By seed (every lagged run of the seed): "
        + ", ".join(f"seed {s}: {c[0]} ({c[1]})" for s, c in sorted(by_seed.items()))
        + ".",
        "Runs whose final is exactly half their peak (not a collapse by either rule): "
        + (", ".join(ties) or "none")
        + ".",
    ]
    pg, dppo = totals.get(PRIMARY), totals.get(REFERENCE)
    if pg and dppo:
        p = fisher_greater(pg[1], pg[2], dppo[1], dppo[2])
        lines.append(
            f"Exploratory (chosen after the data), PG-IS vs DPPO over the lagged runs by the ladder's rule: "
            f"{pg[1]}/{pg[2]} vs {dppo[1]}/{dppo[2]}, one-sided Fisher p = {_p(p)}."
        )
    return lines


def _ladder_rule(records: list[dict[str, Any]]) -> bool:
    """The staleness ladder's post-hoc count: a non-finite gradient norm, or final < half the peak (no 5-point
    floor), final the mean of the last four evaluations."""
    from ..staleness import run_summary

    return run_summary(records)["collapsed"]


POWER_RATES = ((0.20, 0.04), (0.25, 0.04), (0.30, 0.04), (0.33, 0.0))  # (PG-IS, DPPO) true collapse rates
POWER_SEEDS = (32, 40, 48)


def power_lines() -> list[str]:
    """The pre-registered power table: the exact power of the one-sided Fisher test at 0.025 (and of "confirmed",
    which also needs an observed excess >= 15 points) for seeds x true rates."""
    head = " | ".join(f"{100 * a:.0f}% vs {100 * b:.0f}%" for a, b in POWER_RATES)
    lines = [f"| seeds | {head} |", "|---|" + "---|" * len(POWER_RATES)]
    for n in POWER_SEEDS:
        cells = [
            f"{fisher_power(n, a, b, ALPHA):.2f} / {fisher_power(n, a, b, ALPHA, min_excess=EXCESS):.2f}"
            for a, b in POWER_RATES
        ]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def cost_lines(metas: dict[str, dict[int, dict[str, Any]]]) -> list[str]:
    """The measured compute of the finished runs (each worker's CPU and wall seconds, warm starts included)."""
    costs = [m["cost"] for seeds in metas.values() for m in seeds.values() if m.get("cost")]
    if not costs:
        return ["No finished run yet."]
    cpu = [c["cpu_s"] for c in costs]
    return [
        f"{len(costs)} runs: {sum(cpu) / 3600:.2f} CPU-hours in all, median {statistics.median(cpu):.0f} CPU-s a run "
        f"(range {min(cpu):.0f}-{max(cpu):.0f}; one torch thread each, niceness 19 on a shared machine), median "
        f"wall {statistics.median(c['wall_s'] for c in costs):.0f} s."
    ]


def report(data: Path, out: Path, staleness_data: Path) -> list[Path]:
    """``tables.md`` (and, once outcomes are shown, ``figure_collapse.png``) from the data files alone.

    Outcomes by arm are withheld until every planned seed is complete or the lead's cut is declared in
    ``<out>/STOP.md`` (PREREGISTRATION.md, "Cut rule"); progress and compute are always shown."""
    from ..report import host_lines

    endpoints, metas, records = load_endpoints(data)
    seeds = complete_seeds(endpoints)
    finished = sum(len(v) for v in endpoints.values())
    stopped = (out / STOP_FILE).is_file()
    show = len(seeds) == len(COLLAPSE_SEEDS) or (stopped and len(seeds) >= MIN_SEEDS)
    parts = [
        "Generated by `python -m experiments.sanity --experiment collapse --report-only` from the committed data "
        f"files (`{DATA}/`, the ladder's controls from its own data). Rules: PREREGISTRATION.md.",
        "",
        "## Progress",
        "",
        f"{finished} of {len(COLLAPSE_SEEDS) * len(COLLAPSE_METHODS)} runs finished; {len(seeds)} of "
        f"{len(COLLAPSE_SEEDS)} seeds complete in all three arms.",
        "",
    ]
    written = []
    if show:
        parts += ["## Outcomes", "", *outcome_lines(endpoints, records, seeds), ""]
        written.append(survival_figure(endpoints, seeds, out / "figure_collapse.png"))
    elif stopped:
        parts += [f"Stopped with {len(seeds)} complete seeds, fewer than the {MIN_SEEDS} needed: no verdict.", ""]
    else:
        parts += [
            "Outcomes by arm are withheld until all seeds are complete or a cut is declared (PREREGISTRATION.md).",
            "",
        ]
    parts += [
        "## Power (pre-registered)",
        "",
        "Exact power of the one-sided Fisher test at α = 0.025 / of a verdict of confirmed (p <= 0.025 and an "
        "observed excess >= 15 points), true collapse rates PG-IS vs DPPO:",
        "",
        *power_lines(),
        "",
        "## Controls and exploratory counts from the staleness ladder",
        "",
        *ladder_lines(staleness_data),
        "",
        "## Compute",
        "",
        *cost_lines(metas),
        "",
        "## Hosts",
        "",
        *host_lines({COLLAPSE_CONDITION: metas}),
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text("\n".join(parts))
    return [*written, out / "tables.md"]

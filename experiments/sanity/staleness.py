"""The staleness experiment (experiments/sanity/results/staleness/PREREGISTRATION.md): plan, endpoints, rules, report.

``python -m experiments.sanity --experiment staleness --phases A`` trains the runs of phase A
(resumable: a run whose committed data file is complete is skipped, an interrupted one starts over),
``--pilot`` the pilot, ``--eval-noise`` measures the pilot's evaluation noise, ``--report-only``
redraws ``experiments/sanity/results/staleness/`` (figures, ``tables.md``) from the committed files alone.

The endpoints and rules here are the pre-registration's: a run's **final score** is the mean of its
last ``FINAL_EVALS`` evaluations; per seed, D(m, L) = F(m, L) − F(DPPO Binary-TV, L) and the
interaction I_m(L) = D(m, L) − D(m, 0); ``verdict`` applies rule 2.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .conditions import (
    ARMS,
    PILOT_EVAL_SAMPLES,
    PILOT_SEED,
    RARE_TOKEN_METHODS,
    STALE_LAGS,
    STALE_SEEDS,
    STEP_SIZES,
    Run,
)
from .stats import T80, T975, _median

logger = logging.getLogger("experiments.sanity")

DATA = "experiments/sanity/results/staleness/data"
PILOT_DATA = "experiments/sanity/results/staleness/pilot/data"
REPORT_DIR = "experiments/sanity/results/staleness"
EVAL_NOISE = "experiments/sanity/results/staleness/pilot/eval_noise.json"
RARE_TOKEN_MU = "experiments/sanity/results/staleness/pilot/rare_token_mu.json"

FINAL_EVALS = 4  # steps 240, 260, 280, 300
SESOI = 0.04  # the smallest effect of interest: 4 points of held-out accuracy
EVAL_NOISE_SEEDS = 8
EVAL_NOISE_TARGET = 0.01  # one evaluation's noise must be <= 1 point
REFERENCE = "dppo_binary_tv"
NEGATIVE_CONTROL = "pg_pi_old"
RULED = ("pg_is", "minirl", "cispo_clip")  # methods whose interaction gets rule 2 (PG-IS primary)
# Student t quantile t_{0.95, df}, df = 1..12 (the TOST's one-sided 5% tests: a 90% two-sided interval)
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782)

# Phases in the order they run (PREREGISTRATION.md, "Budget"): (conditions, methods); seed-major within a phase.
PHASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "A": (("stale0", "stale64"), ("pg_is", "dppo_binary_tv", "pg_pi_old")),
    "B": (("stale0", "stale64"), ("minirl", "cispo_clip")),
    "C": (("stale16", "stale32"), ("pg_is", "dppo_binary_tv", "pg_pi_old", "minirl", "cispo_clip")),
    "D": (tuple(STEP_SIZES), ("pg_is", "dppo_binary_tv")),
    "E": (("rare_token",), RARE_TOKEN_METHODS),
}


def planned_runs(phases: list[str], seeds: list[int] | None = None) -> list[Run]:
    """The runs of ``phases`` in order, each phase seed-major (a seed's block before the next seed's)."""
    runs = []
    for phase in phases:
        conditions, methods = PHASES[phase]
        for seed in seeds or STALE_SEEDS:
            runs += [Run(c, m, seed) for c in conditions for m in methods]
    return runs


def pilot_runs() -> list[Run]:
    return [Run(c, "dppo_binary_tv", PILOT_SEED) for c in ARMS["pilot"]]


def data_file_complete(path: Path, steps: int) -> bool:
    """True when the collected data file ``path`` exists and its last record is step ``steps``."""
    if not path.is_file():
        return False
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if len(lines) < 2:
        return False
    meta = json.loads(lines[0])["meta"]
    return dict(zip(meta["columns"], json.loads(lines[-1]))).get("step") == steps


# ---------------------------------------------------------------------------- one run
def run_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's endpoints and mechanism numbers from its collected records (step 0: the start evaluation)."""
    evals = [(r["step"], r["eval_acc"]) for r in records if r.get("eval_acc") is not None]
    steps = [r for r in records if r["step"] > 0]
    later = [acc for step, acc in evals if step > 0]
    last = max((r["step"] for r in steps), default=0)
    # a non-finite gradient norm is collected as null (dropped from the record) on a step that trained
    non_finite = any(r.get("trained_seqs", 0) > 0 and r.get("grad_norm") is None for r in steps)
    start = evals[0][1] if evals and evals[0][0] == 0 else math.nan
    final = statistics.mean(later[-FINAL_EVALS:]) if len(later) >= FINAL_EVALS else math.nan
    peak = max(acc for _, acc in evals) if evals else math.nan

    def window(key: str, lo: int, hi: int) -> float:
        values = [r[key] for r in steps if lo <= r["step"] <= hi and r.get(key) is not None]
        return statistics.mean(values) if values else math.nan

    return {
        "steps": last,
        "start": start,
        "final": final,
        "peak": peak,
        "gain": final - start,
        "collapsed": bool(non_finite or (later and final < 0.5 * peak)),
        "pre_mismatch_first": window("pre_mismatch_mean", 1, 50),
        "pre_mismatch_last": window("pre_mismatch_mean", last - 49, last),
        "pre_mismatch": window("pre_mismatch_mean", 1, last),
        "masked_first": window("masked_frac_first", 1, last),
        "masked_later": window("masked_frac_later", 1, last),
        "bad_neg": window("bad_neg_frac", 1, last),
        "entropy_last": window("entropy_mean", last - 49, last),
        "step_s": _median([(r.get("rollout_s") or 0.0) + (r.get("update_s") or 0.0) for r in steps]),
    }


# ---------------------------------------------------------------------------- intervals and rules
@dataclass(frozen=True)
class Estimate:
    """Mean, 95% and 90% t half-widths of ``n`` per-seed values, and their sd."""

    mean: float
    half95: float
    half90: float
    sd: float
    n: int

    def text(self, scale: float = 100.0, signed: bool = True) -> str:
        if self.n == 0:
            return "n/a"
        mean = f"{scale * self.mean:+.1f}" if signed else f"{scale * self.mean:.1f}"
        return mean if self.n < 2 else f"{mean} ± {scale * self.half95:.1f}"


def estimate(values: list[float]) -> Estimate:
    values = [v for v in values if not math.isnan(v)]
    n = len(values)
    if n == 0:
        return Estimate(math.nan, math.nan, math.nan, math.nan, 0)
    if n == 1:
        return Estimate(values[0], math.nan, math.nan, math.nan, 1)
    sd = statistics.stdev(values)
    df = min(n - 1, len(T975)) - 1
    return Estimate(statistics.mean(values), T975[df] * sd / math.sqrt(n), T95[df] * sd / math.sqrt(n), sd, n)


def detectable(sd: float, n: int) -> float:
    """The paired effect a two-sided 5% t-test on ``n`` seeds detects with 80% power, for per-seed sd ``sd``."""
    if n < 2 or math.isnan(sd):
        return math.nan
    df = min(n - 1, len(T975)) - 1
    return (T975[df] + T80[df]) * sd / math.sqrt(n)


Summaries = dict[str, dict[str, dict[int, dict[str, Any]]]]  # condition -> method -> seed -> run_summary


def differences(summaries: Summaries, condition: str, method: str) -> dict[int, float]:
    """``{seed: F(method) - F(DPPO Binary-TV)}`` at ``condition``, over the seeds both finished."""
    a, b = summaries.get(condition, {}).get(method, {}), summaries.get(condition, {}).get(REFERENCE, {})
    return {s: a[s]["final"] - b[s]["final"] for s in sorted(set(a) & set(b))}


def interactions(summaries: Summaries, method: str, control: str = "stale0") -> dict[int, dict[int, float]]:
    """``{lag: {seed: I_method(lag)}}`` for the lags above 0 that have data, over seeds complete at both doses."""
    base = differences(summaries, control, method)
    out = {}
    for lag in STALE_LAGS[1:]:
        at = differences(summaries, f"stale{lag}", method)
        seeds = sorted(set(base) & set(at))
        if seeds:
            out[lag] = {s: at[s] - base[s] for s in seeds}
    return out


def slope(per_lag: dict[int, dict[int, float]], seeds: list[int]) -> dict[int, float]:
    """Per seed, the least-squares slope of I over the lags (I(0) = 0), in points per step of lag."""
    lags = [0, *sorted(per_lag)]
    mean_lag = statistics.mean(lags)
    denom = sum((x - mean_lag) ** 2 for x in lags)
    out = {}
    for s in seeds:
        ys = [0.0, *(per_lag[lag][s] for lag in sorted(per_lag))]
        mean_y = statistics.mean(ys)
        out[s] = sum((x - mean_lag) * (y - mean_y) for x, y in zip(lags, ys)) / denom
    return out


def verdict(
    per_lag: dict[int, dict[int, float]], control: dict[int, dict[int, float]], seeds_needed: int = len(STALE_SEEDS)
) -> tuple[str, list[str]]:
    """Rule 2 of the pre-registration for one method's interactions ``per_lag`` ({lag: {seed: I}}) and the
    negative control's ``control`` (same layout). Returns ``(verdict, the clauses it rests on)``."""
    top = max(STALE_LAGS)
    complete = sorted(set.intersection(*(set(v) for v in per_lag.values()))) if per_lag else []
    if top not in per_lag or len(complete) < seeds_needed:
        return "incomplete", [
            f"{len(complete)} complete seeds of {seeds_needed} needed (lags with data: {sorted(per_lag) or 'none'})"
        ]
    doses = sorted(per_lag)
    all_doses = doses == list(STALE_LAGS[1:])
    est = {lag: estimate([per_lag[lag][s] for s in complete]) for lag in doses}
    at_top = est[top]
    lines = [f"I({lag}) = {est[lag].text()} points (90% half-width {100 * est[lag].half90:.1f})" for lag in doses]
    below = at_top.mean + at_top.half95 < 0 and at_top.mean <= -SESOI
    above = at_top.mean - at_top.half95 > 0 and at_top.mean >= SESOI
    if all_doses:
        trend = estimate(list(slope({lag: per_lag[lag] for lag in doses}, complete).values()))
        monotone = trend.mean + trend.half95 < 0 and min(doses, key=lambda lag: est[lag].mean) == top
        lines.append(f"trend: {100 * trend.mean:+.3f} ± {100 * trend.half95:.3f} points per step of lag")
    else:
        monotone = False
        lines.append("dose-response untested (only lag 0 and the top dose ran)")
    equivalent = all(abs(est[lag].mean) + est[lag].half90 < SESOI for lag in doses)
    neg = estimate(list(control.get(top, {}).values())) if control.get(top) else estimate([])
    degrades = neg.n >= seeds_needed and neg.mean + neg.half95 < 0 and neg.mean <= -SESOI
    lines.append(f"negative control N({top}) = {neg.text()} points over {neg.n} seeds")
    if below and monotone:
        return "confirmed", lines
    if below and not all_doses:
        return "confirmed at lag 64, dose-response untested", lines
    if equivalent and degrades:
        return ("refuted at this scale" if all_doses else "refuted at lag 64 only"), lines
    if above:
        return "reversed", lines
    failed = []
    if not below:
        failed.append(f"I({top})'s 95% interval does not lie below 0 with a mean <= -{100 * SESOI:.0f}")
    elif not monotone:
        failed.append("not monotone in the dose")
    if not equivalent:
        failed.append(f"the 90% intervals are not all inside ±{100 * SESOI:.0f}")
    if not degrades:
        failed.append("the negative control does not degrade by the effect size")
    return "inconclusive", [*lines, "failed: " + "; ".join(failed)]


def step_size_verdict(summaries: Summaries, seeds_needed: int = len(STALE_SEEDS)) -> tuple[str, list[str]]:
    """Part 4 of the pre-registration: J(lr) = D(pg_is, lr) - D(pg_is, lr 1e-4) per seed (lr 1e-4: ``stale0``), and
    the dose check F(pg_is, 3e-4) - F(pg_is, 1e-4). Returns ``(verdict, the clauses it rests on)``."""
    base = differences(summaries, "stale0", "pg_is")
    js, names = {}, list(STEP_SIZES)
    for name in names:
        at = differences(summaries, name, "pg_is")
        js[name] = {s: at[s] - base[s] for s in sorted(set(at) & set(base))}
    complete = sorted(set.intersection(*(set(v) for v in js.values()))) if all(js.values()) else []
    if len(complete) < seeds_needed:
        return "incomplete", [f"{len(complete)} complete seeds of {seeds_needed} needed"]
    est = {name: estimate([js[name][s] for s in complete]) for name in names}
    top = names[-1]
    a, b = summaries[top]["pg_is"], summaries["stale0"]["pg_is"]
    bite = estimate([a[s]["final"] - b[s]["final"] for s in complete])
    lines = [
        f"J({name}) = {est[name].text()} points (90% half-width {100 * est[name].half90:.1f}; detectable with 80% "
        f"power: {_pct(detectable(est[name].sd, est[name].n))})"
        for name in names
    ]
    lines.append(f"PG-IS at {top} − PG-IS at lr 1e-4: {bite.text()} points")
    if est[top].mean + est[top].half95 < 0 and est[top].mean <= -SESOI and est[top].mean <= est[names[0]].mean:
        return "confirmed", lines
    if (
        all(abs(e.mean) + e.half90 < SESOI for e in est.values())
        and bite.mean + bite.half95 < 0
        and (bite.mean <= -SESOI)
    ):
        return "refuted at this scale", lines
    if est[top].mean - est[top].half95 > 0 and est[top].mean >= SESOI:
        return "reversed", lines
    return "inconclusive", lines


RARE_STEP = 50  # part 3's primary endpoint: the held-out rate of the good token at step 50
RARE_SESOI = 0.10
RARE_HALF = 0.5
RARE_BINDS = 0.10  # "ratio clipping binds on the token": >= 10% of the A > 0, mu < 0.01 token-updates masked


def rare_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Part 3's endpoints of one rare-token run: the rate at ``RARE_STEP``, the first evaluated step with a rate
    >= 50% (None if never), and the masked share of positive-advantage token-updates with mu < 0.01 up to
    ``RARE_STEP`` (the bins' counts summed per evaluation window)."""
    evals = {r["step"]: r["eval_acc"] for r in records if r.get("eval_acc") is not None}
    masked = tokens = 0
    for r in records:
        if 0 < r["step"] <= RARE_STEP and r.get("tokens_by_mu_pos") is not None:
            masked += sum(r["masked_by_mu_pos"][:2])
            tokens += sum(r["tokens_by_mu_pos"][:2])
    half = next((step for step, rate in sorted(evals.items()) if rate >= RARE_HALF), None)
    return {
        "r50": evals.get(RARE_STEP, math.nan),
        "steps_to_half": half,
        "clip_share": masked / tokens if tokens else math.nan,
    }


def rare_token_verdict(
    runs: dict[str, dict[int, list[dict[str, Any]]]], seeds_needed: int = len(STALE_SEEDS)
) -> tuple[str, list[str]]:
    """Part 3's rule on the rare-token runs ``{method: {seed: records}}``: R50(GRPO-clip-higher) − R50(DPPO
    Binary-TV) per seed, and whether ratio clipping binds on the token."""
    clip, dppo = runs.get("grpo_clip_higher", {}), runs.get(REFERENCE, {})
    seeds = sorted(set(clip) & set(dppo))
    if len(seeds) < seeds_needed:
        return "incomplete", [f"{len(seeds)} complete seeds of {seeds_needed} needed"]
    a = {s: rare_summary(clip[s]) for s in seeds}
    b = {s: rare_summary(dppo[s]) for s in seeds}
    diff = estimate([a[s]["r50"] - b[s]["r50"] for s in seeds])
    binds = _median([a[s]["clip_share"] for s in seeds])
    lines = [
        f"R{RARE_STEP}(grpo_clip_higher) − R{RARE_STEP}(dppo_binary_tv) = {diff.text()} points (90% half-width "
        f"{100 * diff.half90:.1f}; detectable with 80% power: {_pct(detectable(diff.sd, diff.n))})",
        f"grpo_clip_higher masks {_pct(binds)}% of the A > 0, mu < 0.01 token-updates over steps 1-{RARE_STEP}",
    ]
    if diff.mean + diff.half95 < 0 and diff.mean <= -RARE_SESOI:
        return "confirmed", lines
    if abs(diff.mean) + diff.half90 < RARE_SESOI and binds >= RARE_BINDS:
        return "refuted at this scale", lines
    if diff.mean - diff.half95 > 0 and diff.mean >= RARE_SESOI:
        return "reversed", lines
    return "inconclusive", lines


# ---------------------------------------------------------------------------- evaluation noise
def measure_eval_noise(runs: list[Run], work: Path, out: Path, seeds: int = EVAL_NOISE_SEEDS) -> Path:
    """Evaluate each finished pilot run's final weights ``seeds`` times (different sampling seeds, k =
    ``PILOT_EVAL_SAMPLES``); write ``{run: {"k", "accuracies", "sd"}}`` to ``out`` (JSON)."""
    import torch
    from transformers import AutoTokenizer

    from dppo_ext.trainer.checkpoint import find_resume_checkpoint
    from dppo_ext.trainer.engine import make_rollout_engine
    from dppo_ext.trainer.task import build_task

    from .conditions import run_config

    result: dict[str, Any] = {}
    engine = None
    torch.set_num_threads(1)
    for run in runs:
        config = run_config(run, work, {})
        model = Path(find_resume_checkpoint(config.out)) / "model"
        if engine is None:
            engine = make_rollout_engine(config, str(model), torch.device("cpu"))
        else:
            from transformers import AutoModelForCausalLM

            engine.sync_weights(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32))
        tokenizer = AutoTokenizer.from_pretrained(model)
        task = build_task(config)
        prompts = [tokenizer(p.prompt)["input_ids"] for p in task.eval]
        accuracies = []
        for r in range(seeds):
            groups = engine.generate(
                prompts,
                n=config.eval_samples,
                temperature=config.eval_temperature,
                max_tokens=config.max_new_tokens,
                seed=1_000 + r,
            )
            rewards = [
                task.reward(tokenizer.decode(s.response_ids, skip_special_tokens=True), p.answer)
                for p, group in zip(task.eval, groups)
                for s in group
            ]
            accuracies.append(sum(rewards) / len(rewards))
        result[run.name] = {
            "k": config.eval_samples,
            "problems": len(task.eval),
            "accuracies": accuracies,
            "sd": statistics.stdev(accuracies),
        }
        logger.info(
            "%s: evaluation sd %.4f over %d seeds (k = %d)",
            run.name,
            result[run.name]["sd"],
            seeds,
            config.eval_samples,
        )
    if engine is not None:
        engine.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def measure_rare_token_mu(seeds: list[int], work: Path, out: Path) -> Path:
    """Build the rare-token arm's warm start of each seed and write the good token's probability under it to
    ``out`` (``{seed: rare_token.good_token_mu}``; seeds already in ``out`` are kept)."""
    from .conditions import run_config
    from .rare_token import good_token_mu
    from .sweep import ensure_base_model

    result = json.loads(out.read_text()) if out.is_file() else {}
    for seed in seeds:
        config = run_config(Run("rare_token", REFERENCE, seed), work, {})
        result[str(seed)] = good_token_mu(ensure_base_model(config, work), config)
        logger.info("seed %d: the good token's median probability %.2e", seed, result[str(seed)]["median"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return out


def chosen_eval_samples(noise: dict[str, Any]) -> tuple[int | None, float]:
    """The pre-registered k: the smallest of 4, 8, 16 whose one-evaluation sd (the largest pilot run's, scaled by
    sqrt(k0 / k)) is <= ``EVAL_NOISE_TARGET``; ``(k or None, the sd at k0)``."""
    if not noise:
        return None, math.nan
    sd = max(v["sd"] for v in noise.values())
    k0 = next(iter(noise.values()))["k"]
    for k in (4, 8, 16):
        if sd * math.sqrt(k0 / k) <= EVAL_NOISE_TARGET:
            return k, sd
    return None, sd


# ---------------------------------------------------------------------------- report
def _summaries(data: Path) -> tuple[dict[str, Any], Summaries, dict[str, Any]]:
    from .report import load_data

    runs, metas = load_data(data) if data.is_dir() else ({}, {})
    summaries = {
        c: {m: {s: run_summary(r) for s, r in seeds.items()} for m, seeds in ms.items()} for c, ms in runs.items()
    }
    return runs, summaries, metas


def _pct(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{100 * value:.{digits}f}"


MECHANISM = ("pre_mismatch_first", "pre_mismatch_last", "masked_first", "bad_neg", "entropy_last")


def outcome_table(summaries: Summaries, conditions: list[str]) -> list[str]:
    lines = [
        "| condition | method | seeds | start | final | gain | final − DPPO Binary-TV (paired) | collapsed | "
        "pre-update \\|π−μ\\| steps 1-50 / last 50 | masked 1st mini-batch (%) | bad negative updates (%) "
        "| entropy, last 50 steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for condition in conditions:
        for method, per_seed in summaries.get(condition, {}).items():
            vals = list(per_seed.values())
            med = {k: _median([v[k] for v in vals if not math.isnan(v[k])]) for k in MECHANISM}
            diff = differences(summaries, condition, method)
            start, final = (estimate([v[k] for v in vals]).text(signed=False) for k in ("start", "final"))
            lines.append(
                f"| {condition} | {method} | {len(vals)} | {start} | {final} "
                f"| {estimate([v['gain'] for v in vals]).text()} "
                f"| {estimate(list(diff.values())).text() if method != REFERENCE else '–'} "
                f"| {sum(v['collapsed'] for v in vals)}/{len(vals)} "
                f"| {med['pre_mismatch_first']:.2g} / {med['pre_mismatch_last']:.2g} | {_pct(med['masked_first'])} "
                f"| {_pct(med['bad_neg'], 2)} | {med['entropy_last']:.3f} |"
            )
    return lines


def pilot_section(pilot: Summaries, noise: dict[str, Any]) -> list[str]:
    lines = ["## Pilot (seed 100, DPPO Binary-TV, 300 steps, k = 4)", ""]
    if not pilot:
        return [*lines, "No pilot data yet.", ""]
    lines += outcome_table(pilot, list(ARMS["pilot"])) + [
        "",
        "The pilot ran before amendment 1: its lag-64 evaluations scored the engine's weights, those of 64 steps "
        "earlier; the evaluation-noise check below scores the final (current) weights.",
        "",
    ]
    top = pilot.get("pilot_stale64", {}).get(REFERENCE, {}).get(PILOT_SEED)
    if top is not None:
        ok = not top["collapsed"] and top["gain"] >= SESOI
        lines.append(
            f"Top dose (lag 64) and DPPO itself: gain {_pct(top['gain'])} points, collapsed: {top['collapsed']} → "
            f"the pre-registered check ({'passes' if ok else 'FAILS'}: no collapse and a gain >= "
            f"{100 * SESOI:.0f} points)."
        )
    steps = [v["step_s"] for ms in pilot.values() for seeds in ms.values() for v in seeds.values()]
    if steps:
        lines.append(
            f"Median wall time of a step (rollout + update, one torch thread each, machine shared with "
            f"other work): {', '.join(f'{s:.2f}' for s in steps)} s."
        )
    if noise:
        k, sd = chosen_eval_samples(noise)
        for name, v in noise.items():
            lines.append(
                f"Evaluation noise, {name}: {len(v['accuracies'])} evaluations of the final weights "
                f"(200 problems x {v['k']}): accuracy {', '.join(_pct(a) for a in v['accuracies'])}; "
                f"sd {_pct(v['sd'], 2)} points."
            )
        lines.append(
            f"The rule (one evaluation's sd <= {100 * EVAL_NOISE_TARGET:.0f} point, the smallest k of 4, 8, "
            f"16, sd scaling as 1/√k) gives **k = {k}** (largest measured sd {_pct(sd, 2)} points at k = "
            f"{PILOT_EVAL_SAMPLES})."
        )
    return [*lines, ""]


def verdict_section(summaries: Summaries, runs: dict[str, Any]) -> list[str]:
    control = interactions(summaries, NEGATIVE_CONTROL)
    lines = [
        "## Interactions and verdicts (rule 2)",
        "",
        "I(L) = [method − DPPO Binary-TV]_L − [method − DPPO Binary-TV]_0 per seed, points; mean ± 95% "
        "t half-width; *detectable*: the effect a two-sided 5% t-test detects with 80% power on these seeds, "
        "from the observed spread of I(L).",
        "",
        "| method | lag | seeds | I(L) | 90% interval | detectable (80%) |",
        "|---|---|---|---|---|---|",
    ]
    for method in (*RULED, NEGATIVE_CONTROL):
        for lag, per_seed in interactions(summaries, method).items():
            e = estimate(list(per_seed.values()))
            ninety = f"[{100 * (e.mean - e.half90):+.1f}, {100 * (e.mean + e.half90):+.1f}]" if e.n > 1 else "n/a"
            lines.append(f"| {method} | {lag} | {e.n} | {e.text()} | {ninety} | {_pct(detectable(e.sd, e.n))} |")
    lines.append("")
    for method in RULED:
        name, why = verdict(interactions(summaries, method), control)
        lines += [f"**{method}**: {name}", "", *(f"- {w}" for w in why), ""]
    name, why = step_size_verdict(summaries)
    lines += ["**Trust region vs step size (part 4)**: " + name, "", *(f"- {w}" for w in why), ""]
    name, why = rare_token_verdict(runs.get("rare_token", {}))
    lines += ["**The rare good token (part 3)**: " + name, "", *(f"- {w}" for w in why), ""]
    return lines


def rare_token_mu_lines(path: Path = Path(RARE_TOKEN_MU)) -> list[str]:
    """The warm starts' probability of the good token (part 3's check before its runs), when measured."""
    if not path.is_file():
        return []
    lines = ["## The rare good token: its probability under the warm start (part 3's check)", ""]
    for seed, mu in json.loads(path.read_text()).items():
        lines.append(
            f"- seed {seed}: median {mu['median']:.2e} over the held-out prompts (range {mu['min']:.2e}-"
            f"{mu['max']:.2e}); pre-registered range 1e-3-5e-3: "
            f"{'inside' if 1e-3 <= mu['median'] <= 5e-3 else 'OUTSIDE'}"
        )
    return [*lines, ""]


def cost_lines(metas: dict[str, Any]) -> list[str]:
    """The measured compute of the runs whose data files record it (the worker's CPU and wall seconds)."""
    costs = [m["cost"] for ms in metas.values() for seeds in ms.values() for m in seeds.values() if m.get("cost")]
    if not costs:
        return ["No finished run records its cost yet (the pilot's, measured from /proc, is in STATUS.md)."]
    cpu = [c["cpu_s"] for c in costs]
    return [
        f"{len(costs)} runs record their cost: {sum(cpu):.0f} CPU-s in all, median {statistics.median(cpu):.0f} "
        f"CPU-s a run (range {min(cpu):.0f}-{max(cpu):.0f}; one torch thread, niceness 19 on a shared machine), "
        f"median wall {statistics.median(c['wall_s'] for c in costs):.0f} s."
    ]


def dose_response(summaries: Summaries) -> dict[str, list[tuple[int, float, float, int]]]:
    """Per ruled method and the negative control, ``[(lag, mean, 95% half-width, seeds)]`` of I(L) in points,
    lag 0 first (0 by definition); methods with no lag above 0 are left out."""
    curves = {}
    for method in (*RULED, NEGATIVE_CONTROL):
        per_lag = interactions(summaries, method)
        if per_lag:
            n = min(len(v) for v in per_lag.values())
            curves[method] = [(0, 0.0, 0.0, n)]
            for lag, per_seed in per_lag.items():
                e = estimate(list(per_seed.values()))
                curves[method].append((lag, 100 * e.mean, 100 * e.half95, e.n))
    return curves


def report(data: Path, pilot_data: Path, noise_path: Path, out: Path) -> list[Path]:
    """``tables.md`` and the figures of the staleness experiment from the committed files alone."""
    from .figures import arm_figure, dose_response_figure
    from .report import host_lines

    runs, summaries, metas = _summaries(data)
    pilot_runs_, pilot, pilot_metas = _summaries(pilot_data)
    noise = json.loads(noise_path.read_text()) if noise_path.is_file() else {}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for arm, source in (("pilot", pilot_runs_), ("staleness", runs), ("step_size", runs)):
        present = [c for c in ARMS[arm] if c in source]
        if present:
            written.append(arm_figure(arm, {c: source[c] for c in present}, out / f"figure_{arm}.png"))
    curves = dose_response(summaries)
    if curves:
        written.append(
            dose_response_figure(
                curves,
                100 * SESOI,
                out / "figure_dose_response.png",
                title="I(L) = [method − DPPO Binary-TV] at lag L − the same at lag 0, per seed: below 0, the method "
                "loses more to DPPO under staleness; grey, the smallest effect of interest",
                dashed=(NEGATIVE_CONTROL,),
            )
        )
    parts = [
        "Generated by `python -m experiments.sanity --experiment staleness --report-only` from the committed files "
        f"(`{data.name}/`, `pilot/`). Points of held-out accuracy; final = mean of the last {FINAL_EVALS} "
        "evaluations; ± = 95% t half-width over the seeds; mechanism columns: each run's mean, median over seeds. "
        "Rules: PREREGISTRATION.md.",
        "",
        *pilot_section(pilot, noise),
        "## Runs",
        "",
        *outcome_table(summaries, [c for c in (*ARMS["staleness"], *STEP_SIZES) if c in summaries]),
        "",
        *verdict_section(summaries, runs),
        *rare_token_mu_lines(),
        "## Compute",
        "",
        *cost_lines(metas),
        "",
        "## Hosts",
        "",
        *host_lines({**pilot_metas, **metas}),
        "",
    ]
    (out / "tables.md").write_text("\n".join(parts))
    written.append(out / "tables.md")
    return written

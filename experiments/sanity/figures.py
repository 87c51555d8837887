"""One figure per arm of the dosed-mismatch experiment: a column per condition, a row per metric,
a line per seed (thin) and the seeds' mean (bold) per method; and the staleness ladder's dose-response
(each method's interaction with DPPO against the lag, with its interval)."""

from __future__ import annotations

import math
import statistics
import textwrap
from pathlib import Path
from typing import Any, Callable

from .conditions import BASELINES, CONDITIONS, METHODS

Records = list[dict[str, Any]]
SMOOTH = 10  # per-step curves: trailing mean over this many steps (held-out accuracy is drawn as measured)


def _bin_share(numerator: str, index: int) -> Callable[[dict[str, Any]], float | None]:
    """Per evaluation window: ``numerator``'s count in bin ``index`` over the window's tokens in that bin
    (``masked_by_mu``), or over all its tokens (``tokens_by_mu``)."""

    def value(r: dict[str, Any]) -> float | None:
        if r.get("tokens_by_mu_pos") is None:
            return None
        tokens = [a + b for a, b in zip(r["tokens_by_mu_pos"], r["tokens_by_mu_neg"])]
        if numerator == "masked":
            masked = r["masked_by_mu_pos"][index] + r["masked_by_mu_neg"][index]
            return masked / tokens[index] if tokens[index] else None
        return tokens[index] / sum(tokens) if sum(tokens) else None

    return value


def _key(name: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda r: r.get(name)


# (value of a record, panel title, log scale, smoothed)
PANELS: dict[str, list[tuple[Callable[[dict[str, Any]], float | None], str, bool, bool]]] = {
    "default": [
        (_key("eval_acc"), "held-out accuracy", False, False),
        (_key("mismatch_mean"), "pre-update mean |π − μ| (first mini-batch)", True, True),
        (_key("masked_frac_first"), "masked fraction, first mini-batch", False, True),
        (_key("masked_frac_later"), "masked fraction, later mini-batches", False, True),
        (_key("bad_update_frac"), "bad updates (fraction of tokens)", False, True),
    ],
    "tail": [
        (_key("eval_acc"), "held-out accuracy", False, False),
        (_key("mismatch_mean"), "pre-update mean |π − μ| (first mini-batch)", True, True),
        (_bin_share("masked", 0), "masked fraction of μ < 1e-3 tokens (per 20 steps)", False, False),
        (_bin_share("tokens", 0), "share of trained tokens with μ < 1e-3 (per 20 steps)", False, False),
        (_key("masked_frac_first"), "masked fraction, first mini-batch", False, True),
    ],
    "staleness": [
        (_key("eval_acc"), "held-out accuracy", False, False),
        (_key("pre_mismatch_mean"), "pre-update mean |π − μ| (first mini-batch, against μ)", True, True),
        (_key("masked_frac_first"), "masked fraction, first mini-batch", False, True),
        (_key("bad_neg_frac"), "bad negative updates (A < 0, μ > 0.5, π_new < μ − 0.15)", False, True),
        (_key("entropy_mean"), "entropy (nats)", False, True),
    ],
    "calibration": [
        (_key("eval_acc"), "held-out accuracy", False, False),
        (_key("reward"), "training reward", False, True),
        (_key("grad_norm"), "gradient norm before clipping (mean over updates)", True, True),
        (_key("entropy_mean"), "entropy (nats)", False, True),
    ],
}


def _series(records: Records, value: Callable[[dict[str, Any]], float | None], smooth: bool) -> tuple[list, list]:
    points = [(r["step"], value(r)) for r in records if (r["step"] > 0 or value is not None)]
    points = [(s, v) for s, v in points if v is not None]
    steps, values = [s for s, _ in points], [v for _, v in points]
    if smooth:
        values = [statistics.mean(values[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(values))]
    return steps, values


def arm_figure(arm: str, conditions: dict[str, dict[str, dict[int, Records]]], path: Path) -> Path:
    """Draw ``arm``'s figure into ``path``: ``conditions`` is ``{condition: {method: {seed: records}}}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = PANELS.get("staleness" if arm in ("pilot", "step_size") else arm, PANELS["default"])
    names = list(conditions)
    size = (max(4.0 * len(names) + 1.2, 9.0), 2.4 * len(panels) + 0.6)
    fig, axes = plt.subplots(len(panels), len(names), figsize=size, squeeze=False, sharex=True)
    colors = plt.get_cmap("tab10")
    present = {m for runs in conditions.values() for m in runs}
    methods = [m for m in METHODS if m in present] + sorted(present - set(METHODS))
    for col, condition in enumerate(names):
        for row, (value, title, log_scale, smooth) in enumerate(panels):
            ax = axes[row][col]
            for i, method in enumerate(methods):
                seeds = conditions[condition].get(method, {})
                curves = [_series(records, value, smooth) for _, records in sorted(seeds.items())]
                style = "--" if method in BASELINES else "-"
                for steps, values in curves:
                    ax.plot(steps, values, style, color=colors(i), lw=0.6, alpha=0.45)
                common = set.intersection(*(set(s) for s, _ in curves)) if curves else set()
                if common:
                    steps = sorted(common)
                    mean = [statistics.mean(dict(zip(s, v))[t] for s, v in curves) for t in steps]
                    ax.plot(
                        steps,
                        mean,
                        style,
                        color=colors(i),
                        lw=1.6,
                        label=method,
                        marker="o" if not smooth else None,
                        ms=2.5,
                    )
            if log_scale:
                ax.set_yscale("log")
            if row == 0:
                desc = CONDITIONS[condition].description if condition in CONDITIONS else condition
                ax.set_title(f"{condition}\n" + textwrap.fill(desc, 48), fontsize=7)
            if col == 0:
                ax.set_ylabel(textwrap.fill(title, 30), fontsize=8)
            if row == len(panels) - 1:
                ax.set_xlabel("step")
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    seeds = sorted({s for runs in conditions.values() for m in runs.values() for s in m})
    fig.suptitle(
        f"arm '{arm}': thin lines = seeds {seeds}, bold = their mean (dashed: no trust region on mu);\n"
        f"per-step curves are trailing means over {SMOOTH} steps",
        fontsize=9,
        y=0.995,
    )
    top = 1 - 0.9 / fig.get_figheight()
    fig.legend(
        handles,
        labels,
        loc="upper center",
        ncol=min(len(labels), 6),
        fontsize=8,
        bbox_to_anchor=(0.5, top + 0.35 / fig.get_figheight()),
    )
    fig.tight_layout(rect=(0, 0, 1, top))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return path


def dose_response_figure(
    curves: dict[str, list[tuple[int, float, float, int]]],
    effect: float,
    path: Path,
    *,
    title: str,
    dashed: tuple[str, ...] = (),
) -> Path:
    """The interaction against the dose: ``curves`` is ``{method: [(lag, mean, 95% half-width, seeds), ...]}``
    in points (lag 0 is the reference, 0 by definition); a band marks ``± effect``, the smallest effect of
    interest; the methods in ``dashed`` (a negative control) are drawn dashed. A label carries the seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    colors = plt.get_cmap("tab10")
    ax.axhspan(-effect, effect, color="0.85", alpha=0.6, lw=0, label=f"± {effect:g} points")
    ax.axhline(0.0, color="0.4", lw=0.8)
    order = [m for m in METHODS if m in curves] + sorted(set(curves) - set(METHODS))
    width = 1.5 * (len(order) - 1) / 2
    for i, method in enumerate(order):
        points = sorted(curves[method])
        shift = 1.5 * i - width  # side by side at each dose
        lags = [lag + shift for lag, *_ in points]
        ax.errorbar(
            lags,
            [mean for _, mean, _, _ in points],
            yerr=[0.0 if math.isnan(half) else half for _, _, half, _ in points],
            color=colors(i),
            marker="o",
            ms=4,
            capsize=3,
            lw=1.2,
            linestyle="--" if method in dashed else "-",
            label=f"{method} ({_seed_range([n for *_, n in points[1:]])} seeds)",
        )
    ax.set_xticks(sorted({lag for pts in curves.values() for lag, *_ in pts}))
    ax.set_xlabel("rollout lag L (steps)")
    ax.set_ylabel("I(L), points (mean ± 95% t interval)")
    ax.set_title(textwrap.fill(title, 70), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _seed_range(counts: list[int]) -> str:
    return str(counts[0]) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"

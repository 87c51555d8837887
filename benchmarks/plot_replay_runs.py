"""Training runs under truncated sampling, with and without sampling replay, side by side.

    python benchmarks/plot_replay_runs.py --run replay=runs/replay_on/metrics.jsonl \
        --run "no replay=runs/replay_off/metrics.jsonl" --out benchmarks/results/replay/training.png

Reads each run's ``metrics.jsonl`` (the reference trainer's per-step records) and plots, per step, the held-out
accuracy, the loss's masked fraction and the first mini-batch's |pi - mu| (``mismatch_mean``, log scale), one line
per run; prints each run's first and last held-out accuracy and its mean masked fraction and mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if key in r]
    return [s for s, _ in pairs], [v for _, v in pairs]


PANELS = (("eval_acc", "held-out accuracy"), ("masked_frac", "masked fraction"), ("mismatch_mean", "|π − μ| mean"))


def plot_runs(
    runs: list[tuple[str, list[dict]]], panels: tuple[tuple[str, str], ...], out: Path, log_keys: tuple[str, ...] = ()
) -> None:
    """One panel per ``(metric key, title)``, one line per ``(name, records)`` run, against the RL step; the panels of
    ``log_keys`` on a log scale. Writes the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for name, records in runs:
        for ax, (key, label) in zip(axes, panels):
            steps, values = series(records, key)
            ax.plot(steps, values, label=name)
            ax.set_title(label)
            ax.set_xlabel("RL step")
    for ax, (key, _) in zip(axes, panels):
        if key in log_keys:
            ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", required=True, help="NAME=PATH of a run's metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    runs = []
    for spec in args.run:
        name, _, path = spec.partition("=")
        records = read_records(Path(path))
        runs.append((name, records))
        acc = series(records, "eval_acc")[1]
        print(
            f"{name}: held-out accuracy {100 * acc[0]:.1f}% -> {100 * acc[-1]:.1f}%, masked fraction mean "
            f"{100 * statistics.fmean(series(records, 'masked_frac')[1]):.2f}%, |pi - mu| mean "
            f"{statistics.fmean(series(records, 'mismatch_mean')[1]):.2e}"
        )
    plot_runs(runs, PANELS, args.out, log_keys=("mismatch_mean",))


if __name__ == "__main__":
    main()

"""Training runs of the divergence-mask family (one trainer run per --loss), side by side.

    python benchmarks/plot_family_runs.py benchmarks/results/family/dppo_binary_tv benchmarks/results/family/ipo \
        benchmarks/results/family/icepop benchmarks/results/family/dppo_binary_tv_seq_mask \
        --out benchmarks/results/family/training.png

Each argument is a run folder (the reference trainer's ``--out``, or a copy holding its ``metrics.jsonl`` and
``summary.json``), named by its ``--loss`` (``NAME=FOLDER`` names it otherwise). Plots, per step, the held-out
accuracy, the loss's masked fraction, the sequence-masked fraction and the first mini-batch's |pi - mu|, one line per
run, and prints a Markdown table: held-out accuracy at the first and last evaluation, the masked and sequence-masked
fractions and |pi - mu| (means over the steps) and the run's wall time (of which the RL loop).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from plot_replay_runs import plot_runs, read_records, series

PANELS = (
    ("eval_acc", "held-out accuracy"),
    ("masked_frac", "masked fraction"),
    ("seq_masked_frac", "sequence-masked fraction"),
    ("mismatch_mean", "|π − μ| mean"),
)


def load_run(spec: str) -> tuple[str, list[dict], dict]:
    """``FOLDER`` or ``NAME=FOLDER`` -> (name, the step records, the summary)."""
    name, sep, folder = spec.partition("=") if "=" in spec else ("", "", spec)
    path = Path(folder)
    for needed in ("metrics.jsonl", "summary.json"):
        if not (path / needed).is_file():
            raise SystemExit(f"{spec!r}: no {needed} in {path} (expected a trainer run folder, or a copy of its files)")
    summary = json.loads((path / "summary.json").read_text())
    return (name if sep else summary.get("loss", path.name)), read_records(path / "metrics.jsonl"), summary


def mean_of(records: list[dict], key: str) -> float | None:
    values = series(records, key)[1]
    return statistics.fmean(values) if values else None


def table(runs: list[tuple[str, list[dict], dict]]) -> str:
    """The Markdown table of the runs (a metric a run does not record shows as a dash)."""
    lines = [
        "| `--loss` | held-out accuracy, first -> last eval | masked fraction | sequence-masked fraction "
        "| \\|π − μ\\| mean | wall time (RL loop) |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name, records, summary in runs:
        steps, acc = series(records, "eval_acc")
        masked, seq = mean_of(records, "masked_frac"), mean_of(records, "seq_masked_frac")
        mismatch = mean_of(records, "mismatch_mean")
        cells = [
            f"`{name}`",
            f"{100 * acc[0]:.1f} % -> {100 * acc[-1]:.1f} % (step {steps[0]} -> {steps[-1]})",
            "—" if masked is None else f"{100 * masked:.2f} %",
            "—" if seq is None else f"{100 * seq:.2f} %",
            "—" if mismatch is None else f"{mismatch:.1e}",
            f"{summary['wall_s']:.0f} s ({summary['train_s']:.0f} s)" if "train_s" in summary else "—",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (FOLDER or NAME=FOLDER)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args()
    runs = [load_run(spec) for spec in args.runs]
    print(table(runs))
    plot_runs([(name, records) for name, records, _ in runs], PANELS, args.out, log_keys=("mismatch_mean",))


if __name__ == "__main__":
    main()

"""The run's summary: start/end held-out accuracy and timings in ``summary.json``, with the plot of its
metrics in ``metrics.png`` (both recorded in the run manifest before they are written)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.metrics import read_metrics
from dppo_ext.trainer.plotting import plot_metrics
from dppo_ext.trainer.run_folder import RunFolder
from dppo_ext.trainer.run_folder.files import METRICS_FILE, PLOT_FILE, SUMMARY_FILE, atomic_write_text


def summarize(out_dir: Path, config: TrainConfig, engine_name: str, wall_s: float, train_s: float) -> dict[str, Any]:
    """Start/end held-out accuracy and timings from ``metrics.jsonl``."""
    evals = [(r["step"], r["eval_acc"]) for r in read_metrics(out_dir / METRICS_FILE) if r.get("eval_acc") is not None]
    start_acc = evals[0][1] if evals and evals[0][0] == 0 else None
    end_acc = evals[-1][1] if evals else None
    return {
        "loss": config.loss,
        "engine": engine_name,
        "steps": config.steps,
        "start_acc": start_acc,
        "end_acc": end_acc,
        "gain": None if start_acc is None or end_acc is None else end_acc - start_acc,
        "wall_s": wall_s,
        "train_s": train_s,
        "metrics": str(out_dir / METRICS_FILE),
        "plot": str(out_dir / PLOT_FILE),
    }


def write_summary(
    config: TrainConfig,
    folder: RunFolder,
    engine_name: str,
    task_name: str,
    wall_start: float,
    train_s: float,
) -> dict[str, Any]:
    """Plot ``metrics.jsonl`` into ``metrics.png`` and write ``summary.json`` (``summarize``); return the summary.

    ``wall_start``: ``time.perf_counter()`` when the run began; ``train_s``: the seconds it trained.
    """
    out_dir = folder.path
    folder.record(PLOT_FILE, "file")
    plot_metrics(out_dir / METRICS_FILE, out_dir / PLOT_FILE, title=f"{task_name}: {config.loss} ({engine_name})")
    summary = summarize(out_dir, config, engine_name, time.perf_counter() - wall_start, train_s)
    folder.record(SUMMARY_FILE, "file")
    atomic_write_text(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    return summary

"""Plot a run's metrics.jsonl as a grid of curves (matplotlib, Agg backend: no display needed).

The PNG replaces the previous one atomically (a crash never leaves a half-written plot)."""

from __future__ import annotations

import io
from pathlib import Path

from dppo_ext.trainer.metrics import read_metrics
from dppo_ext.trainer.run_folder.files import atomic_write_bytes

PANELS = (
    ("accuracy / reward", (("eval_acc", "held-out accuracy"), ("reward", "train reward")), False),
    ("|pi - mu| before update", (("mismatch_mean", "mean"), ("mismatch_max", "max")), True),
    ("masked fraction", (("masked_frac_pos", "A > 0"), ("masked_frac_neg", "A < 0")), False),
    ("entropy", (("entropy_mean", "entropy (nats)"),), False),
    ("response length", (("response_len", "tokens"),), False),
    ("loss", (("loss", "loss"),), False),
    ("grad norm (pre-clip)", (("grad_norm", "grad norm"),), False),
    ("seconds per step", (("rollout_s", "rollout"), ("update_s", "update"), ("sync_s", "weight sync")), True),
    ("divergence", (("divergence_mean", "mean D"),), False),
)


def plot_metrics(metrics_path: str | Path, png_path: str | Path, *, title: str = "") -> Path:
    """Draw every panel of ``PANELS`` from ``metrics_path`` into ``png_path``; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    cols = 3
    rows = -(-len(PANELS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (panel_title, series, log_scale) in zip(axes.flat, PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if log_scale:
                points = [(s, v) for s, v in points if v > 0]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="o" if key == "eval_acc" else None, markersize=3, label=label)
        ax.set_title(panel_title)
        ax.set_xlabel("step")
        if log_scale:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=110, format="png")
    plt.close(fig)
    return atomic_write_bytes(png_path, buffer.getvalue())

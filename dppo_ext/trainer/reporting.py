"""Optional metric sinks beside ``metrics.jsonl`` and the PNG (``--report-to``), as in HF-style trainers.

``tensorboard`` writes every numeric field of each metrics record as a scalar to ``<out>/tensorboard``
(``train/<name>`` for the step's training metrics, ``eval/<name>`` for the held-out evaluation,
``time/<name>`` for the ``*_s`` timings), at the record's RL step. It needs the ``tensorboard``
package (``pip install 'dppo_ext[tensorboard]'``); ``metrics.jsonl`` stays the run's record of truth.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any, Protocol

REPORT_TARGETS = ("none", "tensorboard")
TENSORBOARD_DIR = "tensorboard"


class Reporter(Protocol):
    """Receives each metrics record after it is in ``metrics.jsonl``."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullReporter:
    """``--report-to none``: nothing beside the JSONL file and the plot."""

    def write(self, record: dict[str, Any]) -> None:
        """Ignore ``record``."""

    def close(self) -> None:
        """Nothing to release."""


class TensorBoardReporter:
    """Scalars of every record into a TensorBoard event file.

    Args:
        log_dir: the event folder (``<out>/tensorboard``).
        resume_step: on resume, the checkpoint's step: TensorBoard drops the events of later steps
            (written before the crash, about to be trained again) so each step has one value.
    """

    def __init__(self, log_dir: str | Path, *, resume_step: int | None = None) -> None:
        check_report_to("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        """Add the numeric, finite fields of ``record`` at ``record["step"]``; flush."""
        step = int(record["step"])
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(tensorboard_tag(key), value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def tensorboard_tag(key: str) -> str:
    """The TensorBoard tag of a metrics-record field: ``eval/acc``, ``time/rollout_s``, ``train/loss``."""
    if key.startswith("eval_") and not key.endswith("_s"):
        return f"eval/{key[len('eval_') :]}"
    if key.endswith("_s"):
        return f"time/{key}"
    return f"train/{key}"


def check_report_to(target: str) -> None:
    """Raise ``ValueError`` for an unknown target and ``ImportError`` when its package is missing."""
    if target not in REPORT_TARGETS:
        raise ValueError(f"--report-to: unknown value {target!r}; expected one of {list(REPORT_TARGETS)}")
    if target == "tensorboard" and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "--report-to tensorboard needs the tensorboard package, which is not installed: "
            "pip install tensorboard (or pip install 'dppo_ext[tensorboard]'), or use --report-to none"
        )


def make_reporter(target: str, out_dir: str | Path, *, resume_step: int | None = None) -> Reporter:
    """The reporter of ``--report-to target`` for the run folder ``out_dir``."""
    check_report_to(target)
    if target == "tensorboard":
        return TensorBoardReporter(Path(out_dir) / TENSORBOARD_DIR, resume_step=resume_step)
    return NullReporter()

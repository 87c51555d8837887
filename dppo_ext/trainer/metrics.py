"""Per-step metrics as JSON Lines: one object per RL step (plus eval-only records).

``metrics.jsonl`` is only ever appended to, one flushed and fsynced line per record, so a crash
loses at most the line being written. Resuming from the checkpoint of step ``s`` first repairs
the file (``prepare_for_resume``): a cut-off last line (a crash mid-write) is dropped with a
warning, and the records of steps after ``s`` (written after that checkpoint, about to be
trained again) move to ``metrics.dropped.jsonl`` so that the curve has one record per step.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from dppo_ext.trainer.run_folder.files import atomic_write_text, open_append
from dppo_ext.trainer.run_folder.manifest import record_output

logger = logging.getLogger(__name__)

DROPPED_FILE = "metrics.dropped.jsonl"
# The loss's metrics (dppo_ext.dppo_metrics) a step record averages over the step's response tokens; seq_masked_frac
# is the share of sequences a sequence mask drops (0 for a loss without one), weighted by the micro-batch's tokens.
TOKEN_AVERAGED = (
    "masked_frac",
    "masked_frac_pos",
    "masked_frac_neg",
    "entropy_mean",
    "divergence_mean",
    "seq_masked_frac",
)


class MetricsFormatError(ValueError):
    """A metrics file is malformed; the message starts with ``file:line:``."""


class MetricsWriter:
    """Append-only JSONL writer.

    Args:
        path: the metrics file.
        resume_step: ``None`` for a fresh run (the file must not hold records yet); the resumed
            step otherwise (``prepare_for_resume`` runs first).
    """

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            if self.path.exists() and self.path.stat().st_size > 0:
                raise MetricsFormatError(
                    f"{self.path}: already holds records of an earlier run; a fresh run never appends to it "
                    "(resume that run, or start in an empty folder)"
                )
        else:
            prepare_for_resume(self.path, resume_step)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record as one line (non-finite floats become null so the file stays strict JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        line = json.dumps(clean) + "\n"
        with open_append(self.path) as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def read_metrics(path: str | Path, *, allow_truncated_tail: bool = False) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order.

    Args:
        path: the file.
        allow_truncated_tail: skip a last line that is cut off (no newline and not valid JSON)
            instead of raising.

    Raises:
        MetricsFormatError: a line is not a JSON object with a ``step`` (``file:line:`` in the message).
    """
    records, _ = _parse(Path(path), allow_truncated_tail=allow_truncated_tail)
    return records


def _parse(path: Path, *, allow_truncated_tail: bool) -> tuple[list[dict[str, Any]], str | None]:
    """(records, the cut-off last line or None)."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    records: list[dict[str, Any]] = []
    truncated = None
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        last = lineno == len(lines)  # no newline after it: possibly cut off mid-write
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if last and allow_truncated_tail:
                truncated = line
                continue
            what = (
                "cut off (the writer stopped mid-line)" if last else f"invalid JSON ({err.msg} at column {err.colno})"
            )
            raise MetricsFormatError(f"{path}:{lineno}: {what}") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise MetricsFormatError(
                f"{path}:{lineno}: expected a JSON object with an integer 'step', got {line[:80]!r}"
            )
        records.append(record)
    return records, truncated


def prepare_for_resume(path: str | Path, resume_step: int) -> list[dict[str, Any]]:
    """Repair ``path`` for a run resumed at ``resume_step``; return the records kept.

    Drops a cut-off last line (warning), moves records of steps after ``resume_step`` to
    ``metrics.dropped.jsonl`` (warning) and rewrites the file atomically when either happened.
    """
    path = Path(path)
    if not path.exists():
        logger.warning("resume at step %d: %s does not exist; the curve starts at the resumed step", resume_step, path)
        return []
    records, truncated = _parse(path, allow_truncated_tail=True)
    kept = [r for r in records if r["step"] <= resume_step]
    later = [r for r in records if r["step"] > resume_step]
    if truncated is not None:
        logger.warning("%s: dropped a cut-off last line (a crash mid-write): %r", path, truncated[:120])
    if later:
        dropped = path.with_name(DROPPED_FILE)
        record_output(path.parent, DROPPED_FILE, "file")  # in the run manifest before it exists
        with open_append(dropped) as handle:
            handle.write("".join(json.dumps(r) + "\n" for r in later))
            handle.flush()
            os.fsync(handle.fileno())
        logger.warning(
            "%s: %d record(s) of steps after the resumed checkpoint (step %d) were written after it and are "
            "trained again; they moved to %s",
            path,
            len(later),
            resume_step,
            dropped,
        )
    unterminated = path.stat().st_size > 0 and not path.read_bytes().endswith(b"\n")
    if truncated is not None or later or unterminated:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    last_step = max((r["step"] for r in kept), default=None)
    if last_step is None or last_step < resume_step:
        logger.warning(
            "%s: records end at step %s but the checkpoint is at step %d; the curve has a gap",
            path,
            last_step,
            resume_step,
        )
    return kept

"""The names of the files a run writes in ``--out`` beside its checkpoints (``checkpoint.py``), its embedded
model (``embedded_model.py``) and its TensorBoard folder (``reporting.py``), and reading its JSON files back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INPUTS_FILE = "inputs.json"  # SHA-256 of --data / --eval-data, checked on --resume
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None

"""Per-step metrics as JSON Lines: one object per RL step (plus eval-only records)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsWriter:
    """Append-only JSONL writer; on resume it keeps only the records up to the resumed step."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")
        else:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if self.path.exists() else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (non-finite floats become null so the file stays strict JSON)."""
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(clean) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order."""
    with Path(path).open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]

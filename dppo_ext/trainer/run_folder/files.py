"""The run folder's files: the names of what a run writes there (beside its checkpoints, ``checkpoint.py``, and its
TensorBoard folder, ``reporting.py``), ``RunError``, crash-safe writes and reading the JSON files back.

Every file the trainer writes whole goes to a temporary sibling (``.<name>.<tag>-<pid>``), is fsynced and renamed
into place (docs/run_folder.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INPUTS_FILE = "inputs.json"  # SHA-256 of --data / --eval-data, checked on --resume
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"
EMBEDDED_MODEL_DIR = "base_model"  # the embedded model after its warm start (embedded_model.py)

# Temporary siblings: ``.<name>.<tag>-<pid>`` (``temporary_sibling``); TEMPORARY_NAME_RE reads ``name`` and ``pid``
# back. Which of them count as the trainer's (only those of outputs it writes) is decided in the package's
# ``__init__``.
TEMPORARY_TAGS = ("tmp", "old", "replaced", "deleting")
TEMPORARY_NAME_RE = re.compile(rf"^\.(?P<name>.+)\.(?:{'|'.join(TEMPORARY_TAGS)})-(?P<pid>\d+)$")


class RunError(RuntimeError):
    """A problem with the run folder or its files that the user can act on (the message says how)."""


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(path: str | Path, tag: str = "tmp") -> Path:
    """``<dir>/.<name>.<tag>-<pid>``: where ``path`` is built (``tmp``) or set aside (``old``, ...) by this process."""
    if tag not in TEMPORARY_TAGS:
        raise ValueError(f"tag must be one of {TEMPORARY_TAGS}, got {tag!r}")
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{os.getpid()}")


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a fsynced temporary sibling and a rename."""
    path = Path(path)
    tmp = temporary_sibling(path)
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write_bytes`` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def install_folder(built: Path, folder: Path) -> Path:
    """Rename the complete folder ``built`` to ``folder``, replacing what is there only once it is in place."""
    if folder.exists():
        old = temporary_sibling(folder, "old")
        os.rename(folder, old)
        os.rename(built, folder)
        shutil.rmtree(old)
    else:
        os.rename(built, folder)
    fsync_dir(folder.parent)
    return folder

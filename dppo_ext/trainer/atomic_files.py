"""Crash-safe writes in the run folder: every file the trainer writes whole goes to a temporary sibling
(``.<name>.<tag>-<pid>``), is fsynced and renamed into place, so a crash leaves the old or the new
version, never half of one."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

# Temporary siblings: ``.<name>.<tag>-<pid>`` (``temporary_sibling``); TEMPORARY_NAME_RE reads ``name`` and ``pid``
# back. Which of them count as the trainer's (only those of outputs it writes) is decided in run_folder.py.
TEMPORARY_TAGS = ("tmp", "old", "replaced", "deleting")
TEMPORARY_NAME_RE = re.compile(rf"^\.(?P<name>.+)\.(?:{'|'.join(TEMPORARY_TAGS)})-(?P<pid>\d+)$")


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

"""The run folder's files: the names of what a run writes there (beside its checkpoints, ``checkpoint.py``, and its
TensorBoard folder, ``reporting.py``), ``RunError``, crash-safe writes and reading the JSON files back.

Every file the trainer writes whole goes to a temporary sibling (``.<name>.<tag>-<pid>``), is fsynced and renamed
into place (docs/run_folder.md).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
INPUTS_FILE = "inputs.json"  # SHA-256 of --data / --eval-data, checked on --resume
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"
EMBEDDED_MODEL_DIR = "base_model"  # the embedded model after its warm start (embedded_model.py)
# The record in every checkpoint folder (checkpoint.py): {"format", "step", "run_id", "files": {relative path:
# {"bytes", "sha256"}}}, written last; what of a checkpoint folder is the trainer's (``strays``).
CHECKPOINT_RECORD = "checkpoint.json"
CHECKPOINT_NAME_RE = re.compile(r"^checkpoint-\d+$")

logger = logging.getLogger(__name__)

# Temporary siblings: ``.<name>.<tag>-<pid>`` (``temporary_sibling``); TEMPORARY_NAME_RE reads ``name`` and ``pid``
# back. Which of them count as the trainer's (only those of outputs it writes) is decided in the package's
# ``__init__``.
TEMPORARY_TAGS = ("tmp", "old", "replaced", "deleting")
TEMPORARY_NAME_RE = re.compile(rf"^\.(?P<name>.+)\.(?:{'|'.join(TEMPORARY_TAGS)})-(?P<pid>\d+)$")


class RunError(RuntimeError):
    """A problem with the run folder or its files that the user can act on (the message says how)."""


def read_json_object(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file ``path``: the one reader of the run folder's JSON files.

    Raises:
        OSError: ``path`` cannot be read.
        ValueError: it is not JSON, or its JSON is not an object (the message says what it is).
    """
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def json_object_or_none(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        return read_json_object(path)
    except (OSError, ValueError):
        return None


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


def open_append(path: str | Path):
    """``path`` opened to append text (created when missing), never through a link (``O_NOFOLLOW``) and never
    something that is not a regular file: ``RunError`` naming it then, with nothing written."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        fd = None
    if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
        return open(fd, "a", encoding="utf-8")
    if fd is not None:
        os.close(fd)
    raise RunError(
        f"{str(path)!r} is {'a symbolic link' if Path(path).is_symlink() else 'not a regular file'}: the trainer "
        "appends only to its own file, never through a link; nothing was written. Move it out of the folder"
    )


def atomic_write_text(path: str | Path, text: str) -> Path:
    """``atomic_write_bytes`` of UTF-8 text."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def install_folder(built: Path, folder: Path, *, replace: bool = True) -> Path:
    """Rename the complete folder ``built`` to ``folder``, replacing what is there only once it is in place
    (``replace``), else refusing (``RunError``) when something is there."""
    if os.path.lexists(folder) and not replace:
        raise RunError(
            f"{str(folder)!r} is in the way of the folder the run just built there ({built.name}): it was kept "
            "because it holds what the trainer did not write, so it is not the trainer's to replace. Move it out of "
            "the folder, then start the run again"
        )
    if folder.exists():
        old = temporary_sibling(folder, "old")
        os.rename(folder, old)
        os.rename(built, folder)
        shutil.rmtree(old)
    else:
        os.rename(built, folder)
    fsync_dir(folder.parent)
    return folder


def sha256_of(path: str | Path) -> str:
    """SHA-256 of the regular file ``path`` (read in 1 MiB blocks, never through a link)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_record(folder: str | Path) -> dict[str, Any] | None:
    """The ``files`` of ``folder``'s ``checkpoint.json`` (``{relative path: {"bytes", "sha256"}}``), or None when
    ``folder`` is not a real folder with a readable record (a link, a file, a folder of someone else's)."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir() or (folder / CHECKPOINT_RECORD).is_symlink():
        return None
    data = json_object_or_none(folder / CHECKPOINT_RECORD)
    files = None if data is None else data.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(r, dict) and isinstance(r.get("bytes"), int) and isinstance(r.get("sha256"), str)
        for r in files.values()
    ):
        return None
    return files


def strays(folder: str | Path, files: dict[str, Any] | None = None) -> list[str]:
    """What in the output folder ``folder`` is not the trainer's (relative paths; [] when everything is): an entry
    its record does not list, a listed file that is now a link or no longer has the size and SHA-256 recorded, a
    link anywhere. The record is ``files`` (``{relative path: {"size", "sha256"}}``, the run manifest's record of a
    folder it lists) or, without it, the folder's ``checkpoint.json`` (a checkpoint). A folder without a record is
    not the trainer's at all (``["."]``). A listed file that is missing is fine (a deletion that was interrupted),
    and so is a folder of nothing but empty folders (one interrupted after its record was deleted)."""
    folder = Path(folder)
    size_key, skip = ("size", None) if files is not None else ("bytes", CHECKPOINT_RECORD)
    if files is None:
        files = checkpoint_record(folder)
    if folder.is_symlink() or not folder.is_dir():
        return ["."]
    if files is None:
        for root, dirs, names in os.walk(folder):
            if names or any((Path(root) / d).is_symlink() for d in dirs):
                return ["."]
        return []
    found = []
    for root, dirs, names in os.walk(folder):  # links to folders are listed in dirs, never entered
        for name in dirs + names:
            path = Path(root) / name
            rel = path.relative_to(folder).as_posix()
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                if not any(f.startswith(rel + "/") for f in files):
                    found.append(rel + "/")
                continue
            if rel == skip:
                continue
            record = files.get(rel)
            if (
                record is None
                or not stat.S_ISREG(mode)
                or os.lstat(path).st_size != record[size_key]
                or sha256_of(path) != record["sha256"]
            ):
                found.append(rel)
    return sorted(found)


def remove_checkpoint_files(folder: str | Path, files: dict[str, Any] | None = None) -> list[str]:
    """Delete what the output folder ``folder`` records (each listed file, then, for a checkpoint, its
    ``checkpoint.json``, then the emptied folders), never following a link; the caller checked ``strays(folder,
    files) == []``. ``files``: the run manifest's record of the folder, or None for a checkpoint's own. Return what
    was kept (something put there in the meantime), which keeps its folders too. An interruption leaves the record
    until the listed files are gone, so the next command finds what is left and finishes."""
    folder = Path(folder)
    own_record = files is None
    if own_record:
        files = checkpoint_record(folder) or {}
    for rel in sorted(files):
        path = folder / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
    if own_record:
        (folder / CHECKPOINT_RECORD).unlink(missing_ok=True)
    kept = []
    for root, dirs, names in os.walk(folder, topdown=False):
        kept += [(Path(root) / n).relative_to(folder).as_posix() for n in names]
        for name in dirs:
            path = Path(root) / name
            if path.is_symlink():
                kept.append(path.relative_to(folder).as_posix())
                continue
            try:
                path.rmdir()
            except OSError:  # not empty: something of someone else's is inside
                pass
    try:
        folder.rmdir()
    except OSError:
        logger.warning("kept %s: it holds %s, which the trainer did not write", folder, ", ".join(sorted(kept)))
    return sorted(kept)

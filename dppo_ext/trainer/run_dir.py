"""The run folder (``--out``): who may write to it, when it may be reused, and crash-safe writes.

Rules (as users of HF Trainer expect):

- one writer per folder: ``RunLock`` holds an advisory ``fcntl.flock`` on ``<out>/.dppo-train.lock``
  for the whole run; a second trainer gets an error naming the holder's pid. The kernel drops
  the lock when the holder exits or dies, so a crash never leaves the folder locked;
- a folder that already holds files is refused unless ``--resume`` (continue the run in it) or
  ``--overwrite`` (delete the previous run's outputs, ``RUN_OUTPUTS``, and start fresh) is given;
- every file the trainer writes whole is written to a temporary sibling, fsynced and renamed
  into place (``atomic_write_text``), so a crash leaves the old or the new version, never half.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_FILE = ".dppo-train.lock"
# What the trainer writes into --out (names, or glob patterns), i.e. what --overwrite deletes.
# base_model/ is not listed: it is a cache keyed on the settings that built it (warm_start.json)
# and is rebuilt atomically when they differ. Files the trainer does not know are left alone.
RUN_OUTPUTS = (
    "config.json",
    "inputs.json",
    "metrics.jsonl",
    "metrics.dropped.jsonl",
    "metrics.png",
    "summary.json",
    "checkpoint-*",
    "checkpoint",
    "checkpoint.old",
    "checkpoint.tmp",
    ".checkpoint-*",
    ".tmp-*",
)


class RunError(RuntimeError):
    """A problem with the run folder or its files that the user can act on (the message says how)."""


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a fsynced temporary sibling and a rename."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
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


class RunLock:
    """An exclusive advisory lock on a run folder (``fcntl.flock`` on ``<folder>/.dppo-train.lock``).

    The lock file holds the holder's ``pid host`` so that a refused trainer can say who holds
    it. ``flock`` locks belong to the open file, so the kernel releases them when the holder
    exits, crashes or is killed; ``release`` (or leaving the ``with`` block) releases earlier.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunError`` naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                logger.warning(
                    "cannot lock %s (%s: this filesystem does not support flock); make sure only one trainer writes "
                    "to %s", self.path, os.strerror(err.errno), self.folder,
                )
                self._fd = fd
                return self
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = _read_holder(self.path)
            raise RunError(
                f"--out {str(self.folder)!r} is in use: another dppo-train ({holder}) holds its lock "
                f"{str(self.path)!r}; wait for that run to end, or pass another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the lock file stays; it means nothing without the flock)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file drops its flock
            self._fd = None

    @property
    def held(self) -> bool:
        """True while this object holds the lock."""
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(path: Path) -> str:
    try:
        fields = path.read_text().split()
    except OSError:
        fields = []
    if not fields:
        return "pid unknown: it is starting"
    return f"pid {fields[0]}" + (f" on host {fields[1]}" if len(fields) > 1 else "")


def _contents(folder: Path) -> list[str]:
    """Names in ``folder`` other than the lock file (sorted); [] when it does not exist."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE)


def _check_reusable(folder: Path, *, resume: bool, overwrite: bool) -> None:
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--out {str(folder)!r} exists and is not a folder; pass a folder path")
    names = _contents(folder)
    if names and not (resume or overwrite):
        shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
        raise RunError(
            f"--out {str(folder)!r} is not empty (it holds {shown}): pass --resume to continue the run "
            "in it, --overwrite to delete its previous outputs and start over, or another --out"
        )


def open_run_dir(folder: str | Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Check that ``folder`` may be used as ``--out``, lock it and (``overwrite``) clear it.

    Args:
        folder: the run folder (created when missing).
        resume: the run continues the one in ``folder`` (a non-empty folder is expected).
        overwrite: delete the previous run's outputs (``RUN_OUTPUTS``) before starting.

    Returns:
        The held ``RunLock``; release it (or use it as a context manager) when the run ends.

    Raises:
        RunError: ``folder`` is not a folder, is not empty without ``resume``/``overwrite``, or
            another trainer holds its lock (the message names its pid).
    """
    folder = Path(folder)
    # Checked before anything is created (a refused --out is left exactly as it was), and again
    # once the lock is held (another trainer may have written to it in between). A folder in use
    # is reported as such first: --resume or --overwrite would not help there.
    if (folder / LOCK_FILE).is_file():
        RunLock(folder).acquire().release()
    _check_reusable(folder, resume=resume, overwrite=overwrite)
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder).acquire()
    try:
        _check_reusable(folder, resume=resume, overwrite=overwrite)
        _remove_stale_temporaries(folder)
        if overwrite:
            removed = remove_run_outputs(folder)
            if removed:
                logger.warning("--overwrite: deleted the previous run's outputs in %s: %s", folder, ", ".join(removed))
    except BaseException:
        lock.release()
        raise
    return lock


def remove_run_outputs(folder: str | Path) -> list[str]:
    """Delete the trainer's own outputs (``RUN_OUTPUTS``) in ``folder``; return the names removed."""
    folder = Path(folder)
    removed = []
    for pattern in RUN_OUTPUTS:
        for path in sorted(folder.glob(pattern)):
            _remove(path)
            removed.append(path.name)
    return removed


def _remove_stale_temporaries(folder: Path) -> None:
    """Delete temporaries of a writer that died (only called while holding the lock)."""
    for pattern in (".checkpoint-*", ".tmp-*", ".base_model.*"):
        for path in folder.glob(pattern):
            logger.info("removing %s, left behind by an interrupted run", path)
            _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()

"""One trainer per run folder (docs/run_folder.md): ``RunLock``, an advisory ``fcntl.flock`` on
``<out>/.dppo-train.lock`` held for the whole run."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import stat
from pathlib import Path

from dppo_ext.trainer.run_folder.files import RunError

logger = logging.getLogger(__name__)

LOCK_FILE = ".dppo-train.lock"


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
        """Take the lock or raise ``RunError`` naming the process that holds it (or saying why the file there is not
        a lock file: a link, a folder, a file of someone else's; it is then left as it is)."""
        fd = self._open(os.O_RDWR | os.O_CREAT)
        try:
            locked = self._flock(fd)
            if not _holds_a_holder(fd):
                raise RunError(
                    f"{str(self.path)!r} is not a dppo-train lock file (it holds something else than the "
                    "'<pid> <host>' of a trainer), so it is not the trainer's to overwrite; nothing was changed. Move "
                    "it out of --out, or pass another --out"
                )
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            self._fd = fd
            return self
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def _open(self, flags: int) -> int:
        """Open the lock file, never through a link (``O_NOFOLLOW``) and never a folder or a device."""
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            if err.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                raise
            fd = None
        if fd is not None and stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
        if fd is not None:
            os.close(fd)
        kind = "a symbolic link" if self.path.is_symlink() else "not a regular file"
        raise RunError(
            f"{str(self.path)!r}, the name of dppo-train's lock file, is {kind}: the trainer never writes through a "
            "link or into something that is not its own file; nothing was changed. Move it out of --out (it is not "
            "the trainer's), or pass another --out"
        )

    def check_free(self) -> None:
        """Raise ``RunError`` if another process holds the lock or the lock file is not one (a link: see
        ``acquire``); change nothing (the file is only read)."""
        try:
            fd = self._open(os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            self._flock(fd)
        finally:
            os.close(fd)  # drops the probe's flock, if it got one

    def _flock(self, fd: int) -> bool:
        """Lock ``fd``: True when locked, False when the filesystem has no flock (warned); raise when held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                logger.warning(
                    "cannot lock %s (%s: this filesystem does not support flock); make sure only one trainer writes "
                    "to %s",
                    self.path,
                    os.strerror(err.errno),
                    self.folder,
                )
                return False
            if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            holder = _read_holder(self.path)
            raise RunError(
                f"--out {str(self.folder)!r} is in use: another dppo-train ({holder}) holds its lock "
                f"{str(self.path)!r}; wait for that run to end, or pass another --out"
            ) from None
        return True

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


_HOLDER_RE = re.compile(rb"^(\d+ \S+\n)?$")


def _holds_a_holder(fd: int) -> bool:
    """Whether the open lock file is empty or holds one ``<pid> <host>`` line (what ``acquire`` writes)."""
    if os.fstat(fd).st_size > 4096:
        return False
    return _HOLDER_RE.match(os.pread(fd, 4096, 0)) is not None


def _read_holder(path: Path) -> str:
    try:
        fields = path.read_text().split()
    except OSError:
        fields = []
    if not fields:
        return "pid unknown: it is starting"
    return f"pid {fields[0]}" + (f" on host {fields[1]}" if len(fields) > 1 else "")

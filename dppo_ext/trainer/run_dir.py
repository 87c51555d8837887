"""The run folder (``--out``): who may write to it, what the trainer wrote there, when it may be
reused or cleared, and crash-safe writes.

Rules (the user's files are never the trainer's to delete):

- **the trainer records what it writes.** ``dppo-run.json``, the run manifest, lists every file and
  folder the trainer created in ``--out`` (``{"outputs": {name: "file" | "dir"}}``). A name is
  recorded before the output is created (a crash can leave a listed name missing, never an
  unlisted output) and dropped once it is deleted (checkpoint rotation). The manifest is written
  atomically. The lock file, the manifest itself and the trainer's temporaries
  (``.<output>.tmp-<pid>``, ``.checkpoint-<step>.deleting-<pid>``, ...) are its bookkeeping;
- **a fresh run needs an empty folder** (or a missing one; the lock file does not count).
  ``--resume`` continues the run the manifest describes. ``--overwrite`` deletes exactly what the
  manifest lists, and nothing else, before starting over (the one exception is ``base_model/``
  when the new run reuses it: the cache of the embedded warm start, kept when its settings match).
  A non-empty folder without a manifest is refused by all three, touching nothing: it was not
  written by this trainer. The one exception is ``--resume`` of a run written by a dppo-train
  older than the manifest (``adopt``: the caller recognises that trainer's outputs by their content);
- **one writer per folder**: ``RunLock`` holds an advisory ``fcntl.flock`` on
  ``<out>/.dppo-train.lock`` for the whole run; a second trainer gets an error naming the holder's
  pid. The kernel drops the lock when the holder exits or dies, so a crash never leaves it locked;
- **setup changes nothing**: until the run calls ``RunFolder.commit`` (its data loaded, its model
  built, its engine started, its checkpoint restored) it writes nothing into ``--out`` but the
  lock file, a manifest (only into a folder that was empty) and temporaries. A failure or Ctrl-C
  before that leaves ``--out`` as it was: a folder the run created is removed again (with any parent
  it created), an existing one keeps exactly its files, with their bytes (the lock file's content
  is restored). ``--overwrite`` deletes the previous run only at commit, so a run that cannot start
  leaves it intact. A process killed outright during setup (SIGKILL, power loss) leaves a manifest
  in state ``setup``: the next fresh run in that folder removes what it lists and the trainer's
  temporaries, and starts;
- every file the trainer writes whole is written to a temporary sibling, fsynced and renamed
  into place (``atomic_write_text``), so a crash leaves the old or the new version, never half.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from dppo_ext._version import __version__

logger = logging.getLogger(__name__)

LOCK_FILE = ".dppo-train.lock"
MANIFEST_FILE = "dppo-run.json"
MANIFEST_FORMAT = 1
KINDS = ("file", "dir")
SETUP, STARTED = "setup", "started"
# Temporary siblings: ``.<name>.<tag>-<pid>`` (``temporary_sibling``), and ``.tmp-<pid>-<name>`` of
# dppo-train versions before the manifest. Only names of outputs the trainer writes count (see _is_temporary).
TEMPORARY_TAGS = ("tmp", "old", "replaced", "deleting")
_TEMPORARY_RE = re.compile(rf"^\.(?P<name>.+)\.(?:{'|'.join(TEMPORARY_TAGS)})-(?P<pid>\d+)$")
_EARLIER_TEMPORARY_RE = re.compile(r"^\.tmp-(?P<pid>\d+)-(?P<name>.+)$")
_CHECKPOINT_NAME_RE = re.compile(r"^checkpoint-\d+$")
EMBEDDED_MODEL_DIR = "base_model"


class RunError(RuntimeError):
    """A problem with the run folder or its files that the user can act on (the message says how)."""


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


# ---------------------------------------------------------------- the lock


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
            locked = self._flock(fd)
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

    def check_free(self) -> None:
        """Raise ``RunError`` if another process holds the lock; change nothing (the file is only read)."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
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
                    "to %s", self.path, os.strerror(err.errno), self.folder,
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


def _read_holder(path: Path) -> str:
    try:
        fields = path.read_text().split()
    except OSError:
        fields = []
    if not fields:
        return "pid unknown: it is starting"
    return f"pid {fields[0]}" + (f" on host {fields[1]}" if len(fields) > 1 else "")


# ---------------------------------------------------------------- the manifest


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The run manifest of ``folder`` (``{"format", "writer", "state", "outputs"}``), or None when it has none.

    Raises:
        RunError: the manifest is unreadable, or lists a name that is not a plain entry of ``folder``.
    """
    path = Path(folder) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a regular file")
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"expected a JSON object of format {MANIFEST_FORMAT}")
        if data.get("state") not in (SETUP, STARTED):
            raise ValueError(f"state must be {SETUP!r} or {STARTED!r}, got {data.get('state')!r}")
        outputs = data.get("outputs")
        if not isinstance(outputs, dict):
            raise ValueError("'outputs' must be an object")
        for name, kind in outputs.items():
            # a hand-edited manifest must not reach outside the folder or name the bookkeeping files
            if name in ("", ".", "..", MANIFEST_FILE, LOCK_FILE) or "/" in name or "\0" in name:
                raise ValueError(f"output name {name!r} is not a plain name in the folder")
            if kind not in KINDS:
                raise ValueError(f"output {name!r} has kind {kind!r}, expected one of {list(KINDS)}")
    except (OSError, ValueError) as err:
        raise RunError(
            f"{str(path)!r} is unreadable ({err}): it is the record of what dppo-train wrote in {str(path.parent)!r}, "
            "so nothing there can be reused or deleted safely; nothing was changed. Restore the file, or pass another "
            "--out"
        ) from None
    return data


def _write_manifest(folder: Path, state: str, outputs: Mapping[str, str]) -> None:
    manifest = {"format": MANIFEST_FORMAT, "writer": f"dppo-train {__version__}", "state": state,
                "outputs": dict(sorted(outputs.items()))}
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")


def record_output(folder: str | Path, name: str, kind: str) -> None:
    """Add ``name`` (``kind``: "file" or "dir") to ``folder``'s manifest before creating it there.

    A folder without a manifest (``save_checkpoint`` called outside a run folder) is left as it is.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or manifest["outputs"].get(name) == kind:
        return
    _write_manifest(folder, manifest["state"], {**manifest["outputs"], name: kind})


def forget_output(folder: str | Path, name: str) -> None:
    """Drop ``name`` from ``folder``'s manifest once it is deleted (no-op without a manifest)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or name not in manifest["outputs"]:
        return
    _write_manifest(folder, manifest["state"], {k: v for k, v in manifest["outputs"].items() if k != name})


def _is_temporary(name: str, outputs: Mapping[str, str], pid: int | None = None) -> bool:
    """True for a temporary sibling of the manifest, a listed output, ``base_model`` or a checkpoint."""
    match = _TEMPORARY_RE.match(name) or _EARLIER_TEMPORARY_RE.match(name)
    if match is None or (pid is not None and int(match.group("pid")) != pid):
        return False
    base = match.group("name")
    return (base in outputs or base in (MANIFEST_FILE, EMBEDDED_MODEL_DIR)
            or _CHECKPOINT_NAME_RE.match(base) is not None)


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "symlink"
    return "dir" if path.is_dir() else "file"


def _contents(folder: Path) -> list[str]:
    """Names in ``folder`` other than the lock file (sorted); [] when it does not exist."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_FILE)


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder tree (``rmtree`` does not follow links)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# ---------------------------------------------------------------- opening a run folder


def check_out_apart(out: str | Path, inputs: Mapping[str, str]) -> None:
    """Refuse an ``--out`` that is, contains or lies inside one of ``inputs`` (``{flag: path}``).

    Both sides are compared as resolved paths (symbolic links and ``..`` followed), so another
    spelling of the same folder is caught. Inputs that are not local paths (a hub id) are skipped.

    Raises:
        RunError: naming both flags, the paths and what to do; nothing is written.
    """
    out_real = Path(os.path.realpath(out))
    for flag, value in inputs.items():
        if not value or not os.path.lexists(value):
            continue
        real = Path(os.path.realpath(value))
        if real == out_real:
            relation = "is"
        elif real.is_relative_to(out_real):
            relation = "contains"
        elif out_real.is_relative_to(real):
            relation = "lies inside"
        else:
            continue
        spelled = (str(out_real), str(real)) != (str(out), str(value))
        resolved = f" (resolved: {str(out_real)!r} and {str(real)!r})" if spelled else ""
        raise RunError(
            f"--out {str(out)!r} {relation} {flag} {value!r}{resolved}: the run would write its outputs among that "
            f"input's files (and --overwrite delete them); pass an --out that is apart from --model, --data and "
            "--eval-data"
        )


# adopt(folder) -> {name: kind}: a run of an earlier dppo-train (no manifest) recognised by its outputs'
# contents, or RunError saying why the folder is not one.
Adopt = Callable[[Path], dict[str, str]]


class RunFolder:
    """An opened ``--out``: its lock held, its previous outputs known, nothing of it changed before ``commit``.

    Use it as a context manager: leaving the block without ``commit`` (an error or Ctrl-C during
    setup, or a run with nothing to do) undoes the set-up's traces, so the folder is as it was.
    """

    def __init__(self, path: Path, lock: RunLock, *, mode: str, outputs: dict[str, str], adopted: bool,
                 created_dirs: list[Path], lock_before: bytes | None, manifest_created: bool) -> None:
        self.path = path
        self.lock = lock
        self.mode = mode  # "fresh", "overwrite" (a previous run's outputs to delete at commit) or "resume"
        self.outputs = outputs  # the previous run's outputs (manifest, or adopted from an earlier trainer)
        self.adopted = adopted
        self.committed = False
        self._created_dirs = created_dirs
        self._lock_before = lock_before
        self._manifest_created = manifest_created
        self._found = set(_contents(path))  # what was there when the lock was taken

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self.rollback()
        self.lock.release()

    def commit(self, record: Mapping[str, str] = (), *, keep: Iterable[str] = ()) -> None:
        """The run starts: from here on what it writes stays (a later failure leaves a run to ``--resume``).

        Args:
            record: ``{name: kind}`` of the outputs the run writes next (recorded before they exist).
            keep: names left in place: previous outputs the new run reuses (``--overwrite``: ``base_model``)
                and temporaries of its own still to be renamed into place (every other trainer
                temporary is a dead writer's and is removed).
        """
        folder = self.path
        keep = set(keep)
        outputs = dict(self.outputs)
        if self.mode == "overwrite":
            _check_listed_kinds(folder, outputs)
            doomed = [name for name in sorted(outputs) if name not in keep]
            _write_manifest(folder, SETUP, outputs)  # a crash while deleting leaves a folder the next run may clear
            removed = []
            for name in doomed:
                path = folder / name
                if path.exists() or path.is_symlink():
                    _remove(path)
                    removed.append(name)
                del outputs[name]
                _write_manifest(folder, SETUP, outputs)
            if removed:
                logger.warning("--overwrite: deleted what the previous run wrote in %s: %s", folder, ", ".join(removed))
        elif self.adopted:
            logger.warning(
                "--resume: %s has no %s (written by a dppo-train older than the run manifest); recorded these outputs "
                "of it, recognised by their content, as the run's: %s; everything else in it stays untouched",
                folder, MANIFEST_FILE, ", ".join(sorted(outputs)) or "none",
            )
        known = {**self.outputs, **dict(record)}  # temporaries of what the previous run wrote are recognised too
        for name in sorted(_contents(folder)):
            if _is_temporary(name, known) and name not in keep:
                logger.info("removing %s, left behind by an interrupted run", folder / name)
                _remove(folder / name)
        _write_manifest(folder, STARTED, {**outputs, **dict(record)})
        self.committed = True

    def record(self, name: str, kind: str) -> None:
        """``record_output`` in this folder (after ``commit``)."""
        record_output(self.path, name, kind)

    def rollback(self) -> None:
        """Undo what opening and setting up wrote: the folder is left as ``open_run_dir`` found it."""
        folder = self.path
        pid = os.getpid()
        for name in set(_contents(folder)) - self._found:
            match = _TEMPORARY_RE.match(name)
            if match is not None and int(match.group("pid")) == pid:  # this process's: whatever it was building
                _remove(folder / name)
        if self._manifest_created:
            (folder / MANIFEST_FILE).unlink(missing_ok=True)
        lock_path = folder / LOCK_FILE
        if self._lock_before is None:
            lock_path.unlink(missing_ok=True)
        elif lock_path.is_file() and lock_path.read_bytes() != self._lock_before:
            with open(lock_path, "r+b") as handle:  # the same open file keeps the flock until release
                handle.truncate(0)
                handle.write(self._lock_before)
        for path in reversed(self._created_dirs):
            try:
                path.rmdir()
            except OSError:  # something else was put there in the meantime: leave it
                logger.warning("kept %s: it is not empty", path)
                break
        self.lock.release()


def _check_listed_kinds(folder: Path, outputs: Mapping[str, str]) -> None:
    """Refuse to delete a listed name that now holds something else than what the trainer wrote there."""
    for name, kind in sorted(outputs.items()):
        path = folder / name
        if not path.exists() and not path.is_symlink():
            continue
        now = _kind(path)
        if now != kind:
            raise RunError(
                f"--overwrite: {str(path)!r} is a {now}, but dppo-train wrote a {kind} there ({MANIFEST_FILE}): it was "
                "replaced since, so it is not the trainer's to delete; nothing was changed. Move it out of the "
                "folder, or pass another --out"
            )


def _plan(
    folder: Path, *, resume: bool, overwrite: bool, adopt: Adopt | None,
) -> tuple[str, dict[str, str], bool, list[str]]:
    """Decide what opening ``folder`` does, changing nothing: (mode, previous outputs, adopted, leftovers to clear)."""
    if folder.is_symlink() and not folder.exists():
        raise RunError(f"--out {str(folder)!r} is a symbolic link to a missing folder; pass a folder path")
    if folder.exists() and not folder.is_dir():
        raise RunError(f"--out {str(folder)!r} exists and is not a folder; pass a folder path")
    names = _contents(folder)
    if not names:
        return ("resume" if resume else "fresh"), {}, False, []
    manifest = read_manifest(folder)
    if manifest is None:
        if resume and adopt is not None:
            return "resume", adopt(folder), True, []
        what = ("--overwrite deletes only what that record lists" if overwrite else
                "--resume continues only a run recorded there" if resume else "a fresh run needs an empty folder")
        raise RunError(
            f"--out {str(folder)!r} is not empty (it holds {_shown(names)}) and has no {MANIFEST_FILE}, the record of "
            f"what dppo-train wrote there, so nothing in it is the trainer's to replace or delete; {what}. Nothing "
            "was changed. Pass an empty or new --out (or, if nothing in the folder is yours, delete it yourself)"
        )
    outputs = dict(manifest["outputs"])
    if resume:
        if manifest["state"] == SETUP:
            raise RunError(
                f"--resume: the run in {str(folder)!r} never started training (its {MANIFEST_FILE} is in state "
                f"{SETUP!r}: a run killed during its set-up, or an --overwrite of it that was interrupted), so there "
                "is nothing to continue; nothing was changed. Start it again without --resume"
            )
        return "resume", outputs, False, []
    if overwrite:
        _check_listed_kinds(folder, outputs)
        return "overwrite", outputs, False, []
    others = [n for n in names if n != MANIFEST_FILE and n not in outputs and not _is_temporary(n, outputs)]
    if manifest["state"] == SETUP and not others:
        # what a run killed during its setup (or while --overwrite deleted) left: nothing a run produced
        return "fresh", {}, False, [n for n in names if n != MANIFEST_FILE]
    raise RunError(
        f"--out {str(folder)!r} already holds a run (its {MANIFEST_FILE} lists "
        f"{_shown(sorted(outputs)) or 'nothing'}): pass --resume to continue it, --overwrite to delete what it wrote "
        "and start over (files it did not write stay), or another --out"
    )


def open_run_dir(folder: str | Path, *, resume: bool, overwrite: bool, adopt: Adopt | None = None) -> RunFolder:
    """Check that ``folder`` may be used as ``--out`` and lock it; nothing is deleted before ``commit``.

    Args:
        folder: the run folder (created when missing, with its parents; removed again by a rollback).
        resume: the run continues the one recorded in ``folder``.
        overwrite: the run replaces the one recorded in ``folder`` (deleted at ``commit``).
        adopt: with ``resume``, how to recognise a run of an earlier dppo-train that wrote no manifest.

    Returns:
        The opened ``RunFolder`` (lock held); use it as a context manager.

    Raises:
        RunError: ``folder`` is not a folder, is not empty without a manifest, already holds a run
            without ``resume``/``overwrite``, its manifest is unreadable, or another trainer holds
            its lock (the message names its pid). Nothing in ``folder`` is changed then.
    """
    folder = Path(folder)
    # Checked before anything is created (a refused --out is left exactly as it was), and again
    # once the lock is held (another trainer may have written to it in between). A folder in use
    # is reported as such first: --resume or --overwrite would not help there.
    RunLock(folder).check_free()
    _plan(folder, resume=resume, overwrite=overwrite, adopt=adopt)
    created = []
    for parent in reversed([folder, *folder.parents]):
        if not parent.exists():
            created.append(parent)
    lock_path = folder / LOCK_FILE
    lock_before = lock_path.read_bytes() if lock_path.is_file() else None
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder)
    try:
        lock.acquire()
    except BaseException:  # another trainer took it in between: its lock file is not ours to remove
        for path in reversed(created):
            try:
                path.rmdir()
            except OSError:
                break
        raise
    run = RunFolder(folder, lock, mode="fresh", outputs={}, adopted=False, created_dirs=created,
                    lock_before=lock_before, manifest_created=False)
    try:
        mode, outputs, adopted, leftovers = _plan(folder, resume=resume, overwrite=overwrite, adopt=adopt)
        run.mode, run.outputs, run.adopted = mode, outputs, adopted
        if mode == "fresh":
            for name in leftovers:
                logger.info("removing %s, left by a run killed during its setup", folder / name)
                _remove(folder / name)
            run._manifest_created = not (folder / MANIFEST_FILE).exists()
            _write_manifest(folder, SETUP, {})
    except BaseException:
        run.rollback()
        raise
    return run

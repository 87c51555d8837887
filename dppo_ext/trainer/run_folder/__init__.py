"""The run folder (``--out``): whether a run may use it, what the trainer wrote there, and the folder put back as it
was when a run's set-up fails. The rules are written once, in docs/run_folder.md; this package enforces them:

- this module: ``open_run_folder`` (lock the folder and act on the plan) and ``RunFolder`` (``commit`` when the run
  starts, ``rollback`` when its set-up fails);
- ``plan``: may the folder be used (a fresh run, ``--resume``, ``--overwrite``) and the refusals of ``--overwrite``,
  decided before anything changes; ``check_out_apart`` (``--out`` apart from ``--model``, ``--data`` and
  ``--eval-data``);
- ``manifest``: ``dppo-run.json``, the record of what the trainer wrote there;
- ``lock``: one trainer per folder (``RunLock``);
- ``files``: the names of the run's files, ``RunError``, crash-safe writes.

What a run of a dppo-train older than the manifest wrote is recognised by ``dppo_ext.trainer.resume``
(``legacy_run_outputs``, the ``adopt`` of ``open_run_folder``).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from dppo_ext.trainer.run_folder.files import CHECKPOINT_NAME_RE, TEMPORARY_NAME_RE, remove_checkpoint_files, strays
from dppo_ext.trainer.run_folder.lock import LOCK_FILE, RunLock
from dppo_ext.trainer.run_folder.manifest import (
    FOLDER_ID_FILE,
    MANIFEST_FILE,
    SETUP,
    STARTED,
    folder_records,
    foreign_files,
    output_strays,
    read_manifest,
    record_output,
    seal_outputs,
    write_manifest,
)
from dppo_ext.trainer.run_folder.plan import (
    Adopt,
    check_listed_kinds,
    folder_contents,
    is_temporary,
    live_writer,
    names_in,
    plan_opening,
    unproven_files,
)

logger = logging.getLogger(__name__)


def _remove(path: Path, manifest: Mapping | None = None) -> None:
    """Delete a file, a link (never what it points to) or a folder tree (``rmtree`` does not follow links). A
    checkpoint folder, or one set aside while it was deleted or replaced, loses only what its ``checkpoint.json``
    lists, and a folder ``manifest`` lists only what the manifest records writing there, each only when it holds
    nothing else (``strays``); else it is kept, with a warning."""
    match = TEMPORARY_NAME_RE.match(path.name)
    base = match.group("name") if match is not None else path.name
    checkpoint = CHECKPOINT_NAME_RE.match(base) and not (
        match is not None and path.name.rsplit(".", 1)[1].startswith("tmp")
    )
    listed = manifest is not None and match is None and path.is_dir() and not path.is_symlink()
    if checkpoint or listed:
        found = strays(path) if checkpoint else output_strays(path.parent, path.name, manifest)
        if found:
            logger.warning(
                "kept %s: it is not only what the trainer wrote there (%s)", path, ", ".join(found[:6]) or "a link"
            )
            return
        remove_checkpoint_files(path, None if checkpoint else folder_records(manifest, path.name))
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def _remove_leftover(path: Path, why: str) -> None:
    """Remove a trainer temporary whose writer is dead; one whose writer still runs is left alone, with a warning."""
    pid = live_writer(path.name)
    if pid is not None:
        logger.warning("kept %s: the process that writes it (pid %d) is still running", path, pid)
        return
    logger.info("removing %s, %s", path, why)
    _remove(path)


class RunFolder:
    """An opened ``--out``: its lock held, its previous outputs known, nothing of it changed before ``commit``.

    Use it as a context manager: leaving the block without ``commit`` (an error or Ctrl-C during
    setup, or a run with nothing to do) undoes the set-up's traces, so the folder is as it was.
    """

    def __init__(
        self,
        path: Path,
        lock: RunLock,
        *,
        mode: str,
        outputs: dict[str, str],
        adopted: bool,
        created_dirs: list[Path],
        lock_before: bytes | None,
        manifest_created: bool,
    ) -> None:
        self.path = path
        self.lock = lock
        self.mode = mode  # "fresh", "overwrite" (a previous run's outputs to delete at commit) or "resume"
        self.outputs = outputs  # the previous run's outputs (manifest, or adopted from an earlier trainer)
        self.adopted = adopted
        self.committed = False
        self._created_dirs = created_dirs
        self._lock_before = lock_before
        self._manifest_created = manifest_created
        self._found = set(folder_contents(path))  # what was there when the lock was taken
        self._had_id = (path / FOLDER_ID_FILE).exists() or (path / FOLDER_ID_FILE).is_symlink()
        self._foreign: set[str] = set()  # files in the listed folders at commit that the trainer did not write

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed:
                self.rollback()
            else:  # the sizes and hashes of what the run wrote: what a later --overwrite may delete
                self.seal()
        finally:
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
            check_listed_kinds(folder, outputs)
            unproven = unproven_files(folder)
            if unproven:
                logger.warning(
                    "--overwrite: kept %s in %s: not what the previous run wrote there (changed since, or recorded "
                    "without a hash by an earlier dppo-train); move or delete it yourself if it is not yours",
                    ", ".join(unproven),
                    folder,
                )
                outputs = {k: v for k, v in outputs.items() if k not in unproven}
            doomed = [name for name in sorted(outputs) if name not in keep]
            # Written once before the deletions, with the size and SHA-256 of every file still to delete: a crash
            # while deleting leaves a manifest from which the next --overwrite (or a plain run) finishes the job.
            previous = read_manifest(folder) or {"files": {}}
            write_manifest(folder, SETUP, outputs, files=previous["files"], new_run=True)
            removed = []
            present = names_in(folder)
            for name in doomed:
                path = folder / name
                if name in present:
                    _remove(path, previous)
                    removed.append(name)
                del outputs[name]
            if removed:
                logger.warning("--overwrite: deleted what the previous run wrote in %s: %s", folder, ", ".join(removed))
        elif self.adopted:
            logger.warning(
                "--resume: %s has no %s (written by a dppo-train older than the run manifest); recorded these outputs "
                "of it, recognised by their content, as the run's: %s; everything else in it stays untouched",
                folder,
                MANIFEST_FILE,
                ", ".join(sorted(outputs)) or "none",
            )
        known = {**self.outputs, **dict(record)}  # temporaries of what the previous run wrote are recognised too
        for name in sorted(folder_contents(folder)):
            if is_temporary(name, known) and name not in keep:
                _remove_leftover(folder / name, "left behind by an interrupted run")
        write_manifest(folder, STARTED, {**outputs, **dict(record)})
        # an adopted run's folders were recognised by their content as that trainer's: all of them are the run's
        self._foreign = set() if self.adopted else foreign_files(folder)
        self.committed = True

    def seal(self) -> None:
        """Record the size and SHA-256 of what the run wrote so far (``seal_outputs``): called when the run ends,
        and once a folder output is complete, so that a run killed later still proves that folder its own."""
        seal_outputs(self.path, self._foreign)

    def record(self, name: str, kind: str) -> None:
        """``record_output`` in this folder (after ``commit``)."""
        record_output(self.path, name, kind)

    def rollback(self) -> None:
        """Undo what opening and setting up wrote: the folder is left as ``open_run_folder`` found it."""
        folder = self.path
        pid = os.getpid()
        for name in set(folder_contents(folder)) - self._found:
            match = TEMPORARY_NAME_RE.match(name)
            if match is not None and int(match.group("pid")) == pid:  # this process's: whatever it was building
                _remove(folder / name)
        if self._manifest_created:
            (folder / MANIFEST_FILE).unlink(missing_ok=True)
        if not self._had_id:
            (folder / FOLDER_ID_FILE).unlink(missing_ok=True)
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


def open_run_folder(folder: str | Path, *, resume: bool, overwrite: bool, adopt: Adopt | None = None) -> RunFolder:
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
    plan_opening(folder, resume=resume, overwrite=overwrite, adopt=adopt)
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
    run = RunFolder(
        folder,
        lock,
        mode="fresh",
        outputs={},
        adopted=False,
        created_dirs=created,
        lock_before=lock_before,
        manifest_created=False,
    )
    try:
        mode, outputs, adopted, leftovers = plan_opening(folder, resume=resume, overwrite=overwrite, adopt=adopt)
        run.mode, run.outputs, run.adopted = mode, outputs, adopted
        if mode == "fresh":
            for name in leftovers:
                _remove_leftover(folder / name, "left by a run killed during its setup")
            run._manifest_created = not (folder / MANIFEST_FILE).exists()
            write_manifest(folder, SETUP, {}, new_run=True)
    except BaseException:
        run.rollback()
        raise
    return run

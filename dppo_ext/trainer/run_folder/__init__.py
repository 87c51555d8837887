"""The run folder (``--out``): whether a run may use it, what the trainer wrote there, and the folder put back as it
was when a run's set-up fails. The rules are written once, in docs/run_folder.md; this package enforces them:

- this module: ``open_run_folder`` (may the folder be used: a fresh run, ``--resume``, ``--overwrite``),
  ``RunFolder`` (``commit`` when the run starts, ``rollback`` when its set-up fails) and ``check_out_apart``
  (``--out`` apart from ``--model``, ``--data`` and ``--eval-data``);
- ``manifest``: ``dppo-run.json``, the record of what the trainer wrote there;
- ``lock``: one trainer per folder (``RunLock``);
- ``files``: the names of the run's files, ``RunError``, crash-safe writes.

What a run of a dppo-train older than the manifest wrote is recognised by ``dppo_ext.trainer.resume``
(``legacy_run_outputs``, the ``adopt`` of ``open_run_folder``).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from dppo_ext.trainer.run_folder.files import (
    CONFIG_FILE,
    EMBEDDED_MODEL_DIR,
    INPUTS_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    TEMPORARY_NAME_RE,
    RunError,
    remove_checkpoint_files,
    strays,
)
from dppo_ext.trainer.run_folder.lock import LOCK_FILE, RunLock
from dppo_ext.trainer.run_folder.manifest import (
    FOLDER_ID_FILE,
    MANIFEST_FILE,
    SETUP,
    STARTED,
    matches_record,
    read_manifest,
    record_output,
    seal_outputs,
    speaks_for,
    write_manifest,
)

logger = logging.getLogger(__name__)

# ``.tmp-<pid>-<name>``: the temporaries of dppo-train versions before the manifest.
_EARLIER_TEMPORARY_RE = re.compile(r"^\.tmp-(?P<pid>\d+)-(?P<name>.+)$")
_CHECKPOINT_NAME_RE = re.compile(r"^checkpoint-\d+$")
# The files every run writes anew: one of them that --overwrite may not delete (not provably the previous run's)
# would be overwritten by the new run, so it is refused instead of kept.
_REWRITTEN = (CONFIG_FILE, INPUTS_FILE, METRICS_FILE, PLOT_FILE, SUMMARY_FILE)


def _is_temporary(name: str, outputs: Mapping[str, str], pid: int | None = None) -> bool:
    """True for a temporary sibling of the manifest, a listed output, ``base_model`` or a checkpoint."""
    match = TEMPORARY_NAME_RE.match(name) or _EARLIER_TEMPORARY_RE.match(name)
    if match is None or (pid is not None and int(match.group("pid")) != pid):
        return False
    base = match.group("name")
    if base in outputs or base in (MANIFEST_FILE, FOLDER_ID_FILE, EMBEDDED_MODEL_DIR):
        return True
    return _CHECKPOINT_NAME_RE.match(base) is not None


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "symlink"
    return "dir" if path.is_dir() else "file"


def _contents(folder: Path) -> list[str]:
    """Names in ``folder`` other than the lock file and the folder id (sorted); [] when it does not exist."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, FOLDER_ID_FILE))


def _present(folder: Path) -> set[str]:
    """The names in ``folder``, read once: a manifest may list many names that are gone (no stat for each)."""
    return set(os.listdir(folder)) if folder.is_dir() else set()


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder tree (``rmtree`` does not follow links). A
    checkpoint folder, or one set aside while it was deleted or replaced, loses only what its ``checkpoint.json``
    lists, and only when it holds nothing else (``strays``); else it is kept, with a warning."""
    match = TEMPORARY_NAME_RE.match(path.name)
    base = match.group("name") if match is not None else path.name
    if _CHECKPOINT_NAME_RE.match(base) and not (match is not None and path.name.rsplit(".", 1)[1].startswith("tmp")):
        found = strays(path)
        if found:
            logger.warning(
                "kept %s: it is not only what the trainer wrote there (%s)", path, ", ".join(found[:6]) or "a link"
            )
            return
        remove_checkpoint_files(path)
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


# adopt(folder) -> {name: kind}: a run of an earlier dppo-train (no manifest) recognised by its outputs'
# contents, or RunError saying why the folder is not one.
Adopt = Callable[[Path], dict[str, str]]


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
        self._found = set(_contents(path))  # what was there when the lock was taken
        self._had_id = (path / FOLDER_ID_FILE).exists() or (path / FOLDER_ID_FILE).is_symlink()

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, *exc) -> None:
        try:
            if not self.committed:
                self.rollback()
            else:  # the sizes and hashes of what the run wrote: what a later --overwrite may delete
                seal_outputs(self.path)
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
            _check_listed_kinds(folder, outputs)
            unproven = _unproven_files(folder)
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
            present = _present(folder)
            for name in doomed:
                path = folder / name
                if name in present:
                    _remove(path)
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
        for name in sorted(_contents(folder)):
            if _is_temporary(name, known) and name not in keep:
                logger.info("removing %s, left behind by an interrupted run", folder / name)
                _remove(folder / name)
        write_manifest(folder, STARTED, {**outputs, **dict(record)})
        self.committed = True

    def record(self, name: str, kind: str) -> None:
        """``record_output`` in this folder (after ``commit``)."""
        record_output(self.path, name, kind)

    def rollback(self) -> None:
        """Undo what opening and setting up wrote: the folder is left as ``open_run_folder`` found it."""
        folder = self.path
        pid = os.getpid()
        for name in set(_contents(folder)) - self._found:
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


def _unproven_files(folder: Path) -> list[str]:
    """The files ``folder``'s manifest lists that are there but are not provably what the run wrote: their size or
    SHA-256 differs from the manifest's record, or it has none (a format-1 manifest, a run killed before its end)."""
    manifest = read_manifest(folder) or {"outputs": {}, "files": {}}
    unproven = []
    present = _present(folder)
    for name, kind in sorted(manifest["outputs"].items()):
        if name not in present:
            continue
        path = folder / name
        if kind == "file" and (path.exists() or path.is_symlink()):
            if not matches_record(path, manifest["files"].get(name)):
                unproven.append(name)
    return unproven


def _refuse_a_borrowed_manifest(folder: Path, manifest: Mapping) -> None:
    """A manifest written for another folder (copied here, or this folder is a copy) speaks for nothing in it."""
    if manifest.get("format", 1) >= 2 and not speaks_for(manifest, folder):
        written_for = manifest.get("folder", {}).get("path", "another folder")
        raise RunError(
            f"--overwrite: {str(folder / MANIFEST_FILE)!r} was written for the folder {written_for!r} (run "
            f"{manifest.get('run_id', '?')}), not for {str(folder)!r} (a copied manifest, or a copy of that folder), "
            "so it speaks for nothing here and nothing in it is the trainer's to delete; nothing was changed. Delete "
            "what you do not want in it yourself, or pass another --out"
        )


def _check_listed_checkpoints(folder: Path, outputs: Mapping[str, str]) -> None:
    """Refuse to delete a listed checkpoint that holds more than its ``checkpoint.json`` lists (an eval script's
    results put inside it) or a file of it changed since: those are not the trainer's, and the new run writes a
    checkpoint of that name again."""
    present = _present(folder)
    for name, kind in sorted(outputs.items()):
        if name not in present:
            continue
        path = folder / name
        if kind != "dir" or not _CHECKPOINT_NAME_RE.match(name) or path.is_symlink() or not path.is_dir():
            continue
        found = strays(path)
        if found:
            shown = "no readable checkpoint.json" if found == ["."] else _shown(found)
            raise RunError(
                f"--overwrite: {str(path)!r} holds what dppo-train did not write there ({shown}: not in its "
                "checkpoint.json, or changed since), so it is not the trainer's to delete, and the new run would "
                "write a checkpoint of that name again; nothing was changed. Move what is yours out of the folder "
                "(or the whole checkpoint), or pass another --out"
            )


def _check_listed_kinds(folder: Path, outputs: Mapping[str, str]) -> None:
    """Refuse to delete a listed name that now holds something else than what the trainer wrote there."""
    present = _present(folder)
    for name, kind in sorted(outputs.items()):
        if name not in present:
            continue
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
    folder: Path,
    *,
    resume: bool,
    overwrite: bool,
    adopt: Adopt | None,
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
        what = (
            "--overwrite deletes only what that record lists"
            if overwrite
            else "--resume continues only a run recorded there"
            if resume
            else "a fresh run needs an empty folder"
        )
        raise RunError(
            f"--out {str(folder)!r} is not empty (it holds {_shown(names)}) and has no {MANIFEST_FILE}, the record of "
            f"what dppo-train wrote there, so nothing in it is the trainer's to replace or delete; {what}. Nothing "
            "was changed. Pass an empty or new --out (or, if nothing in the folder is yours, delete it yourself)"
        )
    outputs = dict(manifest["outputs"])
    if resume:
        if manifest["state"] == SETUP and outputs:
            raise RunError(
                f"--resume: the run in {str(folder)!r} was being replaced when it was interrupted (its {MANIFEST_FILE} "
                f"is in state {SETUP!r} and still lists {_shown(sorted(outputs))}: an --overwrite that did not "
                "finish), so there is nothing to continue; nothing was changed. Pass --overwrite again to finish "
                "deleting what that run wrote and start over"
            )
        if manifest["state"] == SETUP:
            raise RunError(
                f"--resume: the run in {str(folder)!r} never started training (its {MANIFEST_FILE} is in state "
                f"{SETUP!r}: a run killed during its set-up, or an --overwrite of it that was interrupted), so there "
                "is nothing to continue; nothing was changed. Start it again without --resume"
            )
        return "resume", outputs, False, []
    if overwrite:
        _refuse_a_borrowed_manifest(folder, manifest)
        _check_listed_kinds(folder, outputs)
        _check_listed_checkpoints(folder, outputs)
        kept_in_the_way = [name for name in _unproven_files(folder) if name in _REWRITTEN]
        if kept_in_the_way:
            raise RunError(
                f"--overwrite: {_shown(kept_in_the_way)} in {str(folder)!r} is not what the previous run wrote there "
                f"(its size or SHA-256 differs from {MANIFEST_FILE}'s record, or the manifest has none: written by an "
                "earlier dppo-train or by a run that was killed), so it is not the trainer's to delete, and the new "
                "run would overwrite it; nothing was changed. Move it out of the folder (or delete it yourself), or "
                "pass another --out"
            )
        return "overwrite", outputs, False, []
    others = [n for n in names if n != MANIFEST_FILE and n not in outputs and not _is_temporary(n, outputs)]
    ours = manifest.get("format", 1) < 2 or speaks_for(manifest, folder)
    if manifest["state"] == SETUP and not outputs and not others and ours:
        # what a run killed during its setup left: nothing a run produced, only temporaries
        return "fresh", {}, False, [n for n in names if n != MANIFEST_FILE]
    if manifest["state"] == SETUP and outputs:
        raise RunError(
            f"--out {str(folder)!r} holds what is left of an --overwrite that was interrupted (its {MANIFEST_FILE} is "
            f"in state {SETUP!r} and still lists {_shown(sorted(outputs))}, each with the size and SHA-256 the run "
            "wrote): pass --overwrite again to finish deleting them and start over (files it did not write stay), "
            "or another --out"
        )
    raise RunError(
        f"--out {str(folder)!r} already holds a run (its {MANIFEST_FILE} lists "
        f"{_shown(sorted(outputs)) or 'nothing'}): pass --resume to continue it, --overwrite to delete what it wrote "
        "and start over (files it did not write stay), or another --out"
    )


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
        mode, outputs, adopted, leftovers = _plan(folder, resume=resume, overwrite=overwrite, adopt=adopt)
        run.mode, run.outputs, run.adopted = mode, outputs, adopted
        if mode == "fresh":
            for name in leftovers:
                logger.info("removing %s, left by a run killed during its setup", folder / name)
                _remove(folder / name)
            run._manifest_created = not (folder / MANIFEST_FILE).exists()
            write_manifest(folder, SETUP, {}, new_run=True)
    except BaseException:
        run.rollback()
        raise
    return run


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

"""Whether a run may use ``--out`` and what opening it does, decided before anything in the folder changes
(docs/run_folder.md): ``plan_opening`` (a fresh run, ``--resume``, ``--overwrite``, or the leftovers of a run killed
during its set-up), the refusals of ``--overwrite`` (a listed name replaced since, a checkpoint holding what the
trainer did not write there, a file that is not provably the previous run's) and ``check_out_apart`` (``--out`` apart
from ``--model``, ``--data`` and ``--eval-data``). The package's ``open_run_folder`` acts on the plan.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from dppo_ext.trainer.run_folder.files import (
    CHECKPOINT_NAME_RE,
    CHECKPOINT_RECORD,
    CONFIG_FILE,
    EMBEDDED_MODEL_DIR,
    INPUTS_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    TEMPORARY_NAME_RE,
    RunError,
)
from dppo_ext.trainer.run_folder.lock import LOCK_FILE
from dppo_ext.trainer.run_folder.manifest import (
    FOLDER_ID_FILE,
    MANIFEST_FILE,
    SETUP,
    folder_records,
    matches_record,
    output_strays,
    read_manifest,
    speaks_for,
)

__all__ = [
    "CHECKPOINT_NAME_RE",
    "Adopt",
    "check_listed_kinds",
    "check_out_apart",
    "folder_contents",
    "is_temporary",
    "live_writer",
    "names_in",
    "plan_opening",
    "unproven_files",
]

# adopt(folder) -> {name: kind}: a run of an earlier dppo-train (no manifest) recognised by its outputs'
# contents, or RunError saying why the folder is not one.
Adopt = Callable[[Path], dict[str, str]]

# ``.tmp-<pid>-<name>``: the temporaries of dppo-train versions before the manifest.
_EARLIER_TEMPORARY_RE = re.compile(r"^\.tmp-(?P<pid>\d+)-(?P<name>.+)$")
# The files every run writes anew: one of them that --overwrite may not delete (not provably the previous run's)
# would be overwritten by the new run, so it is refused instead of kept.
_REWRITTEN = (CONFIG_FILE, INPUTS_FILE, METRICS_FILE, PLOT_FILE, SUMMARY_FILE)


def is_temporary(name: str, outputs: Mapping[str, str], pid: int | None = None) -> bool:
    """True for a temporary sibling of the manifest, a listed output, ``base_model`` or a checkpoint."""
    match = TEMPORARY_NAME_RE.match(name) or _EARLIER_TEMPORARY_RE.match(name)
    if match is None or (pid is not None and int(match.group("pid")) != pid):
        return False
    base = match.group("name")
    if base in outputs or base in (MANIFEST_FILE, FOLDER_ID_FILE, EMBEDDED_MODEL_DIR):
        return True
    return CHECKPOINT_NAME_RE.match(base) is not None


def live_writer(name: str) -> int | None:
    """The pid in the temporary name ``name`` when that process is still running and is not this one (a temporary
    it is still writing, never a dead writer's leftover), else None."""
    match = TEMPORARY_NAME_RE.match(name) or _EARLIER_TEMPORARY_RE.match(name)
    if match is None:
        return None
    pid = int(match.group("pid"))
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # running, as another user
        return pid
    except OSError:  # an out-of-range pid in the name: no such process
        return None
    return pid


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "symlink"
    return "dir" if path.is_dir() else "file"


def folder_contents(folder: Path) -> list[str]:
    """Names in ``folder`` other than the lock file and the folder id (sorted); [] when it does not exist."""
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name not in (LOCK_FILE, FOLDER_ID_FILE))


def names_in(folder: Path) -> set[str]:
    """The names in ``folder``, read once: a manifest may list many names that are gone (no stat for each)."""
    return set(os.listdir(folder)) if folder.is_dir() else set()


def _shown(names: list[str]) -> str:
    return ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")


def unproven_files(folder: Path) -> list[str]:
    """The files ``folder``'s manifest lists that are there but are not provably what the run wrote: their size or
    SHA-256 differs from the manifest's record, or it has none (a format-1 manifest, a run killed before its end)."""
    manifest = read_manifest(folder) or {"outputs": {}, "files": {}}
    unproven = []
    present = names_in(folder)
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


def _check_listed_folders(folder: Path, manifest: Mapping) -> None:
    """Refuse to delete a listed folder that holds more than the trainer recorded writing there (an eval script's
    results put inside a checkpoint, the user's notes in ``tensorboard/``) or a file of it changed since: those
    are not the trainer's, and the new run may write a folder of that name again."""
    present = names_in(folder)
    for name, kind in sorted(manifest["outputs"].items()):
        path = folder / name
        if name not in present or kind != "dir" or path.is_symlink() or not path.is_dir():
            continue
        found = output_strays(folder, name, manifest)
        if not found:
            continue
        checkpoint = CHECKPOINT_NAME_RE.match(name) is not None
        record = f"its {CHECKPOINT_RECORD}" if checkpoint else f"{MANIFEST_FILE}'s record of its files"
        shown = f"no readable {CHECKPOINT_RECORD}" if found == ["."] else _shown(found)
        unrecorded = (
            ""
            if checkpoint or folder_records(manifest, name)
            else ("; an earlier dppo-train, or a run killed before it ended, recorded none of its files")
        )
        raise RunError(
            f"--overwrite: {str(path)!r} holds what dppo-train did not write there ({shown}: not in {record}, or "
            f"changed since{unrecorded}), so it is not the trainer's to delete, and the new run may write a folder "
            "of that name again; nothing was changed. Move what is yours out of it (or the whole folder), or pass "
            "another --out"
        )


def check_listed_kinds(folder: Path, outputs: Mapping[str, str]) -> None:
    """Refuse to delete a listed name that now holds something else than what the trainer wrote there."""
    present = names_in(folder)
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


def plan_opening(
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
    names = folder_contents(folder)
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
        check_listed_kinds(folder, outputs)
        _check_listed_folders(folder, manifest)
        kept_in_the_way = [name for name in unproven_files(folder) if name in _REWRITTEN]
        if kept_in_the_way:
            raise RunError(
                f"--overwrite: {_shown(kept_in_the_way)} in {str(folder)!r} is not what the previous run wrote there "
                f"(its size or SHA-256 differs from {MANIFEST_FILE}'s record, or the manifest has none: written by an "
                "earlier dppo-train or by a run that was killed), so it is not the trainer's to delete, and the new "
                "run would overwrite it; nothing was changed. Move it out of the folder (or delete it yourself), or "
                "pass another --out"
            )
        return "overwrite", outputs, False, []
    others = [n for n in names if n != MANIFEST_FILE and n not in outputs and not is_temporary(n, outputs)]
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

"""The run manifest ``dppo-run.json``: every file and folder the trainer created in ``--out``, the run's state, the
run's id, the identity of the folder it was written for and each written file's size and SHA-256 (its format and
rules: docs/run_folder.md, "The run manifest"). Reading and writing it, recording an output before it is created or
dropping one once it is deleted, and sealing the files' hashes when the run ends are all here."""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_ext._version import __version__
from dppo_ext.trainer.run_folder.files import CHECKPOINT_NAME_RE, RunError, atomic_write_text, read_json_object, strays
from dppo_ext.trainer.run_folder.lock import LOCK_FILE

MANIFEST_FILE = "dppo-run.json"
MANIFEST_FORMAT = 2  # 1: names only (no run id, folder identity or hashes), still read
_FORMATS = (1, MANIFEST_FORMAT)
KINDS = ("file", "dir")
SETUP, STARTED = "setup", "started"
FOLDER_ID_FILE = ".dppo-run-id"  # the folder's random id, that its manifest records (folder_id)


def folder_id(folder: str | Path, *, create: bool = False) -> str | None:
    """The random id stored in ``folder`` (``.dppo-run-id``) when its first manifest was written, or None (created
    first with ``create``). It stays with the folder through a rename, a move or a copy of the whole folder; a
    manifest copied alone into another folder finds another id there, or none."""
    path = Path(folder) / FOLDER_ID_FILE
    try:
        value = path.read_text(encoding="ascii").strip()
    except (OSError, ValueError):
        value = None
    if value is not None and re.fullmatch(r"[0-9a-f]{32}", value):
        return value
    if not create or path.is_symlink() or (path.exists() and not path.is_file()):
        return None
    value = uuid.uuid4().hex
    atomic_write_text(path, value + "\n")
    return value


def folder_identity(folder: str | Path) -> dict[str, Any]:
    """``folder``'s identity as a manifest records it: its id (:func:`folder_id`, created when missing) and its
    resolved path when the manifest was written (for the messages only: a renamed folder is still the same)."""
    return {"id": folder_id(folder, create=True), "path": os.path.realpath(folder)}


def file_record(path: str | Path) -> dict[str, Any]:
    """``{"size", "sha256"}`` of the regular file ``path`` (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def matches_record(path: Path, record: Mapping[str, Any] | None) -> bool:
    """True when ``path`` is a regular file (no link) whose size and SHA-256 are still ``record``'s."""
    if record is None or path.is_symlink() or not path.is_file():
        return False
    if path.stat().st_size != record.get("size"):
        return False
    return file_record(path)["sha256"] == record.get("sha256")


def speaks_for(manifest: Mapping[str, Any], folder: str | Path) -> bool:
    """True when ``manifest`` was written for ``folder`` itself (the folder id it records is ``folder``'s), not
    copied there from another folder."""
    recorded = manifest.get("folder")
    if not isinstance(recorded, dict):
        return False
    here = folder_id(folder)
    return here is not None and recorded.get("id") == here


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The run manifest of ``folder`` (``{"format", "writer", "run_id", "folder", "state", "outputs", "files"}``; a
    format-1 manifest has no ``run_id``, ``folder`` or ``files``), or None when it has none.

    Raises:
        RunError: the manifest is unreadable, or lists a name that is not a plain entry of ``folder``.
    """
    path = Path(folder) / MANIFEST_FILE
    if not path.exists() and not path.is_symlink():
        return None
    try:
        if path.is_symlink() or not path.is_file():
            raise ValueError("not a regular file")
        data = read_json_object(path)
        if data.get("format") not in _FORMATS:
            raise ValueError(f"expected a JSON object of format {' or '.join(map(str, _FORMATS))}")
        if data.get("state") not in (SETUP, STARTED):
            raise ValueError(f"state must be {SETUP!r} or {STARTED!r}, got {data.get('state')!r}")
        outputs = data.get("outputs")
        if not isinstance(outputs, dict):
            raise ValueError("'outputs' must be an object")
        for name, kind in outputs.items():
            # a hand-edited manifest must not reach outside the folder or name the bookkeeping files
            if name in ("", ".", "..", MANIFEST_FILE, LOCK_FILE, FOLDER_ID_FILE) or "/" in name or "\0" in name:
                raise ValueError(f"output name {name!r} is not a plain name in the folder")
            if kind not in KINDS:
                raise ValueError(f"output {name!r} has kind {kind!r}, expected one of {list(KINDS)}")
        files = data.setdefault("files", {})
        if not isinstance(files, dict) or any(
            not isinstance(r, dict) or not isinstance(r.get("size"), int) or not isinstance(r.get("sha256"), str)
            for r in files.values()
        ):
            raise ValueError('\'files\' must map names to {"size": int, "sha256": str}')
    except (OSError, ValueError) as err:
        raise RunError(
            f"{str(path)!r} is unreadable ({err}): it is the record of what dppo-train wrote in {str(path.parent)!r}, "
            "so nothing there can be reused or deleted safely; nothing was changed. Restore the file, or pass another "
            "--out"
        ) from None
    return data


def write_manifest(
    folder: Path,
    state: str,
    outputs: Mapping[str, str],
    *,
    files: Mapping[str, Mapping[str, Any]] | None = None,
    new_run: bool = False,
) -> None:
    """Write the manifest of ``folder`` atomically: its ``state``, its ``outputs`` (``{name: kind}``), this folder's
    identity, the run id (kept from the manifest there unless ``new_run``) and ``files`` (``{name: file_record}``;
    default: the records there, of the names still listed as files)."""
    previous = None if new_run else _readable(folder)
    run_id = (previous or {}).get("run_id") or uuid.uuid4().hex
    if files is None:
        files = (previous or {}).get("files", {}) if previous is not None and speaks_for(previous, folder) else {}
    manifest = {
        "format": MANIFEST_FORMAT,
        "writer": f"dppo-train {__version__}",
        "run_id": run_id,
        "folder": folder_identity(folder),
        "state": state,
        "outputs": dict(sorted(outputs.items())),
        "files": {name: dict(files[name]) for name in sorted(files) if _records_an_output(name, outputs)},
    }
    atomic_write_text(folder / MANIFEST_FILE, json.dumps(manifest, indent=1) + "\n")


def _records_an_output(key: str, outputs: Mapping[str, str]) -> bool:
    """True for a record the manifest keeps: a listed file's (``name``) or a file's in a listed folder that is not
    a checkpoint (``name/relative/path``; a checkpoint records its own files in its ``checkpoint.json``)."""
    top, _, rest = key.partition("/")
    if not rest:
        return outputs.get(key) == "file"
    return outputs.get(top) == "dir" and not CHECKPOINT_NAME_RE.match(top)


def folder_records(manifest: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``{relative path: {"size", "sha256"}}``: the manifest's record of the files in its listed folder ``name``."""
    prefix = name + "/"
    return {key[len(prefix) :]: record for key, record in manifest.get("files", {}).items() if key.startswith(prefix)}


def output_strays(folder: Path, name: str, manifest: Mapping[str, Any]) -> list[str]:
    """``strays`` of the listed folder ``name``: against its ``checkpoint.json`` for a checkpoint, else against
    the manifest's record of its files (none recorded: every file in it is a stray)."""
    path = folder / name
    if CHECKPOINT_NAME_RE.match(name):
        return strays(path)
    return strays(path, folder_records(manifest, name))


def _tree_records(folder: Path, name: str, skip: set[str]) -> dict[str, dict[str, Any]]:
    """``{name/relative path: file_record}`` of every regular file under ``folder / name`` (links neither followed
    nor recorded), except the keys in ``skip``."""
    root = folder / name
    found = {}
    if root.is_symlink() or not root.is_dir():
        return found
    for base, _dirs, names in os.walk(root):  # links to folders are listed in _dirs, never entered
        for entry in names:
            path = Path(base) / entry
            key = f"{name}/{path.relative_to(root).as_posix()}"
            if key not in skip and not path.is_symlink() and path.is_file():
                found[key] = file_record(path)
    return found


def foreign_files(folder: str | Path) -> set[str]:
    """The files (``name/relative path``) in ``folder``'s listed folders (checkpoints aside) that its manifest
    does not record as written by the trainer (put there by someone else, or by an earlier dppo-train that
    recorded none): ``seal_outputs`` never records them as the run's."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return set()
    foreign = set()
    for name, kind in manifest["outputs"].items():
        if kind == "dir" and not CHECKPOINT_NAME_RE.match(name):
            foreign |= {f"{name}/{rel}" for rel in output_strays(folder, name, manifest) if rel != "."}
    return foreign


def _readable(folder: Path) -> dict[str, Any] | None:
    try:
        return read_manifest(folder)
    except RunError:
        return None


def seal_outputs(folder: str | Path, foreign: set[str] = frozenset()) -> None:
    """Record the size and SHA-256 of every file ``folder``'s manifest lists, and of every file in the folders it
    lists (checkpoints aside: theirs are in their ``checkpoint.json``), when the run ends and once a folder is
    written: what ``--overwrite`` may later delete is only what still matches. ``foreign``: files in those folders
    that were not the run's when it started (``foreign_files``), never recorded. No-op without a manifest."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        return
    files = {}
    for name, kind in manifest["outputs"].items():
        path = folder / name
        if kind == "file" and path.is_file() and not path.is_symlink():
            files[name] = file_record(path)
        elif kind == "dir" and not CHECKPOINT_NAME_RE.match(name):
            files.update(_tree_records(folder, name, set(foreign)))
    write_manifest(folder, manifest["state"], manifest["outputs"], files=files)


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
    write_manifest(folder, manifest["state"], {**manifest["outputs"], name: kind})


def forget_output(folder: str | Path, name: str) -> None:
    """Drop ``name`` from ``folder``'s manifest once it is deleted (no-op without a manifest)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or name not in manifest["outputs"]:
        return
    write_manifest(folder, manifest["state"], {k: v for k, v in manifest["outputs"].items() if k != name})

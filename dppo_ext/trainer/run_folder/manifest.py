"""The run manifest ``dppo-run.json``: every file and folder the trainer created in ``--out`` and the run's state
(its format and rules: docs/run_folder.md, "The run manifest"). Reading and writing it, and recording an output
before it is created or dropping one once it is deleted, are all here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dppo_ext._version import __version__
from dppo_ext.trainer.run_folder.files import RunError, atomic_write_text
from dppo_ext.trainer.run_folder.lock import LOCK_FILE

MANIFEST_FILE = "dppo-run.json"
MANIFEST_FORMAT = 1
KINDS = ("file", "dir")
SETUP, STARTED = "setup", "started"


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


def write_manifest(folder: Path, state: str, outputs: Mapping[str, str]) -> None:
    """Write the manifest of ``folder`` atomically: its ``state`` and its ``outputs`` (``{name: kind}``)."""
    manifest = {
        "format": MANIFEST_FORMAT,
        "writer": f"dppo-train {__version__}",
        "state": state,
        "outputs": dict(sorted(outputs.items())),
    }
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
    write_manifest(folder, manifest["state"], {**manifest["outputs"], name: kind})


def forget_output(folder: str | Path, name: str) -> None:
    """Drop ``name`` from ``folder``'s manifest once it is deleted (no-op without a manifest)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None or name not in manifest["outputs"]:
        return
    write_manifest(folder, manifest["state"], {k: v for k, v in manifest["outputs"].items() if k != name})

"""Checkpoints: model + tokenizer (``save_pretrained``), optimizer, RNG states and step.

Layout in the run folder ``<out>``::

    checkpoint-<step>/      one per save, <step> = completed RL steps
        model/              save_pretrained folder (loads with from_pretrained and with vLLM)
        trainer_state.pt    {"step", "optimizer", "rng", "sampler", "elapsed_s"}
        checkpoint.json     {"format", "step", "run_id", "files": {relative path: {"bytes", "sha256"}}}

A checkpoint is written into a hidden temporary folder (``.checkpoint-<step>.tmp-<pid>``),
every file and folder is fsynced, ``checkpoint.json`` is written last, and only then is the
folder renamed to ``checkpoint-<step>``: a folder with that name is complete. Older checkpoints
are deleted (``save_total_limit``) only after the new one is in place. In a run folder each
``checkpoint-<step>`` is recorded in the run manifest (``dppo_ext.trainer.run_folder.manifest``) before it is
renamed into place and dropped from it once deleted, and ``checkpoint.json`` records the run's id: the rotation
and ``--overwrite`` delete only a checkpoint the manifest lists, and of it only the files its ``checkpoint.json``
lists with their size and SHA-256 (a file put inside it, a link, a folder replaced by a file or a link is kept,
and the rotation then keeps that checkpoint whole). ``--resume`` takes the newest one, refuses one that this run
did not write, and first checks every file against ``checkpoint.json`` (size, then SHA-256), so a truncated or
corrupt file is reported by name instead of being loaded.

Folders of the earlier single-checkpoint layout (``checkpoint/``, and ``checkpoint.old/`` /
``checkpoint.tmp/`` left by a crash during its swap) are still found by ``--resume``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dppo_ext.trainer.run_folder.files import (
    CHECKPOINT_RECORD,
    RunError,
    fsync_dir,
    read_json_object,
    remove_checkpoint_files,
    strays,
    temporary_sibling,
)
from dppo_ext.trainer.run_folder.manifest import forget_output, read_manifest, record_output

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"
CHECKPOINT_PREFIX = "checkpoint-"
CHECKPOINT_RECORD_FORMAT = 1  # of CHECKPOINT_RECORD (the run folder's manifest has its own)
LEGACY_DIRS = ("checkpoint", "checkpoint.tmp", "checkpoint.old")
STATE_KEYS = ("step", "optimizer", "rng", "sampler", "elapsed_s")
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RunError):
    """A checkpoint (or model folder) cannot be used; the message names the file and the problem."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """``--resume`` found no checkpoint to continue from."""


def rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global RNGs (CPU and CUDA)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by ``rng_state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_path(out_dir: str | Path, step: int) -> Path:
    """``<out_dir>/checkpoint-<step>``."""
    return Path(out_dir) / f"{CHECKPOINT_PREFIX}{step}"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-<step>`` folder in ``out_dir``, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for path in out_dir.iterdir():
        match = _CHECKPOINT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(
    out_dir: str | Path,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    step: int,
    sampler: dict[str, Any],
    elapsed_s: float,
    save_total_limit: int = 0,
) -> Path:
    """Write ``<out_dir>/checkpoint-<step>`` (the state after ``step`` completed steps) atomically.

    Args:
        out_dir: the run folder.
        save_total_limit: keep only the newest N ``checkpoint-*`` folders (0 keeps all); older
            ones are deleted only once the new one is complete.

    Returns:
        The new checkpoint folder.
    """
    out_dir = Path(out_dir)
    final = checkpoint_path(out_dir, step)
    run = read_manifest(out_dir)  # None outside a run folder
    if os.path.lexists(final) and not _is_ours(final, run):
        raise RunError(
            f"{str(final)!r} is in the way of the checkpoint of step {step}: it is not a checkpoint this run wrote "
            f"(not in {out_dir.name}'s dppo-run.json, or not only the files of its {CHECKPOINT_RECORD}), so it is not "
            "the trainer's to replace; nothing of it was changed. Move it out of the folder, then --resume"
        )
    tmp = temporary_sibling(final)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / MODEL_DIR)
    tokenizer.save_pretrained(tmp / MODEL_DIR)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
            "sampler": sampler,
            "elapsed_s": elapsed_s,
        },
        tmp / STATE_FILE,
    )
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path, fsync=True)}
    record = {"format": CHECKPOINT_RECORD_FORMAT, "step": step, "run_id": (run or {}).get("run_id"), "files": files}
    with open(tmp / CHECKPOINT_RECORD, "w", encoding="utf-8") as handle:
        json.dump(record, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for folder in sorted((p for p in tmp.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(folder)
    fsync_dir(tmp)
    replaced = None
    if final.exists():  # the same step saved again: keep the old copy until the new one is in place
        replaced = temporary_sibling(final, "replaced")
        os.rename(final, replaced)
    record_output(out_dir, final.name, "dir")  # in the run manifest before it exists (no-op outside a run folder)
    os.rename(tmp, final)
    fsync_dir(out_dir)
    if replaced is not None:
        remove_checkpoint_files(replaced)
    logger.info("checkpoint at step %d written to %s", step, final)
    if save_total_limit:
        run = read_manifest(out_dir)
        ours = [path for _, path in list_checkpoints(out_dir) if path == final or _is_ours(path, run, warn=True)]
        for old in ours[:-save_total_limit]:
            if old != final:
                _delete_checkpoint(old)
    return final


def _is_ours(path: Path, run: dict[str, Any] | None, *, warn: bool = False) -> bool:
    """Whether ``path`` is a checkpoint folder this run wrote, whole: listed in the run manifest ``run`` (when there
    is one) and holding exactly the files of its ``checkpoint.json`` (``strays``); ``warn``: say why not."""
    if run is not None and run["outputs"].get(path.name) != "dir":
        why = "it is not in the run's dppo-run.json"
    elif path.is_symlink():
        why = "it is a link (to a checkpoint moved elsewhere?)"
    else:
        found = strays(path)
        if not found:
            return True
        why = f"it holds what its {CHECKPOINT_RECORD} does not list: {', '.join(found[:6])}"
    if warn:
        logger.warning("--save-total-limit: kept %s, which the rotation does not delete: %s", path, why)
    return False


def _delete_checkpoint(path: Path) -> None:
    """Rename out of the ``checkpoint-<step>`` namespace first, so a half-deleted folder is never found; then delete
    what its ``checkpoint.json`` lists (``remove_checkpoint_files``), and drop it from the run manifest."""
    doomed = temporary_sibling(path, "deleting")
    os.rename(path, doomed)
    fsync_dir(path.parent)
    remove_checkpoint_files(doomed)
    forget_output(path.parent, path.name)
    logger.info("deleted old checkpoint %s", path)


def _sha256(path: Path, *, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def has_checkpoint(path: str | Path) -> bool:
    """True when ``path`` looks like a complete checkpoint (its checkpoint.json, or the earlier layout's files)."""
    path = Path(path)
    if (path / CHECKPOINT_RECORD).is_file():
        return True
    return (path / STATE_FILE).is_file() and (path / MODEL_DIR / "config.json").is_file()


def verify_checkpoint(path: str | Path, *, legacy: bool = False) -> None:
    """Check a checkpoint folder's files; raise ``CheckpointError`` naming the first bad file.

    Every file listed in ``checkpoint.json`` must exist with the recorded size and SHA-256. A
    folder of the earlier layout (``legacy=True``) has no such record: its model's safetensors files
    must be readable and ``trainer_state.pt`` must load.
    """
    path = Path(path)
    record_path = path / CHECKPOINT_RECORD
    if not record_path.is_file():
        if not legacy or not has_checkpoint(path):
            raise CheckpointError(
                f"{str(path)!r} is not a complete checkpoint: it has no {CHECKPOINT_RECORD} (its save did not finish)"
            )
        check_model_folder(path / MODEL_DIR)
        load_trainer_state(path)
        return
    try:
        files = read_json_object(record_path)["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{str(record_path)!r} is corrupt ({err}); the checkpoint cannot be verified") from None
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{str(file)!r} is missing from the checkpoint (listed in {CHECKPOINT_RECORD})")
        size = file.stat().st_size
        if size != expected["bytes"]:
            problem = "truncated" if size < expected["bytes"] else "longer than saved"
            raise CheckpointError(
                f"{str(file)!r} is {problem}: {size} bytes, the checkpoint recorded {expected['bytes']}"
            )
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(
                f"{str(file)!r} is corrupt: its content differs from the SHA-256 recorded when the checkpoint was saved"
            )


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` dict of a checkpoint folder (model weights load from ``path/model``)."""
    path = Path(path)
    if not has_checkpoint(path):
        raise NoCheckpointError(f"no complete checkpoint in {str(path)!r} (expected {MODEL_DIR}/ and {STATE_FILE})")
    file = path / STATE_FILE
    try:
        state = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as err:  # torch.load raises RuntimeError, EOFError, UnpicklingError, ... on bad bytes
        raise CheckpointError(
            f"{str(file)!r} cannot be read: it is truncated or corrupt ({type(err).__name__}: {err})"
        ) from None
    missing = [key for key in STATE_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise CheckpointError(f"{str(file)!r} is not a dppo-train trainer state: missing {missing}")
    return state


def check_model_folder(folder: str | Path, *, what: str = "model folder") -> None:
    """Raise ``CheckpointError`` unless ``folder`` holds a model whose safetensors files are readable.

    A model folder needs ``config.json`` and weights (``*.safetensors`` or ``*.bin``, or their
    ``.index.json``); every safetensors file must have a valid header that matches its size.
    """
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise CheckpointError(
            f"{what} {str(folder)!r} holds no model: no config.json (expected a save_pretrained folder)"
        )
    weights = [
        p
        for p in folder.iterdir()
        if p.name.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
    ]
    if not weights:
        raise CheckpointError(
            f"{what} {str(folder)!r} holds no model weights (no *.safetensors or *.bin file next to config.json)"
        )
    for file in sorted(p for p in weights if p.name.endswith(".safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises SafetensorError / OSError with the header problem
            raise CheckpointError(f"{str(file)!r}: corrupt or truncated safetensors weights ({err})") from None


def checkpoint_step(path: str | Path) -> int:
    """The step a complete checkpoint folder was saved at (its ``checkpoint.json``, else its trainer state)."""
    path = Path(path)
    record = path / CHECKPOINT_RECORD
    if record.is_file():
        try:
            return int(read_json_object(record)["step"])
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{str(record)!r} is corrupt ({err}); the checkpoint cannot be used") from None
    return int(load_trainer_state(path)["step"])


def find_resume_checkpoint(out_dir: str | Path) -> Path:
    """The checkpoint ``--resume`` continues from: the newest ``checkpoint-<step>``, verified.

    Falls back to the earlier layout (``checkpoint/``, ``checkpoint.tmp/``, ``checkpoint.old/``:
    the one with the highest step that loads). Raises ``NoCheckpointError`` when there is none
    and ``CheckpointError`` when the newest one is damaged (naming the file, and the previous
    checkpoint to fall back to).
    """
    out_dir = Path(out_dir)
    checkpoints = list_checkpoints(out_dir)
    if checkpoints:
        step, newest = checkpoints[-1]
        try:
            verify_checkpoint(newest)
        except CheckpointError as err:
            hint = (
                f"move {newest.name} out of {str(out_dir)!r} to resume from {checkpoints[-2][1].name} instead"
                if len(checkpoints) > 1
                else "no older checkpoint is left; pass --overwrite to start over"
            )
            raise CheckpointError(f"--resume: the newest checkpoint is damaged: {err}; {hint}") from None
        return newest
    legacy = []
    for name in LEGACY_DIRS:
        path = out_dir / name
        if has_checkpoint(path):
            try:
                verify_checkpoint(path, legacy=True)
                legacy.append((int(load_trainer_state(path)["step"]), path))
            except CheckpointError as err:
                logger.warning("--resume: skipping %s of the earlier checkpoint layout: %s", path, err)
    if legacy:
        step, path = max(legacy, key=lambda item: item[0])
        logger.warning(
            "--resume: %s uses the earlier single-checkpoint layout (step %d); new checkpoints are written as "
            "checkpoint-<step>/ and the old folder is left in place",
            path,
            step,
        )
        return path
    raise NoCheckpointError(
        f"--resume: no complete checkpoint in {str(out_dir)!r} (looked for {CHECKPOINT_PREFIX}<step>/ and "
        f"{', '.join(n + '/' for n in LEGACY_DIRS)}); the run stopped before its first save. Pass --overwrite "
        "to start over, or run without --resume into another --out"
    )

"""Runs of a dppo-train older than the run manifest: their outputs recognised by content, so that
``--resume`` can record them in a new manifest and continue (``legacy_run_outputs``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from dppo_ext.trainer.checkpoint import CHECKPOINT_PREFIX, LEGACY_DIRS, checkpoint_step, has_checkpoint
from dppo_ext.trainer.checkpoint import MANIFEST_FILE as CHECKPOINT_MANIFEST
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.embedded_model import WARM_START_MARKER
from dppo_ext.trainer.errors import RunError
from dppo_ext.trainer.metrics import DROPPED_FILE, MetricsFormatError, read_metrics
from dppo_ext.trainer.reporting import TENSORBOARD_DIR
from dppo_ext.trainer.run_files import (
    CONFIG_FILE,
    INPUTS_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    json_object_or_none,
)
from dppo_ext.trainer.run_folder import EMBEDDED_MODEL_DIR

# Settings every dppo-train version wrote into config.json: with only known settings besides, the file is one.
_CONFIG_CORE = ("model", "data", "loss", "steps", "seed", "out")


def _is_train_config(path: Path) -> bool:
    data = json_object_or_none(path)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return data is not None and set(_CONFIG_CORE) <= data.keys() <= known


def _is_metrics_file(path: Path) -> bool:
    try:
        read_metrics(path, allow_truncated_tail=True)
    except (OSError, MetricsFormatError):
        return False
    return True


def _is_checkpoint_of_its_step(path: Path) -> bool:
    try:
        step = int(path.name[len(CHECKPOINT_PREFIX) :])
        return (path / CHECKPOINT_MANIFEST).is_file() and checkpoint_step(path) == step
    except (RunError, ValueError):
        return False


# name: (kind, content check, what dppo-train writes there, whether a resumed run writes, reads or deletes it)
_LEGACY_OUTPUTS: dict[str, tuple[str, Any, str, bool]] = {
    CONFIG_FILE: ("file", _is_train_config, "its settings (a JSON object of dppo-train settings)", True),
    INPUTS_FILE: (
        "file",
        lambda p: (
            (d := json_object_or_none(p)) is not None and all(isinstance(v, dict) and "sha256" in v for v in d.values())
        ),
        "the data files' SHA-256",
        True,
    ),
    SUMMARY_FILE: (
        "file",
        lambda p: (d := json_object_or_none(p)) is not None and {"loss", "steps"} <= d.keys(),
        "the run's summary (a JSON object with 'loss' and 'steps')",
        True,
    ),
    METRICS_FILE: ("file", _is_metrics_file, "one JSON record per line, each with an integer 'step'", True),
    DROPPED_FILE: ("file", _is_metrics_file, "one JSON record per line, each with an integer 'step'", True),
    PLOT_FILE: ("file", lambda p: p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "a PNG plot", True),
    TENSORBOARD_DIR: (
        "dir",
        lambda p: all(f.name.startswith("events.out.tfevents.") for f in p.rglob("*") if f.is_file()),
        "TensorBoard event files only",
        True,
    ),
    EMBEDDED_MODEL_DIR: (
        "dir",
        lambda p: (p / WARM_START_MARKER).is_file(),
        f"the embedded model with its {WARM_START_MARKER}",
        False,
    ),
    **{name: ("dir", has_checkpoint, "a checkpoint of the earlier layout", False) for name in LEGACY_DIRS},
}
_LEGACY_CHECKPOINT = ("dir", _is_checkpoint_of_its_step, "a complete checkpoint with its checkpoint.json", True)


def legacy_run_outputs(out_dir: Path) -> dict[str, str]:
    """``{name: kind}`` of what a dppo-train older than the run manifest wrote in ``out_dir``, each
    recognised by its content (``--resume`` of such a run records them in its new manifest).

    The folder is such a run only when its ``config.json`` is a dppo-train config: a JSON object
    whose keys are all settings of ``TrainConfig`` and include those every version wrote. Then an
    entry with the name of one of that trainer's outputs is adopted when it holds what the trainer
    writes there (a ``checkpoint-<step>/`` folder a ``checkpoint.json`` of that step, ``metrics.jsonl``
    records, ...). One that does not is the user's: refused when the resumed run would write, read
    or delete it (``config.json``, ``summary.json``, ``metrics.*``, ``inputs.json``, ``tensorboard/``,
    ``checkpoint-<step>/``), else left out (``base_model/``, the earlier ``checkpoint/`` folders).
    Every other entry is not adopted either, and stays untouched.

    Raises:
        RunError: the folder is not such a run, or one of those names holds something else (named);
            nothing is changed.
    """
    config = out_dir / CONFIG_FILE
    if config.is_symlink() or not config.is_file() or not _is_train_config(config):
        why = "has no config.json" if not config.exists() else "its config.json is not a dppo-train config"
        raise RunError(
            f"--resume: --out {str(out_dir)!r} has no dppo-run.json (the record of what dppo-train wrote there) and is "
            f"not a run of an earlier dppo-train either ({why}): nothing was changed; pass the --out of a run"
        )
    adopted = {}
    for path in sorted(out_dir.iterdir()):
        name = path.name
        if name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX) :].isdigit():
            kind, check, what, used = _LEGACY_CHECKPOINT
        elif name in _LEGACY_OUTPUTS:
            kind, check, what, used = _LEGACY_OUTPUTS[name]
        else:
            continue
        if not path.is_symlink() and path.is_dir() == (kind == "dir") and check(path):
            adopted[name] = kind
        elif used:
            raise RunError(
                f"--resume: --out {str(out_dir)!r} is a run of a dppo-train older than the run manifest, but "
                f"{str(path)!r} is not what that trainer writes there ({kind}: {what}), and the resumed run would "
                "use it; nothing was changed. Move it out of the folder and resume again"
            )
    return adopted

"""What ``--resume`` checks before it continues a run: the newest complete checkpoint and its step, the
same settings as the run's ``config.json`` and the same data files as its ``inputs.json`` (their
SHA-256, written when the run started: ``data_fingerprints``); and, for a run of a dppo-train older than
the run manifest, which of its files that trainer wrote, recognised by content (``legacy_run_outputs``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path
from typing import Any

from dppo_ext.trainer.checkpoint import (
    CHECKPOINT_PREFIX,
    LEGACY_DIRS,
    checkpoint_step,
    find_resume_checkpoint,
    has_checkpoint,
)
from dppo_ext.trainer.config import TrainConfig, flag_name
from dppo_ext.trainer.embedded_model import WARM_START_MARKER
from dppo_ext.trainer.losses import canonical_loss
from dppo_ext.trainer.metrics import DROPPED_FILE, MetricsFormatError, read_metrics
from dppo_ext.trainer.reporting import TENSORBOARD_DIR
from dppo_ext.trainer.run_folder.files import (
    CHECKPOINT_RECORD,
    CONFIG_FILE,
    EMBEDDED_MODEL_DIR,
    INPUTS_FILE,
    METRICS_FILE,
    PLOT_FILE,
    SUMMARY_FILE,
    RunError,
    json_object_or_none,
    read_json_object,
)
from dppo_ext.trainer.run_folder.manifest import MANIFEST_FILE, read_manifest

logger = logging.getLogger(__name__)


# Settings a resumed run may change: how long it runs and how it is saved or executed, not what it trains.
RESUME_MAY_CHANGE = (
    "steps",
    "save_every",
    "save_total_limit",
    "threads",
    "device",
    "vllm_gpu_memory_utilization",
    "out",
    "resume",
    "overwrite",
    "report_to",
    "log_level",
    "verbose",
    "mechanism_metrics",
    "sync_check",
)


def resume_config_changes(saved: dict, config: TrainConfig) -> list[str]:
    """``--flag old -> new`` for every setting of ``config`` that differs from the run's saved
    ``config.json`` (``saved``) and may not change on resume (see ``RESUME_MAY_CHANGE``).

    Keys that the saved config lacks (settings added since) or that this version does not know
    are not compared.
    """
    current = config.to_dict()

    def same(name: str) -> bool:
        if name == "loss" and isinstance(saved[name], str):  # an alias names the same loss (dppo_tv = dppo_binary_tv)
            return canonical_loss(saved[name]) == canonical_loss(current[name])
        return saved[name] == current[name]

    return [
        f"--{flag_name(name)} {saved[name]!r} -> {current[name]!r}"
        for name in current
        if name in saved and name not in RESUME_MAY_CHANGE and not same(name)
    ]


def check_resume_config(out_dir: Path, config: TrainConfig) -> None:
    """Refuse to resume with settings that differ from the run's ``config.json`` (what it trains)."""
    path = out_dir / CONFIG_FILE
    manifest = read_manifest(out_dir)
    if not path.is_file() and manifest is not None and manifest["outputs"].get(CONFIG_FILE) == "file":
        raise RunError(
            f"--resume: {str(path)!r}, where the run recorded its settings when it started, is missing, so whether "
            "this command trains the same run cannot be checked; nothing was changed. Restore the file (from a copy "
            "of the run folder), or pass --overwrite to start over"
        )
    if not path.is_file():  # a run of an earlier dppo-train that never wrote one
        logger.warning("--resume: %s is missing; the settings cannot be compared with the original run's", path)
    else:
        changes = resume_config_changes(_read_json_object(path), config)
        if changes:
            raise RunError(
                f"--resume: settings differ from the run's {path}: {'; '.join(changes)}. A resumed run continues with "
                "its original settings: pass the same flags (only --steps, --save-every, --save-total-limit, "
                "--threads, --device and --vllm-gpu-memory-utilization may change), or --overwrite to start over"
            )
    inputs_path = out_dir / INPUTS_FILE
    if not inputs_path.is_file() and manifest is not None and manifest["outputs"].get(INPUTS_FILE) == "file":
        raise RunError(
            f"--resume: {str(inputs_path)!r}, where the run recorded the SHA-256 of its --data and --eval-data when it "
            "started, is missing, so whether they changed since cannot be checked (a resumed run must see the same "
            "problems); nothing was changed. Restore the file (from a copy of the run folder), or pass --overwrite to "
            "start over with the data as it is now"
        )
    if inputs_path.is_file():
        saved_inputs = _read_json_object(inputs_path)
        for flag, now in data_fingerprints(config).items():
            before = saved_inputs.get(flag)
            if before is not None and before["sha256"] != now["sha256"]:
                raise RunError(
                    f"--resume: --{flag.replace('_', '-')} {now['path']!r} changed since the run started (its SHA-256 "
                    f"differs from the one in {inputs_path}); a resumed run must see the same problems: restore "
                    "the file, or pass --overwrite to start over"
                )


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        return read_json_object(path)
    except ValueError as err:
        raise RunError(f"{path}: unreadable ({err}); the resumed run cannot be checked against it") from None


def data_fingerprints(config: TrainConfig) -> dict[str, dict[str, str]]:
    """``{flag: {"path", "sha256"}}`` of the ``--data`` / ``--eval-data`` files of ``config``."""
    fingerprints = {}
    for flag in ("data", "eval_data"):
        path = getattr(config, flag)
        if path:
            fingerprints[flag] = {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    return fingerprints


def check_written_by_this_run(out_dir: Path, checkpoint_dir: Path) -> None:
    """Refuse a checkpoint that the run recorded in ``out_dir`` did not write: one its manifest does not list (copied
    in from another run, or put there by hand), or whose ``checkpoint.json`` names another run's id. A run of an
    earlier dppo-train without a manifest is checked by content instead (``legacy_run_outputs``)."""
    manifest = read_manifest(out_dir)
    if manifest is None:
        return
    listed = manifest["outputs"].get(checkpoint_dir.name) == "dir"
    record = json_object_or_none(checkpoint_dir / CHECKPOINT_RECORD) or {}
    written_by = record.get("run_id")
    if listed and (written_by is None or manifest.get("run_id") in (None, written_by)):
        return
    why = (
        f"it is not in the run's {MANIFEST_FILE}"
        if not listed
        else f"its {CHECKPOINT_RECORD} names run {written_by}, and this folder holds run {manifest.get('run_id')}"
    )
    raise RunError(
        f"--resume: the newest checkpoint {str(checkpoint_dir)!r} was not written by the run in {str(out_dir)!r} "
        f"({why}: a checkpoint copied from another run?), so the run would continue from weights it never trained; "
        "nothing was changed. Move it out of the folder to resume from this run's own newest checkpoint, or pass "
        "--overwrite to start over"
    )


def resume_point(config: TrainConfig, out_dir: Path) -> tuple[Path, int]:
    """The checkpoint ``--resume`` continues from and its step; refuse a ``--steps`` below that step."""
    checkpoint_dir = find_resume_checkpoint(out_dir)
    check_written_by_this_run(out_dir, checkpoint_dir)
    check_resume_config(out_dir, config)
    step = checkpoint_step(checkpoint_dir)
    if config.steps < step:
        raise RunError(
            f"--resume --steps {config.steps}: the newest checkpoint {str(checkpoint_dir)!r} is already at step "
            f"{step}, and a resumed run cannot go back; nothing was changed. Pass --steps {step} or more to continue "
            f"it (--steps {step}: nothing to train), or --overwrite to train {config.steps} steps from the start"
        )
    return checkpoint_dir, step


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
        return (path / CHECKPOINT_RECORD).is_file() and checkpoint_step(path) == step
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

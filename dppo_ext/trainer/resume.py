"""What ``--resume`` checks before it continues a run: the newest complete checkpoint and its step, the
same settings as the run's ``config.json`` and the same data files as its ``inputs.json`` (their
SHA-256, written when the run started: ``data_fingerprints``)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from dppo_ext.trainer.checkpoint import checkpoint_step, find_resume_checkpoint
from dppo_ext.trainer.config import TrainConfig, resume_config_changes
from dppo_ext.trainer.errors import RunError
from dppo_ext.trainer.run_files import CONFIG_FILE, INPUTS_FILE

logger = logging.getLogger("dppo_ext.train")  # the CLI's logger: a run's messages keep one logger name


def check_resume_config(out_dir: Path, config: TrainConfig) -> None:
    """Refuse to resume with settings that differ from the run's ``config.json`` (what it trains)."""
    path = out_dir / CONFIG_FILE
    if not path.is_file():
        logger.warning("--resume: %s is missing; the settings cannot be compared with the original run's", path)
        return
    saved = _read_json_object(path)
    changes = resume_config_changes(saved, config)
    if changes:
        raise RunError(
            f"--resume: settings differ from the run's {path}: {'; '.join(changes)}. A resumed run continues with "
            "its original settings: pass the same flags (only --steps, --save-every, --save-total-limit, --threads, "
            "--device and --vllm-gpu-memory-utilization may change), or --overwrite to start over"
        )
    inputs_path = out_dir / INPUTS_FILE
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
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    except ValueError as err:
        raise RunError(f"{path}: unreadable ({err}); the resumed run cannot be checked against it") from None
    return data


def data_fingerprints(config: TrainConfig) -> dict[str, dict[str, str]]:
    """``{flag: {"path", "sha256"}}`` of the ``--data`` / ``--eval-data`` files of ``config``."""
    fingerprints = {}
    for flag in ("data", "eval_data"):
        path = getattr(config, flag)
        if path:
            fingerprints[flag] = {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    return fingerprints


def resume_point(config: TrainConfig, out_dir: Path) -> tuple[Path, int]:
    """The checkpoint ``--resume`` continues from and its step; refuse a ``--steps`` below that step."""
    checkpoint_dir = find_resume_checkpoint(out_dir)
    check_resume_config(out_dir, config)
    step = checkpoint_step(checkpoint_dir)
    if config.steps < step:
        raise RunError(
            f"--resume --steps {config.steps}: the newest checkpoint {str(checkpoint_dir)!r} is already at step "
            f"{step}, and a resumed run cannot go back; nothing was changed. Pass --steps {step} or more to continue "
            f"it (--steps {step}: nothing to train), or --overwrite to train {config.steps} steps from the start"
        )
    return checkpoint_dir, step

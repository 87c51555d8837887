"""The embedded model (no ``--model``): the tiny model, warm-started with a short supervised fine-tune on
the task's ``sft`` problems and saved with its settings in ``warm_start.json``, so that a folder built
with the same settings is reused and any other is rebuilt."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from dppo_ext.models.sft import WarmStartConfig, supervised_warm_start
from dppo_ext.models.tiny import TinyModelConfig, build_tiny_model, tiny_heads
from dppo_ext.tasks import Task
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.run_folder.files import atomic_write_text, fsync_dir, install_folder, temporary_sibling

logger = logging.getLogger(__name__)

WARM_START_MARKER = "warm_start.json"


def warm_start_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings that make the embedded model's warm start (recorded in its ``warm_start.json``)."""
    names = (
        "tiny_layers",
        "tiny_hidden",
        "tiny_vocab_size",
        "warm_start_steps",
        "warm_start_problems",
        "warm_start_lr",
        "warm_start_label_smoothing",
        "max_operand",
        "max_second_operand",
        "num_eval",
        "seed",
    )
    return {name: getattr(config, name) for name in names}


def warm_start_matches(folder: str | Path, config: TrainConfig) -> bool:
    """True when ``folder`` holds an embedded model warm-started with ``config``'s settings."""
    marker = Path(folder) / WARM_START_MARKER
    try:
        return marker.is_file() and json.loads(marker.read_text()).get("settings") == warm_start_settings(config)
    except (OSError, ValueError, AttributeError):
        return False


def build_embedded_model(folder: Path, config: TrainConfig, task: Task) -> Path:
    """Build the tiny model and warm-start it on ``task.sft`` into the new folder ``folder``.

    ``folder`` is a normal ``save_pretrained`` model + tokenizer with ``warm_start.json`` (the
    settings, final loss, seconds) written last. An interrupted build (an error or Ctrl-C) removes
    the folder; one killed outright leaves it without ``warm_start.json``, never reusable.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder.exists():
        shutil.rmtree(folder)
    try:
        heads = tiny_heads(config.tiny_hidden)
        build_tiny_model(
            folder,
            config=TinyModelConfig(hidden_size=config.tiny_hidden, num_layers=config.tiny_layers, num_heads=heads),
            seed=config.seed,
            vocab_size=config.tiny_vocab_size,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        start = time.perf_counter()
        logger.info("supervised warm start: %d steps on %d problems", config.warm_start_steps, len(task.sft))
        losses = supervised_warm_start(
            model,
            tokenizer,
            task.sft,
            WarmStartConfig(
                steps=config.warm_start_steps,
                lr=config.warm_start_lr,
                label_smoothing=config.warm_start_label_smoothing,
                seed=config.seed,
            ),
        )
        model.save_pretrained(folder)
        seconds = time.perf_counter() - start
        atomic_write_text(
            folder / WARM_START_MARKER,
            json.dumps(
                {
                    "settings": warm_start_settings(config),
                    "final_loss": losses[-1] if losses else None,
                    "seconds": seconds,
                },
                indent=2,
            ),
        )
        fsync_dir(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    logger.info("warm start done in %.1f s (final loss %s)", seconds, f"{losses[-1]:.4f}" if losses else "n/a")
    return folder


def prepare_embedded_model(folder: Path, config: TrainConfig, task: Task) -> Path:
    """The warm-started embedded model in ``folder``: reused when its ``warm_start.json`` records
    ``config``'s settings, else built (``build_embedded_model``) in a temporary sibling that replaces
    ``folder`` only when complete, so an interrupted build never leaves a folder that looks reusable."""
    if warm_start_matches(folder, config):
        logger.info("reusing the warm-started embedded model in %s", folder)
        return folder
    built = build_embedded_model(temporary_sibling(folder), config, task)
    if folder.exists():
        logger.warning("rebuilding %s: it was built with other settings (%s)", folder, folder / WARM_START_MARKER)
    return install_folder(built, folder)

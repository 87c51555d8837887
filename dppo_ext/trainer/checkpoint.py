"""Checkpoints: model + tokenizer (``save_pretrained``), optimizer, RNG states and step.

Layout of ``<out>/checkpoint``::

    model/              save_pretrained folder (loads with from_pretrained and with vLLM)
    trainer_state.pt    {"step", "optimizer", "rng", "sampler", "elapsed_s"}

A checkpoint is written to a temporary sibling folder and renamed into place, so an
interrupted save never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
MODEL_DIR = "model"


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


def save_checkpoint(
    path: str | Path,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    step: int,
    sampler: dict[str, Any],
    elapsed_s: float,
) -> Path:
    """Write a checkpoint of the state after ``step`` completed steps to ``path`` (replaced atomically)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / MODEL_DIR)
    tokenizer.save_pretrained(tmp / MODEL_DIR)
    torch.save(
        {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "sampler": sampler, "elapsed_s": elapsed_s},
        tmp / STATE_FILE,
    )
    old = path.with_name(path.name + ".old")
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)
    logger.info("checkpoint at step %d written to %s", step, path)
    return path


def has_checkpoint(path: str | Path) -> bool:
    """True when ``path`` holds a complete checkpoint."""
    path = Path(path)
    return (path / STATE_FILE).is_file() and (path / MODEL_DIR / "config.json").is_file()


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """The ``trainer_state.pt`` dict of a checkpoint (model weights load from ``path/model``)."""
    path = Path(path)
    if not has_checkpoint(path):
        raise FileNotFoundError(f"no complete checkpoint in {str(path)!r} (expected {MODEL_DIR}/ and {STATE_FILE})")
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)

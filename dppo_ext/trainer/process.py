"""The process a run lives in: the global RNGs' seed, the device, the thread count (and OpenMP's wait
policy, which must be set before OpenMP loads), and how much vLLM and transformers say."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from dppo_ext.rollout.vllm_logging import quiet_vllm_logging, verbose_vllm_logging
from dppo_ext.trainer.config import TrainConfig


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_threads(threads: int) -> int:
    """``--threads``: a positive count as given; 0 = the CPUs this process may run on."""
    if threads > 0:
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def restart_with_passive_omp_waits(config: TrainConfig) -> None:
    """Restart the CLI once with ``OMP_WAIT_POLICY=PASSIVE`` when it will run more than one thread.

    OpenMP's default lets idle threads spin; on a CPU shared with other work a spinning thread holds a
    core that the thread it waits for needs, and the tiny model's forward/backward ran ~10x slower on 2
    threads than on 1 on this project's 2-core machine under load, while with passive waits 2 threads
    were ~2x faster than 1. The setting is read when OpenMP loads (with torch), hence the restart; a
    value already in the environment is kept.
    """
    if resolve_threads(config.threads) <= 1 or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "dppo_ext.train", *sys.argv[1:]])


def set_library_verbosity(*, verbose: bool) -> None:
    """Quiet (default) or verbose vLLM and transformers.

    Quiet: vLLM at WARNING without the warnings known to be benign here
    (``dppo_ext.rollout.vllm_logging``), no transformers / Hugging Face Hub progress bars.
    Verbose: vLLM at INFO with every warning, transformers at INFO, progress bars on.
    """
    from transformers.utils import logging as hf_logging

    if verbose:
        verbose_vllm_logging()
        hf_logging.set_verbosity_info()
        hf_logging.enable_progress_bar()
    else:
        quiet_vllm_logging()
        hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return
    (enable_progress_bars if verbose else disable_progress_bars)()

"""Quiet vLLM for a training loop: its start-up INFO lines and the warnings that are known to be benign.

vLLM logs about 30 INFO lines and a dozen warnings while an in-process engine starts, and on every in-place weight
reload one ``<layer class>: Failed to load weights`` per layer that received no tensor. For a layer whose own
tensors are all buffers that no checkpoint holds (a rotary layer's ``cos_sin_cache``, Gemma's embedding
``normalizer``) that is right, and vLLM puts the old buffers back, which do not depend on the weights. Between
progress-bar updates it reads like a failure. :func:`quiet_vllm_logging` lowers vLLM to warnings and drops the
messages listed in :data:`BENIGN_VLLM_WARNINGS`; every other vLLM warning still shows.
:func:`verbose_vllm_logging` undoes it.

The reload warning is dropped by what it is about, not by class name: the weight-sync plan
(``dppo_ext.rollout.weight_sync``) records, from the loaded vLLM model, the layer classes that hold buffers and no
parameter of their own (:func:`note_buffer_only_layers`), and only their warning is dropped. A layer with
parameters that got no tensor (a tied LM head left out of a sync, say) still warns; the sync plan refuses such a
sync before it starts anyway.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable

__all__ = ["BENIGN_VLLM_WARNINGS", "note_buffer_only_layers", "quiet_vllm_logging", "verbose_vllm_logging"]

# Layer classes of loaded vLLM models whose own tensors are all buffers (note_buffer_only_layers).
_buffer_only_layers: set[str] = set()


def note_buffer_only_layers(class_names: Iterable[str]) -> None:
    """Record vLLM layer classes that hold buffers and no parameter of their own: a reload gives them no tensor
    and keeps their buffers, so their ``Failed to load weights`` warning is benign."""
    _buffer_only_layers.update(class_names)


def _is_buffer_only_layer(class_name: str) -> bool:
    return class_name in _buffer_only_layers


# (logger, message template as vLLM passes it to the logger, first argument (a value, a test of it, or None for
# any), why it is benign here).
BENIGN_VLLM_WARNINGS: tuple[tuple[str, str, str | Callable[[str], bool] | None, str], ...] = (
    (
        "vllm.model_executor.model_loader.reload.layerwise",
        "%s: Failed to load weights",
        _is_buffer_only_layer,
        "the layer holds only buffers no checkpoint has (rotary cos/sin cache, an embedding normalizer); vLLM keeps "
        "the old ones, which do not depend on the weights",
    ),
    (
        "vllm.model_executor.models.utils",
        "Attempted to load weight %s with dtype %s into parameter with dtype",
        None,
        "the engine runs in the rollout dtype asked for (bf16 rollouts of an fp32 model): vLLM rounds the fp32 "
        "checkpoint to it when it starts; weight syncs hand it weights already in that dtype",
    ),
    (
        "vllm.engine.arg_utils",
        "The global random seed is set to",
        None,
        "the trainer seeds its RNGs after the engine has started",
    ),
    ("vllm.config.vllm", "Enforce eager set", None, "eager mode is the engine's choice on CPU"),
    ("vllm.config.vllm", "Inductor compilation was disabled", None, "follows from eager mode"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton", None, "CPU platform fact, nothing to do"),
    ("vllm.platforms.cpu", "Triton is not installed", None, "CPU platform fact, nothing to do"),
    (
        "vllm.triton_utils.importing",
        "Triton is installed, but doesn't include CPU backend",
        None,
        "CPU platform fact, nothing to do",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads`",
        None,
        "the engine restores torch's thread count itself after start-up",
    ),
    (
        "vllm.v1.worker.cpu_worker",
        "%s is not found in LD_PRELOAD",
        "libtcmalloc",
        "performance hint (--verbose shows it)",
    ),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD", "libiomp", "performance hint (--verbose shows it)"),
)


class _BenignFilter(logging.Filter):
    """Drops the records of one logger that match one of its (template, first argument) pairs."""

    def __init__(self, entries: list[tuple[str, str | Callable[[str], bool] | None]]) -> None:
        super().__init__()
        self.entries = entries

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else str(record.msg)
        for template, first_arg in self.entries:
            if not message.startswith(template):
                continue
            if first_arg is None:
                return False
            args = record.args if isinstance(record.args, tuple) else ()
            if args and (first_arg(str(args[0])) if callable(first_arg) else str(args[0]) == first_arg):
                return False
        return True


_installed: dict[str, _BenignFilter] = {}
_verbose = False
_env_level_set_here: str | None = None


def _set_level_env(level: str) -> None:
    """Set ``VLLM_LOGGING_LEVEL`` unless the user set it (a value this module set may be replaced)."""
    global _env_level_set_here
    current = os.environ.get("VLLM_LOGGING_LEVEL")
    if current is None or current == _env_level_set_here:
        os.environ["VLLM_LOGGING_LEVEL"] = _env_level_set_here = level


def quiet_vllm_logging() -> None:
    """vLLM at WARNING (unless ``VLLM_LOGGING_LEVEL`` is set) minus the benign warnings; idempotent.

    Call it before vLLM is imported or an engine is created: vLLM reads ``VLLM_LOGGING_LEVEL`` when it configures
    its loggers.
    """
    global _verbose
    _verbose = False
    _set_level_env("WARNING")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    install_benign_warning_filters()
    # vLLM's Triton shim touches a deprecated torch.distributed alias while importing.
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.reduce_op` is deprecated",
        category=FutureWarning,
        module=r"vllm\.",
    )


def install_benign_warning_filters() -> None:
    """Only the :data:`BENIGN_VLLM_WARNINGS` filters (the weight-sync paths install them); idempotent, and a
    no-op after :func:`verbose_vllm_logging`."""
    if _verbose:
        return
    by_logger: dict[str, list[tuple[str, str | Callable[[str], bool] | None]]] = {}
    for name, template, first_arg, _why in BENIGN_VLLM_WARNINGS:
        by_logger.setdefault(name, []).append((template, first_arg))
    for name, entries in by_logger.items():
        if name not in _installed:
            _installed[name] = _BenignFilter(entries)
            logging.getLogger(name).addFilter(_installed[name])


def verbose_vllm_logging() -> None:
    """Undo :func:`quiet_vllm_logging`: vLLM at INFO (unless ``VLLM_LOGGING_LEVEL`` is set), no filters."""
    global _verbose
    _verbose = True
    _set_level_env("INFO")
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    for name, filt in _installed.items():
        logging.getLogger(name).removeFilter(filt)
    _installed.clear()

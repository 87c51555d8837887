"""Loads the native library ``dppo_ext._C`` (which registers ``torch.ops.dppo.*``) with errors a
user can act on: not built, built against another torch than the one loaded, or a bad
``DPPO_CPU_CAPABILITY``. Only the op modules import this; ``dppo_ext.reference``, the trainer's
config and the tasks work without the library.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import torch

__all__ = ["BUILD_COMMAND", "cuda_compiled", "library"]

BUILD_COMMAND = "pip install --no-build-isolation -e ."
_MARKER = re.compile(rb"dppo_ext-built-with-torch=([^\x00]+)\x00")


def _release(version: str) -> str:
    return version.split("+", 1)[0]


def _built_with(path: str) -> str | None:
    """The torch version recorded in the library file by bindings.cpp (readable without loading it)."""
    try:
        match = _MARKER.search(Path(path).read_bytes())
    except OSError:
        return None
    return match.group(1).decode(errors="replace") if match else None


def _rebuild_hint() -> str:
    return (
        f"Rebuild it against the torch you run (torch {torch.__version__}), from the dppo_ext source "
        f"folder: {BUILD_COMMAND}"
    )


def _load():
    spec = importlib.util.find_spec(f"{__package__}._C")
    if spec is None or spec.origin is None:
        folder = Path(__file__).resolve().parent
        raise ImportError(
            f"dppo_ext's native library dppo_ext._C is not built (no _C*.so in {folder}). "
            + _rebuild_hint().replace("Rebuild", "Build", 1)
        )
    try:
        lib = importlib.import_module(f"{__package__}._C")
    except ImportError as exc:
        if "DPPO_CPU_CAPABILITY" in str(exc):  # the library loaded, the requested instruction set is unusable
            raise ImportError(f"dppo_ext._C: {exc}") from None
        built = _built_with(spec.origin)
        if built is not None and built != torch.__version__:
            raise ImportError(
                f"dppo_ext._C ({spec.origin}) was built against torch {built}, but torch "
                f"{torch.__version__} is loaded, so it cannot be loaded ({exc}). " + _rebuild_hint()
            ) from None
        raise ImportError(f"dppo_ext._C ({spec.origin}) could not be loaded: {exc}. " + _rebuild_hint()) from exc
    if _release(lib.torch_version) != _release(torch.__version__):
        raise ImportError(
            f"dppo_ext._C ({spec.origin}) was built against torch {lib.torch_version}, but torch "
            f"{torch.__version__} is loaded; a C++ extension must be built against the torch it runs "
            "with (its ABI changes between releases). " + _rebuild_hint()
        )
    return lib


library = _load()
cuda_compiled: bool = library.cuda_compiled

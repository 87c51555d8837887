"""Loads the native library ``dppo_ext._C`` (which registers ``torch.ops.dppo.*``) with errors a
user can act on: not built, built against another torch than the one loaded, or a bad run-time switch
(``DPPO_CPU_CAPABILITY``, ``DPPO_CPU_BUFFER_CACHE``, ``DPPO_CPU_HUGEPAGES``). Only the op modules import
this; ``dppo_ext.reference``, the trainer's config and the tasks work without the library.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import torch

__all__ = ["BUILD_COMMAND", "cpu_cached_bytes", "cpu_capability", "cuda_compiled", "empty_cpu_cache", "library"]

BUILD_COMMAND = "pip install --no-build-isolation -e ."
_MARKER = re.compile(rb"dppo_ext-built-with-torch=([^\x00]+)\x00")
# Environment variables the library reads when it loads: a bad value fails the import with the library's message.
_SWITCHES = ("DPPO_CPU_CAPABILITY", "DPPO_CPU_BUFFER_CACHE", "DPPO_CPU_HUGEPAGES")


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
        if any(name in str(exc) for name in _SWITCHES):  # the library loaded, a switch's value is unusable
            message = str(exc).split("\nException raised from", 1)[0]  # c10's C++ source location is noise here
            raise ImportError(f"dppo_ext._C: {message}") from None
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
# The instruction set the CPU kernels run with ("default", "avx2" or "avx512"), chosen when the library loads
# (DPPO_CPU_CAPABILITY, else the widest this CPU and torch's dispatch allow; docs/development.md).
cpu_capability: str = library.cpu_capability


def empty_cpu_cache() -> int:
    """Return every idle block of the CPU backward's gradient buffer cache to the allocator; the bytes released.

    The CPU backward keeps up to two freed ``[N, V]`` gradient blocks resident for the next step (a fresh
    buffer's page faults cost more than the backward itself); a freed block that 8 later backward calls (of
    any size) do not take goes back by itself. Call this after a phase with large batches, before measuring
    memory, or to hand the memory to something else. ``DPPO_CPU_BUFFER_CACHE=0`` turns the cache off
    (docs/development.md). Gradients still alive are not touched; the block of one freed later is cached again.
    """
    return int(library.cpu_empty_cache())


def cpu_cached_bytes() -> int:
    """The bytes of idle gradient blocks the CPU backward's buffer cache holds now (what :func:`empty_cpu_cache`
    would release)."""
    return int(library.cpu_cached_bytes())

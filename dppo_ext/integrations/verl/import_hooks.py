"""Run a function on a module right after Python has executed it (a post-import hook).

The verl plugin is loaded at the end of ``import verl``, before the verl modules it changes exist; importing
them there would pull torch.distributed, the engines and vLLM into every process that imports verl. Instead
:func:`when_imported` registers the change, and a ``sys.meta_path`` finder applies it when (and in the process
where) verl imports that module, or at once when the module is already imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Callable

__all__ = ["when_imported"]

_lock = threading.Lock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the module's own loader, then runs the registered functions on the executed module."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with _lock:
            hooks = _pending.pop(self._name, [])
        for hook in hooks:
            hook(module)

    def __getattr__(self, name: str):  # get_source, get_filename, is_package, ... of the real loader
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


_finder = _Finder()


def when_imported(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Call ``hook(module)`` once the module ``name`` is imported (now, if it already is).

    ``hook`` must not raise: an exception would fail the import of the module it changes.
    """
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    with _lock:
        _pending.setdefault(name, []).append(hook)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)

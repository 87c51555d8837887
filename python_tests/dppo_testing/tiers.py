"""The two test tiers, held by the suite itself rather than by memory.

The quick tier (``./run.sh test``, ``-m "not slow"``) is what a developer runs between edits; a test that pays a
start-up cost of its own belongs to the slow tier (``@pytest.mark.slow``, run by ``./run.sh test-all`` and CI):

- it launches a Python process (a CLI run, an example, ``accelerate launch``, a wheel build, a sweep's workers,
  a ``multiprocessing`` child): each one imports torch again, seconds on two cores;
- it starts a vLLM engine of its own: the e2e tests share ONE session engine (``vllm_engine`` in
  python_tests/e2e/conftest.py), started under ``shared_start`` below; a test marked ``own_engine`` starts one on
  purpose (three architectures stand for the ten in the quick tier).

``watch(item)`` runs around every test's setup and call (python_tests/conftest.py) and records such starts; a test
not marked slow that made one fails with the commands it launched, so a new slow test cannot slip into the quick
tier unnoticed. Programs that are not Python (``uname``, a compiler run by torch.compile) are not counted: they
are cheap, and libraries start them lazily, so counting them would make the check depend on test order.
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_starts: list[str] | None = None  # what the running test started; None outside a watched phase
_shared = False  # inside the shared engine's start


def _is_python(argv) -> bool:
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = [argv]
    if not argv:
        return False
    prog = os.fsdecode(argv[0]).split()[0] if isinstance(argv[0], (str, bytes)) else os.fsdecode(argv[0])
    name = Path(prog).name
    return prog == sys.executable or name.startswith("python") or name in ("accelerate", "torchrun", "pip")


_engine_depth = 0  # inside a vLLM engine's start: what it launches (compile workers) is part of that start


def _record(what: str, *, engine: bool = False) -> None:
    if _starts is not None and not _shared and (engine or _engine_depth == 0):
        _starts.append(what)


# torch.compile's own helpers (inductor's compile workers and the probe that loads each compiled kernel in a child,
# which vLLM's compiled model triggers on its first steps) are part of compiling, not a process the test launched.
_TORCH_COMPILE_HELPERS = ("torchinductor", "torch._inductor")

_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _watched_popen_init(self, args, *rest, **kwargs):
    if _is_python(args):
        shown = os.fsdecode(args) if isinstance(args, (str, bytes)) else " ".join(os.fsdecode(a) for a in args)
        if not any(mark in shown for mark in _TORCH_COMPILE_HELPERS):
            _record(f"process: {shown[:200]}")
    return _popen_init(self, args, *rest, **kwargs)


def _watched_process_start(self):
    _record(f"multiprocessing child: {self.name}")
    return _process_start(self)


def _engine_init(cls):
    original = cls.__init__

    def init(self, *args, **kwargs):
        global _engine_depth
        _record(f"vLLM engine: {cls.__module__}.{cls.__qualname__}", engine=True)
        _engine_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _engine_depth -= 1

    init.__wrapped__ = original  # type: ignore[attr-defined]
    return init


def install() -> None:
    """Patch the process and engine constructors once per session (they record only inside ``watch``)."""
    subprocess.Popen.__init__ = _watched_popen_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = _watched_process_start  # type: ignore[method-assign]
    from dppo_ext.rollout.vllm_engine import VLLMEngine

    VLLMEngine.__init__ = _engine_init(VLLMEngine)  # type: ignore[method-assign]


def _watch_vllm_llm() -> None:
    """``vllm.LLM`` (TRL builds one itself) is patched once vllm has been imported by someone."""
    vllm = sys.modules.get("vllm")
    llm = getattr(vllm, "LLM", None) if vllm is not None else None
    if llm is not None and not hasattr(llm.__init__, "__wrapped__"):
        llm.__init__ = _engine_init(llm)


@contextlib.contextmanager
def shared_start() -> Iterator[None]:
    """The session's one shared engine starts inside this block: it is the quick tier's to pay."""
    global _shared
    _shared = True
    try:
        yield
    finally:
        _shared = False


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """Record the Python processes and vLLM engines started inside the block."""
    global _starts
    _watch_vllm_llm()
    _starts = []
    try:
        yield _starts
    finally:
        _starts = None


class QuickTierGuard:
    """The pytest plugin (registered by python_tests/conftest.py): fails a test not marked slow that started a
    Python process or a vLLM engine of its own in its setup or call."""

    @staticmethod
    def _held(item: pytest.Item):
        if item.get_closest_marker("slow") is not None:
            return (yield)
        with watch() as started:
            result = yield
        if item.get_closest_marker("own_engine") is not None:
            started = [what for what in started if not what.startswith("vLLM engine")]
        if started:
            listed = "\n  ".join(dict.fromkeys(started))
            pytest.fail(
                f"{item.nodeid} is not marked slow but started:\n  {listed}\nA test that launches a Python process "
                "or starts a vLLM engine of its own belongs to the slow tier: mark it @pytest.mark.slow "
                "(python_tests/dppo_testing/tiers.py), or use the shared session engine (vllm_engine).",
                pytrace=False,
            )
        return result

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        return (yield from self._held(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        return (yield from self._held(item))

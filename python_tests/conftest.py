"""pytest hooks for python_tests: skip ``needs_cuda`` tests cleanly where CUDA cannot run.

The shared helpers (input factory, tolerances) live in dppo_testing.py.
"""

from __future__ import annotations

import pytest

from dppo_testing import cuda_ready


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_cuda") is not None:
        ok, why = cuda_ready()
        if not ok:
            pytest.skip(why)

"""pytest hooks and shared fixtures of python_tests.

- ``needs_cuda`` tests skip cleanly where CUDA cannot run.
- The two tiers hold themselves: a test not marked ``slow`` that launches a Python process or starts a vLLM engine
  of its own fails, naming what it started (``dppo_testing.tiers``).
- ``tiny_model_dir``: a randomly initialised tiny Llama (hidden 128, 2 layers, 2 heads of 64, 17-token character
  vocabulary, ``max_position_embeddings=64``) and its tokenizer, written with ``save_pretrained`` into a session
  temp dir by ``dppo_ext.models.tiny.build_tiny_model`` (``from_pretrained`` and vLLM load it).

The shared helpers (input factory, tolerances) live in the ``dppo_testing`` package.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dppo_testing import cuda_ready, tiers


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the tiny model + tokenizer (``from_pretrained`` and vLLM load it)."""
    from dppo_ext.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_cuda") is not None:
        ok, why = cuda_ready()
        if not ok:
            pytest.skip(why)


def pytest_configure(config: pytest.Config) -> None:
    tiers.install()
    config.pluginmanager.register(tiers.QuickTierGuard(), "dppo-quick-tier-guard")

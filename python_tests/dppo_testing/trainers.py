"""A reference-trainer ``Trainer`` on the tiny model, for the trainer tests that drive its loop directly.

``hf_trainer(model_dir, out, **settings)``: the ``TrainConfig`` of ``settings`` (validated), the tiny model loaded
with ``from_pretrained`` in float32 (``torch.manual_seed(0)`` first), its tokenizer, the leading-digit task and the
HF rollout engine (float32, seed 0, ``max_model_len=64``), writing into ``out``. Each test file passes its own
settings; ``model_dir`` is the session fixture ``tiny_model_dir`` (python_tests/conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .tasks import leading_digit_task


def hf_trainer(model_dir: Path, out: Path, **settings: Any):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dppo_ext.rollout import make_engine
    from dppo_ext.trainer.config import TrainConfig
    from dppo_ext.trainer.loop import Trainer

    config = TrainConfig(out=str(out), engine="hf", **settings).validate()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine = make_engine("hf", str(model_dir), dtype="float32", seed=0, max_model_len=64, device="cpu")
    return Trainer(config, model, AutoTokenizer.from_pretrained(model_dir), leading_digit_task(), engine, out)

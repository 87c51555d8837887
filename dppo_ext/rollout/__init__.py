"""Rollout engines: vLLM (default when installed) and transformers ``generate`` (fallback)."""

from dppo_ext.rollout.base import (
    RolloutEngine,
    RolloutSample,
    force_sampled_into_topk,
    make_engine,
    vllm_available,
)

__all__ = [
    "RolloutEngine",
    "RolloutSample",
    "force_sampled_into_topk",
    "make_engine",
    "vllm_available",
]

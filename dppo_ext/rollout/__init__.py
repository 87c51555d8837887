"""Rollout engines (vLLM when installed, transformers ``generate`` otherwise) and the helpers that
turn vLLM's outputs into the DPPO op's tensors."""

from dppo_ext.rollout.base import RolloutEngine, RolloutSample, Truncation, force_sampled_into_topk
from dppo_ext.rollout.factory import make_engine, vllm_available
from dppo_ext.rollout.truncation import kept_ids_by_rule
from dppo_ext.rollout.vllm_outputs import (
    RolloutTensors,
    extract_token_logprobs,
    kept_sets,
    pack_rollout_samples,
    ranked_topk_rows,
    rollout_samples_from_vllm,
    vllm_rollout_tensors,
)

__all__ = [
    "RolloutEngine",
    "RolloutSample",
    "RolloutTensors",
    "Truncation",
    "extract_token_logprobs",
    "force_sampled_into_topk",
    "kept_ids_by_rule",
    "kept_sets",
    "make_engine",
    "pack_rollout_samples",
    "ranked_topk_rows",
    "rollout_samples_from_vllm",
    "vllm_available",
    "vllm_rollout_tensors",
]

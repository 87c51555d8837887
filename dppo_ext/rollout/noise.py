"""Rollout-side logit noise: a training-inference mismatch of a chosen size.

With ``logit_noise = sigma > 0`` an engine samples each response token from

    mu = softmax((z + sigma * eps) / T),    eps ~ N(0, I_V), fresh for every token,

where ``z`` are the model's logits, and reports ``log mu`` of the sampled token (and of its
top-K) as the rollout log-probs. The trainer scores ``pi = softmax(z / T)`` with the same
weights, so ``|pi - mu|`` is exactly the injected noise: it does not depend on the weights, the
precision or the update, and an importance weight ``pi / mu`` corrects it exactly in expectation.

The noise is added to the logits before the temperature, in the engine's sampling step, so the
reported ``mu`` is the distribution the token was drawn from (vLLM: a logits processor that runs
before temperature scaling, with ``logprobs_mode="processed_logprobs"``; transformers: a logits
processor, which ``generate`` runs before its temperature warper).

``eps`` is a function of the sample's seed and the token's position only, so a rollout is
reproducible whatever the batch it shares: the noise of response position ``t`` of the sample
seeded ``s`` is ``torch.randn(V, generator=torch.Generator().manual_seed(noise_key(s, t)))``.
Both engines seed sample ``j`` of prompt ``i`` with ``seed + i * n + j`` (vLLM's per-request seeds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dppo_ext.contract import MAX_LOGIT_NOISE

__all__ = ["NOISE_POSITIONS", "add_logit_noise", "check_logit_noise", "logit_noise", "noise_key"]

# Positions per sample seed in the key space: keys of different (seed, position) pairs never collide
# while the positions stay below it (a response is far shorter).
NOISE_POSITIONS = 1 << 16


def noise_key(sample_seed: int, position: int) -> int:
    """The torch seed of the noise at response position ``position`` (0-based) of the sample seeded ``sample_seed``."""
    if not 0 <= position < NOISE_POSITIONS:
        raise ValueError(f"position must be in [0, {NOISE_POSITIONS}), got {position}")
    return (int(sample_seed) * NOISE_POSITIONS + int(position)) % (1 << 63)


def logit_noise(sample_seed: int, position: int, vocab: int, sigma: float) -> torch.Tensor:
    """``sigma * eps``, ``[vocab]`` float32: the noise added to the logits of one token (see the module docstring)."""
    generator = torch.Generator(device="cpu").manual_seed(noise_key(sample_seed, position))
    return torch.randn(vocab, generator=generator, dtype=torch.float32).mul_(sigma)


def add_logit_noise(logits: torch.Tensor, rows: Sequence[tuple[int, int, int, float]]) -> torch.Tensor:
    """Add each listed row's noise to ``logits`` in place and return it.

    Args:
        logits: ``[R, V]`` logits of one decoding step (before temperature).
        rows: ``(row, sample_seed, position, sigma)`` for each row that gets noise.
    """
    vocab = logits.shape[-1]
    for row, sample_seed, position, sigma in rows:
        noise = logit_noise(sample_seed, position, vocab, sigma)
        logits[row] += noise.to(device=logits.device, dtype=logits.dtype)
    return logits


def check_logit_noise(logit_noise: float, seed: int | None) -> None:
    """Raise ``ValueError`` unless ``logit_noise`` is a finite sigma >= 0 (and a seed is given when it is > 0)."""
    if isinstance(logit_noise, bool) or not isinstance(logit_noise, (int, float)) or not math.isfinite(logit_noise):
        raise ValueError(
            f"logit_noise must be a finite number >= 0 (sigma of the rollout logit noise), got {logit_noise!r}"
        )
    if not 0 <= logit_noise <= MAX_LOGIT_NOISE:
        raise ValueError(
            f"logit_noise must be in [0, {MAX_LOGIT_NOISE:g}] (sigma of the rollout logit noise; more would overflow "
            f"the logits), got {logit_noise!r}"
        )
    if logit_noise > 0 and seed is None:
        raise ValueError(
            "logit_noise > 0 needs a seed: the noise of every token is drawn from the sample's seed (pass seed=...)"
        )

"""GRPO-style group advantages.

For a prompt sampled ``G`` times with rewards ``r_1..r_G``, every response of the group gets
``A_i = r_i - mean(r)`` and, with ``normalize_std``, ``A_i / (std(r) + eps)`` (the population
std, as in GRPO implementations that use ``unbiased=False``; Dr. GRPO drops the division). A
group whose rewards are all equal carries no signal: its advantages are exactly 0.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages.

    Args:
        rewards: [P, G] float, one row per prompt, one column per sample.
        normalize_std: divide by the group's population std plus ``eps``.
        eps: guard for the std division.

    Returns:
        [P, G] advantages (float32); rows with zero variance are exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [P, G] (prompts x group), got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group advantages need group size >= 2, got rewards of shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    rewards = rewards.to(torch.float32)
    std = rewards.std(dim=1, unbiased=False, keepdim=True)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centred = centred / (std + eps)
    # (r - mean) of equal floats can round to +-1 ulp; a constant group must give exactly 0.
    return torch.where(std == 0, torch.zeros_like(centred), centred)

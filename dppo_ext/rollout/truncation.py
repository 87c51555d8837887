"""The kept set of truncated sampling derived by rule from logits: the alternative to vLLM's recorded set.

vLLM samples with ``SamplingParams(top_k, top_p, min_p)`` from ``softmax(logits / T)`` truncated in this order
(vLLM v1's sampler: temperature, then min-p, then top-k, then top-p on what is left, renormalised):

* min-p keeps the tokens whose probability is at least ``min_p`` times the largest one;
* top-k keeps the tokens whose scaled logit is at least the k-th largest (ties with it are kept);
* top-p, on the distribution renormalised over what min-p and top-k kept, keeps the most likely tokens whose
  preceding mass (the mass of the tokens ranked strictly above them) is below ``top_p`` (the most likely always).

:func:`kept_ids_by_rule` applies the same rule to the trainer's logits. Where the trainer's logits / T equal the
engine's (same weights, same dtype) the two sets are the same except at a token whose probability ties the
boundary within rounding. They differ where the logits do: a bf16 engine against an fp32 trainer, an engine whose
weights lag (asynchronous RL), and every mini-batch after the first of a PPO epoch, whose policy has moved: there
the rule gives the set the *current* policy would keep, not the one the rollout sampled from, and the difference
is the tokens within the logit mismatch of the boundary (measured in docs/contract.md, "Truncated sampling").
Prefer vLLM's recorded set (:func:`dppo_ext.rollout.vllm_rollout_tensors` with ``sampling_params=``) wherever it
can be returned.

Cost: the rows go in chunks of ``ROW_CHUNK_BYTES`` (64 MiB) of float32 logits; per chunk one ``[rows, V]`` float32
copy of ``logits / T`` and the temporaries of one log-sum-exp over it (top-p renormalises over the vocabulary's
kept part), a top-(max_kept + 1) selection (a top-k selection when top_k > max_kept + 1), ``O(rows * V)`` time;
the result is ``[..., S]`` int64 with S <= ``max_kept``. No ``[N, V]`` tensor.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from dppo_ext.contract import sampling_truncation

__all__ = ["ROW_CHUNK_BYTES", "kept_ids_by_rule"]

# float32 bytes of one row chunk's scaled logits.
ROW_CHUNK_BYTES = 64 * 1024 * 1024


def kept_ids_by_rule(
    logits: torch.Tensor,
    temperature: float,
    top_k: Optional[int] = -1,
    top_p: float = 1.0,
    min_p: Optional[float] = 0.0,
    max_kept: int = 64,
) -> torch.Tensor:
    """The token ids that ``top_k`` / ``top_p`` / ``min_p`` sampling from ``softmax(logits / temperature)`` keeps.

    Args:
        logits: [..., V] raw logits (any float dtype; computed in float32, float64 for float64).
        temperature: T > 0.
        top_k, top_p, min_p: vLLM's ``SamplingParams`` values (-1, 0 or None: no top-k; 1: no top-p; 0 or None:
            no min-p). At least one must truncate.
        max_kept: the most tokens a kept set may hold (the width a caller can afford); a larger set raises.

    Returns:
        [..., S] int64 kept ids per position, most likely first, -1 padding; S is the largest kept set (<=
        ``max_kept``).
    """
    truncating = sampling_truncation(top_k, top_p, min_p)
    if not truncating:
        raise ValueError(
            f"top_k={top_k!r}, top_p={top_p!r}, min_p={min_p!r} do not truncate: every token is kept; the kept set is "
            "the whole vocabulary (pass no kept_ids)"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(max_kept, bool) or not isinstance(max_kept, int) or max_kept < 1:
        raise ValueError(f"max_kept must be an int >= 1, got {max_kept!r}")
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor [..., V], got {logits.dtype} {tuple(logits.shape)}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat = logits.reshape(-1, vocab)
    width = min(max_kept + 1, vocab)  # one more than may be kept: a kept (max_kept + 1)-th token shows an overflow
    k = top_k if top_k is not None and top_k > 0 else 0
    step = max(ROW_CHUNK_BYTES // (vocab * 4), 1)
    chunks = []
    for r0 in range(0, flat.shape[0], step):
        z = flat[r0 : r0 + step].to(compute) / temperature  # [rows, V], the one full-width temporary
        if not torch.isfinite(z).all():
            row = r0 + int((~torch.isfinite(z)).any(-1).nonzero()[0, 0])
            raise ValueError(f"logits row {row} holds a non-finite value; the kept set is undefined there")
        values, ids = z.topk(width, dim=-1)  # [rows, width], most likely first
        # min-p and top-k keep the tokens at or above one threshold per row
        threshold = torch.full_like(values[:, :1], -math.inf)
        if min_p:  # p >= min_p * p_max  <=>  z >= z_max + log(min_p)
            threshold = torch.maximum(threshold, values[:, :1] + math.log(min_p))
        if k:
            kth = values[:, k - 1 : k] if k <= width else z.topk(k, dim=-1).values[:, -1:]
            threshold = torch.maximum(threshold, kth)
        keep = values >= threshold
        if top_p < 1:
            # top-p on the distribution renormalised over what min-p / top-k kept: its log-sum-exp over the vocabulary
            lse = z.masked_fill_(z < threshold, -math.inf).logsumexp(-1, keepdim=True)
            probs = torch.where(keep, (values - lse).exp(), 0.0)
            above = probs.cumsum(-1) - probs  # the mass ranked strictly above each candidate
            keep &= above < top_p
        # each rule keeps a prefix of the ranking: the set overflows when its (max_kept + 1)-th candidate is kept
        if width > max_kept and bool(keep[:, max_kept].any()):
            row = r0 + int(keep[:, max_kept].nonzero()[0, 0])
            raise ValueError(
                f"logits row {row}: the kept set of {truncating} at temperature {temperature} holds more than "
                f"max_kept={max_kept} tokens; raise max_kept"
            )
        chunks.append(torch.where(keep, ids, -1)[:, :max_kept])
    if not chunks:
        return torch.full((*lead, 1), -1, dtype=torch.long, device=logits.device)
    kept = torch.cat(chunks)
    size = max(int((kept >= 0).sum(-1).max()), 1)
    return kept[:, :size].reshape(*lead, size)

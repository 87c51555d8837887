"""Benchmark inputs: realistic logits and rollout tensors for one (N, V, K, mode, dtype) case."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl")
TOPK_MODES = ("topk_tv", "topk_kl")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLE_TOP = 64  # tokens are sampled among each row's top SAMPLE_TOP logits


@dataclass
class LossInputs:
    """One benchmark case's inputs (shapes per row i of N, vocabulary V, top-K K)."""

    logits: torch.Tensor  # [N, V] in the benchmark dtype, requires_grad
    tokens: torch.Tensor  # [N] int64 sampled ids
    rollout_logprobs: torch.Tensor  # [N] float32, <= 0
    advantages: torch.Tensor  # [N] float32
    topk_ids: Optional[torch.Tensor]  # [N, K] int64 (top-K modes)
    topk_logprobs: Optional[torch.Tensor]  # [N, K] float32, <= 0 (top-K modes)

    def tensors(self) -> list[torch.Tensor]:
        """Every input tensor (for byte accounting)."""
        out = [self.logits, self.tokens, self.rollout_logprobs, self.advantages]
        return out + [t for t in (self.topk_ids, self.topk_logprobs) if t is not None]

    def nbytes(self) -> int:
        """Bytes held by all inputs together."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def make_inputs(n: int, v: int, k: int, mode: str, dtype: torch.dtype, device: str, seed: int = 0) -> LossInputs:
    """Realistic random inputs, generated chunk by chunk so setup never holds an fp32 [N, V] copy.

    Logits: each chunk of rows is a random window of a block of ``2 * randn`` rows (twice a chunk
    tall), rolled along V by a random shift (torch's CPU generator is sequential: drawing N*V ~ 6e8
    normals would dominate the setup, and the loss's cost does not depend on which values a row
    holds), plus a boost of ``log(V) + 2 + U(-6, 6)`` on one random token per row, so the boosted
    token's probability spans ~0.002 to ~0.998 (peaked, LLM-like rows). Tokens are sampled from
    the softmax restricted to the row's top ``SAMPLE_TOP`` logits; the rollout log-probs are the
    tokens' true log-probs plus N(0, 0.3) noise (a train/inference mismatch, so some rows get
    masked); advantages are N(0, 1); top-K ids/log-probs are the row's top-K with the same noise.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    rows_per_chunk = max(1, (1 << 23) // v)
    base = 2.0 * torch.randn(min(n, 2 * rows_per_chunk), v, generator=gen, device=device)
    logits = torch.empty(n, v, dtype=dtype, device=device)
    tokens = torch.empty(n, dtype=torch.long, device=device)
    rollout = torch.empty(n, dtype=torch.float32, device=device)
    topk = mode in TOPK_MODES
    topk_ids = torch.empty(n, k, dtype=torch.long, device=device) if topk else None
    topk_lp = torch.empty(n, k, dtype=torch.float32, device=device) if topk else None
    for start in range(0, n, rows_per_chunk):
        stop = min(n, start + rows_per_chunk)
        rows = stop - start
        first = int(torch.randint(0, base.shape[0] - rows + 1, (1,), generator=gen))
        shift = int(torch.randint(0, v, (1,), generator=gen))
        window = base[first : first + rows]
        z = torch.empty(rows, v, device=device)
        z[:, : v - shift] = window[:, shift:]
        z[:, v - shift :] = window[:, :shift]
        preferred = torch.randint(0, v, (rows, 1), generator=gen, device=device)
        boost = math.log(v) + 2.0 + 12.0 * torch.rand(rows, 1, generator=gen, device=device) - 6.0
        z.scatter_add_(1, preferred, boost)
        logits[start:stop] = z.to(dtype)
        logp = torch.log_softmax(z, dim=-1)
        top_lp, top_ids = logp.topk(max(k, SAMPLE_TOP), dim=-1)
        pick = torch.multinomial(top_lp.exp(), 1, generator=gen)
        noise = 0.3 * torch.randn(rows, 1, generator=gen, device=device)
        rollout[start:stop] = (top_lp.gather(1, pick) + noise).clamp(max=0.0).squeeze(1)
        tokens[start:stop] = top_ids.gather(1, pick).squeeze(1)
        if topk:
            topk_ids[start:stop] = top_ids[:, :k]
            topk_lp[start:stop] = (top_lp[:, :k] + 0.3 * torch.randn(rows, k, generator=gen, device=device)).clamp(
                max=0.0
            )
        del z, logp
    advantages = torch.randn(n, generator=gen, device=device)
    return LossInputs(logits.requires_grad_(), tokens, rollout, advantages, topk_ids, topk_lp)


def deltas_for(mode: str) -> tuple[float, float]:
    """(delta_low, delta_high): the fused API's defaults for ``mode``, passed to every contender."""
    from dppo_ext import DEFAULT_DELTAS

    return DEFAULT_DELTAS[mode]

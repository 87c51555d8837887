"""Pack rollout samples into the padded tensors one training step needs.

Layout (B sequences, prompts left-padded to a common length P, responses right-padded to T):

    input_ids      [B, P + T]   pad | prompt | response | pad
    attention_mask [B, P + T]   1 on real tokens
    position_ids   [B, P + T]   0, 1, ... counted over real tokens (matches the rollout engine)

The logits that predict response token t sit at column ``P - 1 + t``, so the policy's
response logits are the last ``T + 1`` columns minus the final one: a single contiguous slice
for every row, which lets the model project only those hidden states to the vocabulary
(``logits_to_keep``) instead of the whole sequence.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Optional

import torch

from dppo_ext.contract import LOGITS_DTYPE_SETTINGS
from dppo_ext.models.lm_head import check_plain_logits, widened_head
from dppo_ext.rollout.base import RolloutSample
from dppo_ext.rollout.vllm_outputs import pack_rollout_samples


@dataclass
class RolloutBatch:
    """Padded tensors of B rollout sequences (see the module docstring for the layout).

    Attributes:
        input_ids, attention_mask, position_ids: [B, P + T] int64.
        tokens: [B, T] int64 response tokens (pad id on padding).
        response_mask: [B, T] bool, True on real response tokens.
        rollout_logprobs: [B, T] float32 rollout log-probs (0 on padding).
        advantages: [B] float32, one per sequence.
        topk_ids: [B, T, K] int64 or None; topk_logprobs: [B, T, K] float32 or None.
        anchor_logprobs: [B, T] float32 or None: the trainer's own log-probs of the tokens,
            recomputed before the batch's first update (the mask anchor of the MiniRL losses).
        kept_ids: [B, T, S] int64 or None: under truncated sampling, each position's kept set (-1 padding), which
            the loss renormalises pi over (sampling replay).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    tokens: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    anchor_logprobs: torch.Tensor | None = None
    kept_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of sequences B."""
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        """Padded response length T."""
        return self.tokens.shape[1]

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """The sub-batch of rows ``index`` ([b] int64), trimmed to its own longest response."""
        picked = {
            f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[index]) for f in fields(self)
        }
        longest = int(picked["response_mask"].sum(dim=1).max()) if index.numel() else 0
        cut = self.response_len - longest
        if cut > 0:
            for name in ("input_ids", "attention_mask", "position_ids"):
                picked[name] = picked[name][:, : picked[name].shape[1] - cut]
            per_position = ("tokens", "response_mask", "rollout_logprobs", "topk_ids", "topk_logprobs")
            for name in (*per_position, "anchor_logprobs", "kept_ids"):
                if picked[name] is not None:
                    picked[name] = picked[name][:, :longest]
        return RolloutBatch(**picked)

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        return RolloutBatch(
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                for f in fields(self)
            }
        )


def collate_rollouts(
    samples: list[RolloutSample], advantages: list[float], *, pad_id: int, with_topk: bool, with_kept: bool = True
) -> RolloutBatch:
    """Pack ``samples`` (with one advantage each) into a ``RolloutBatch`` on the CPU.

    Args:
        samples: B rollout samples; each response must be non-empty.
        advantages: B advantages.
        pad_id: token id used for padding (never attended to, never trained on).
        with_topk: also pack ``topk_ids`` / ``topk_logprobs`` (all samples must carry them).
        with_kept: pack the samples' ``kept_ids`` when they carry them (False: drop them; the loss then scores pi over
            the vocabulary, --no-sampling-replay).
    """
    if len(samples) != len(advantages):
        raise ValueError(f"got {len(samples)} samples but {len(advantages)} advantages")
    if not samples:
        raise ValueError("collate_rollouts needs at least one sample")
    response = pack_rollout_samples(samples, pad_token_id=pad_id, with_topk=with_topk)
    resp_len = response.tokens.shape[1]
    if resp_len == 0:
        raise ValueError("every rollout response is empty; nothing to train on")
    prompt_len = max(len(s.prompt_ids) for s in samples)
    batch, total = len(samples), prompt_len + resp_len
    input_ids = torch.full((batch, total), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, total), dtype=torch.long)
    input_ids[:, prompt_len:] = response.tokens
    for row, sample in enumerate(samples):
        p, t = len(sample.prompt_ids), len(sample.response_ids)
        input_ids[row, prompt_len - p : prompt_len] = torch.tensor(sample.prompt_ids, dtype=torch.long)
        attention_mask[row, prompt_len - p : prompt_len + t] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        tokens=response.tokens,
        response_mask=response.response_mask,
        rollout_logprobs=response.rollout_logprobs,
        advantages=torch.tensor(advantages, dtype=torch.float32),
        topk_ids=response.topk_ids,
        topk_logprobs=response.topk_logprobs,
        kept_ids=response.kept_ids if with_kept else None,
    )


def checked_logits_dtype(model: torch.nn.Module, logits_dtype: Optional[str]) -> Optional[torch.dtype]:
    """The ``logits_dtype`` :func:`response_logits` takes for ``--logits-dtype`` with ``model``: None unless it widens
    the LM head's dtype. Widening applies the head to the hidden states here, so a model that soft-caps or rescales
    its logits is refused (ValueError naming the flag)."""
    wide = LOGITS_DTYPE_SETTINGS.get(logits_dtype)
    if wide is None or model.get_output_embeddings().weight.dtype == wide:
        return None
    check_plain_logits(model.config, "--logits-dtype", fix="leave --logits-dtype unset")
    return wide


def response_logits(
    model: torch.nn.Module, batch: RolloutBatch, logits_dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """The policy's raw logits for every response position.

    Runs ``model`` on the packed sequences and projects only the ``T + 1`` last hidden states
    to the vocabulary. With ``logits_dtype`` wider than the model's (``torch.float32`` for a bfloat16 / float16
    model, ``--logits-dtype float32``) the model's LM head runs in that dtype (``widened_head``): each product of
    16-bit operands is exact in float32 and accumulated there, so the logits are the float32 LM head's (the fused
    op's ``logits_dtype=torch.float32``), never 16-bit logits widened afterwards. (The head's weight is widened for
    the product; autograd keeps that float32 copy until the backward.) The model must apply nothing after its LM
    head (:func:`checked_logits_dtype`).

    Returns:
        [B, T, V] logits; row b, column t predicts ``batch.tokens[b, t]``.
    """
    with contextlib.nullcontext() if logits_dtype is None else widened_head(model, logits_dtype):
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.response_len + 1,
            use_cache=False,
        )
    return out.logits[:, :-1]

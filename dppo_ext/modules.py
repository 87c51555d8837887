"""The ``nn.Module`` forms of the API family: :class:`DPPOLoss` (:func:`dppo_ext.dppo_loss`) and
:class:`FusedLinearDPPOLoss` (:func:`dppo_ext.fused_linear_dppo_loss`, as Liger's ``LigerFusedLinearGRPOLoss``). Each
holds its settings as one ``LossSettings`` (``crit.settings``; each also an attribute), checked at construction
(``dppo_ext._rows.LossModule``), and takes the tensors in ``forward``.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import Tensor

from ._lm_head_tiles import check_accum_dtype, check_chunk_settings, check_logits_dtype
from ._rows import LossModule
from .contract import DEFAULT_AGG_MODE, DEFAULT_MASK_DIRECTION, DEFAULT_MODE, DEFAULT_RATIO_CAP
from .fused_linear import fused_linear_dppo_loss
from .loss import dppo_loss
from .sequence_mask import SequenceMask

__all__ = ["DPPOLoss", "FusedLinearDPPOLoss"]


class DPPOLoss(LossModule):
    """``nn.Module`` form of :func:`dppo_loss` holding the settings; ``forward`` takes the tensors.

    The settings are checked here, at construction (the same rules as the op's: a known mode and mask direction, a
    finite temperature > 0, thresholds that are None or finite and >= 0, ratio_cap > 0, a known loss_agg_mode).

    Example::

        crit = DPPOLoss(mode="binary_tv", delta_low=0.15, delta_high=0.15)
        loss, metrics = crit(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    """

    def __init__(
        self,
        mode: str = DEFAULT_MODE,
        *,
        mask_direction: str = DEFAULT_MASK_DIRECTION,
        kl_tau: float = 0.0,
        kl_mask_type: str = "all",
        sequence_mask: Optional[SequenceMask] = None,
        temperature: float = 1.0,
        delta_low: Optional[float] = None,
        delta_high: Optional[float] = None,
        ratio_cap: float = DEFAULT_RATIO_CAP,
        loss_agg_mode: str = DEFAULT_AGG_MODE,
        loss_scale_factor: Optional[float] = None,
        compute_entropy: bool = True,
        inplace_backward: bool = False,
        vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        vocab_offsets: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(
            mode=mode,
            mask_direction=mask_direction,
            kl_tau=kl_tau,
            kl_mask_type=kl_mask_type,
            sequence_mask=sequence_mask,
            temperature=temperature,
            delta_low=delta_low,
            delta_high=delta_high,
            ratio_cap=ratio_cap,
            loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            compute_entropy=compute_entropy,
            vocab_parallel_group=vocab_parallel_group,
            vocab_offsets=vocab_offsets,
            flags={"inplace_backward": inplace_backward},
        )
        self.inplace_backward = inplace_backward

    def forward(
        self,
        logits: Tensor,
        tokens: Tensor,
        rollout_logprobs: Tensor,
        advantages: Tensor,
        *,
        response_mask: Optional[Tensor] = None,
        topk_ids: Optional[Tensor] = None,
        topk_logprobs: Optional[Tensor] = None,
        anchor_logprobs: Optional[Tensor] = None,
        kept_ids: Optional[Tensor] = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return dppo_loss(
            logits,
            tokens,
            rollout_logprobs,
            advantages,
            response_mask=response_mask,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            anchor_logprobs=anchor_logprobs,
            kept_ids=kept_ids,
            inplace_backward=self.inplace_backward,
            **self.loss_kwargs(),
        )


class FusedLinearDPPOLoss(LossModule):
    """``nn.Module`` form of :func:`fused_linear_dppo_loss` (as Liger's ``LigerFusedLinearGRPOLoss``).

    Holds the settings; ``forward`` takes the hidden states, the LM-head weight (and bias) and the rollout tensors.

    Example::

        crit = FusedLinearDPPOLoss(mode="binary_tv", loss_agg_mode="token-mean")
        hidden = model.model(input_ids).last_hidden_state[:, prompt_len - 1 : -1]  # [B, T, H]
        loss, metrics = crit(hidden, model.lm_head.weight, tokens, rollout_logprobs, advantages,
                             response_mask=mask)
    """

    def __init__(
        self,
        mode: str = DEFAULT_MODE,
        *,
        mask_direction: str = DEFAULT_MASK_DIRECTION,
        kl_tau: float = 0.0,
        kl_mask_type: str = "all",
        sequence_mask: Optional[SequenceMask] = None,
        temperature: float = 1.0,
        delta_low: Optional[float] = None,
        delta_high: Optional[float] = None,
        ratio_cap: float = DEFAULT_RATIO_CAP,
        loss_agg_mode: str = DEFAULT_AGG_MODE,
        loss_scale_factor: Optional[float] = None,
        compute_entropy: bool = True,
        chunk_size: Optional[int] = None,
        vocab_chunk_size: Optional[int] = None,
        memory_budget_bytes: Optional[int] = None,
        accum_dtype: Optional[torch.dtype] = None,
        logits_dtype: Optional[torch.dtype] = None,
        vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
        vocab_offsets: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(
            mode=mode,
            mask_direction=mask_direction,
            kl_tau=kl_tau,
            kl_mask_type=kl_mask_type,
            sequence_mask=sequence_mask,
            temperature=temperature,
            delta_low=delta_low,
            delta_high=delta_high,
            ratio_cap=ratio_cap,
            loss_agg_mode=loss_agg_mode,
            loss_scale_factor=loss_scale_factor,
            compute_entropy=compute_entropy,
            vocab_parallel_group=vocab_parallel_group,
            vocab_offsets=vocab_offsets,
        )
        check_chunk_settings(chunk_size, vocab_chunk_size, memory_budget_bytes)
        check_accum_dtype(accum_dtype)
        check_logits_dtype(logits_dtype)
        self.chunk_size = chunk_size
        self.vocab_chunk_size = vocab_chunk_size
        self.memory_budget_bytes = memory_budget_bytes
        self.accum_dtype = accum_dtype
        self.logits_dtype = logits_dtype

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        tokens: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        *,
        bias: Optional[torch.Tensor] = None,
        response_mask: Optional[torch.Tensor] = None,
        topk_ids: Optional[torch.Tensor] = None,
        topk_logprobs: Optional[torch.Tensor] = None,
        anchor_logprobs: Optional[torch.Tensor] = None,
        kept_ids: Optional[torch.Tensor] = None,
        weight_context: Optional[Callable[[], ContextManager]] = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return fused_linear_dppo_loss(
            hidden,
            weight,
            tokens,
            rollout_logprobs,
            advantages,
            bias=bias,
            response_mask=response_mask,
            topk_ids=topk_ids,
            topk_logprobs=topk_logprobs,
            anchor_logprobs=anchor_logprobs,
            kept_ids=kept_ids,
            chunk_size=self.chunk_size,
            vocab_chunk_size=self.vocab_chunk_size,
            memory_budget_bytes=self.memory_budget_bytes,
            accum_dtype=self.accum_dtype,
            logits_dtype=self.logits_dtype,
            weight_context=weight_context,
            **self.loss_kwargs(),
        )

    def extra_repr(self) -> str:
        accum = "" if self.accum_dtype is None else f", accum_dtype={self.accum_dtype}"
        logits = "" if self.logits_dtype is None else f", logits_dtype={self.logits_dtype}"
        return f"{super().extra_repr()}, chunk_size={self.chunk_size}{accum}{logits}"

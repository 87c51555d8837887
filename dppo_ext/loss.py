"""The user-facing DPPO loss: ``dppo_loss`` and the ``DPPOLoss`` module.

Takes the policy's logits for the response tokens in any leading layout (``[N, V]``, ``[B, T, V]``)
plus what the rollout engine returned, runs the fused op (``dppo_ext.ops``; ``dppo_ext.vocab_parallel`` for
logits sharded over a tensor-parallel group) on the flattened rows, aggregates the per-token loss the way verl
does (``dppo_ext.aggregation``), and returns the scalar loss with a dict of metrics. Padding
(``response_mask == 0``) rows are skipped inside the kernels and get a zero gradient.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from . import ops, vocab_parallel
from ._agreement import Rendezvous, agreed_failures
from ._autograd import check_no_functorch, inplace_applies
from ._dtensor import is_dtensor, replicated_local, vocab_shard
from ._rows import LossModule, LossSettings, broadcast_advantages, check_tensors, prepare_rows
from ._vocab_split import check_split_args
from .aggregation import aggregate_loss, aggregate_with, dppo_metrics
from .contract import (
    AGG_MODES,
    DEFAULT_AGG_MODE,
    DEFAULT_DELTAS,
    DEFAULT_MODE,
    DEFAULT_RATIO_CAP,
    IGNORE_INDEX,
    NORM_AGG_MODES,
    accumulation_dtype,
    check_aggregation,
)

# dppo_loss and DPPOLoss, and the names other modules define that this one has always offered.
__all__ = [
    "AGG_MODES",
    "DEFAULT_DELTAS",
    "DPPOLoss",
    "IGNORE_INDEX",
    "NORM_AGG_MODES",
    "aggregate_loss",
    "broadcast_advantages",
    "check_aggregation",
    "dppo_loss",
    "dppo_metrics",
]


def dppo_loss(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    *,
    response_mask: Optional[Tensor] = None,
    mode: str = DEFAULT_MODE,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
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
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO policy loss from the policy's logits and the rollout engine's log-probs.

    Args:
        logits: ``[..., V]`` policy logits at the response positions (any float dtype; never
            upcast or copied). For ``[B, T, V]`` the sequence modes of ``loss_agg_mode`` apply.
        tokens: ``[...]`` sampled token ids.
        rollout_logprobs: ``[...]`` log mu(token) from the rollout engine (e.g. vLLM), of the
            temperature-processed distribution.
        advantages: ``[...]`` per token, or ``[B]`` per sequence for ``[B, T, V]`` logits.
        response_mask: ``[...]`` 1/True for response tokens; padding rows cost no compute and get a
            zero gradient. Default: all tokens are valid.
        mode: ``binary_tv`` | ``binary_kl`` | ``topk_tv`` | ``topk_kl`` (DPPO), ``ratio`` (PPO/GRPO
            clip as a mask) or ``none`` (PG-IS / CISPO style: never masked); verl's ``dppo_tv`` /
            ``dppo_kl`` and the other names of ``dppo_ext.contract.MODE_ALIASES`` are accepted too.
        topk_ids, topk_logprobs: ``[..., K]`` the rollout's top-K ids and log-probs (top-K modes).
        anchor_logprobs: ``[...]`` recomputed old-policy log-probs replacing mu in the mask test
            only (the "recompute" ablations); the importance weight always uses mu.
        temperature: the rollout temperature; logits are divided by it.
        delta_low, delta_high: trust-region thresholds; ``None`` takes ``DEFAULT_DELTAS[mode]``.
        ratio_cap: cap C on the importance weight min(pi / mu, C).
        loss_agg_mode: one of ``AGG_MODES``, see :func:`aggregate_loss`.
        loss_scale_factor: the horizon of the ``-norm`` aggregation modes (default: the padded length T).
        compute_entropy: compute the policy entropy (``entropy_mean`` metric); else it reads 0.
        inplace_backward: write the logits gradient into the logits buffer during backward
            (no ``[N, V]`` allocation; the logits are consumed, do not reuse them).
        vocab_parallel_group: the tensor-parallel group when ``logits`` is ``[..., V_local]``, this rank's
            contiguous slice of the vocabulary (Megatron-style vocab-parallel logits); ids stay global and every
            other input is replicated. One all-gather of ``4 + K`` numbers per row in forward, none in backward;
            the loss and metrics are identical on every rank (``dppo_ext.vocab_parallel``,
            docs/distributed.md). A ``DTensor`` sharded on the vocabulary dim needs neither argument.
        vocab_offsets: ``[W + 1]`` global column offsets of the ranks' slices (group-rank order); None
            derives them from the slice widths the ranks exchange anyway. Refused without a group.

    Returns:
        ``(loss, metrics)``: the scalar loss and a dict of 0-d metric tensors (see
        :func:`dppo_metrics`).
    """
    named = dict(
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        anchor_logprobs=anchor_logprobs,
    )
    settings = (mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy, loss_agg_mode, loss_scale_factor)
    check_split_args(vocab_parallel_group, vocab_offsets)
    if vocab_parallel_group is None and not is_dtensor(logits):
        return _dppo_loss(logits, named, settings, inplace_backward, None, None)
    shard = vocab_shard(logits, vocab_parallel_group, vocab_offsets)
    with agreed_failures(shard.group) as rendezvous:  # an error of this rank alone still reaches the other ranks
        named = {name: replicated_local(t, name) for name, t in named.items()}
        return _dppo_loss(shard.logits, named, settings, inplace_backward, rendezvous, shard.vocab_offsets)


def _dppo_loss(
    logits: Tensor,
    named: dict[str, Optional[Tensor]],
    settings: tuple,
    inplace_backward: bool,
    rendezvous: Optional[Rendezvous],
    vocab_offsets: Optional[Sequence[int]],
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`dppo_loss` on single-device logits (``rendezvous`` None) or on this rank's vocabulary slice."""
    settings = LossSettings.resolve(*settings)
    check_tensors(logits=logits)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    valid, rows = prepare_rows(lead, "logits", accumulation_dtype(logits.dtype), logits.device, **named)
    flat = logits.reshape(lead.numel(), vocab)
    if rendezvous is not None:
        check_no_functorch("dppo_loss_forward_vocab_parallel", flat)
        inplace = inplace_applies(inplace_backward, logits)
        out = vocab_parallel.forward_rows(flat, rows, settings, inplace, rendezvous, vocab_offsets)
    else:
        check_no_functorch("dppo_loss_forward", flat)
        inplace = inplace_applies(inplace_backward, logits)
        out = ops.forward_rows(flat, rows, settings, inplace)
    loss = aggregate_with(out.loss.reshape(lead), valid, settings)
    return loss, dppo_metrics(out, rows.rollout_logprobs, rows.advantages, valid.reshape(lead.numel()))


class DPPOLoss(LossModule):
    """``nn.Module`` form of :func:`dppo_loss` holding the settings; ``forward`` takes the tensors.

    The settings are checked here, at construction (the same rules as the op's: a known mode, a finite
    temperature > 0, thresholds that are None or finite and >= 0, ratio_cap > 0, a known loss_agg_mode).

    Example::

        crit = DPPOLoss(mode="binary_tv", delta_low=0.15, delta_high=0.15)
        loss, metrics = crit(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    """

    def __init__(
        self,
        mode: str = DEFAULT_MODE,
        *,
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
            mode,
            temperature,
            delta_low,
            delta_high,
            ratio_cap,
            loss_agg_mode,
            loss_scale_factor,
            compute_entropy,
            vocab_parallel_group,
            vocab_offsets,
            inplace_backward=inplace_backward,
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
            inplace_backward=self.inplace_backward,
            **self.loss_kwargs(),
        )

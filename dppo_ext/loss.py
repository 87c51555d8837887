"""The user-facing DPPO loss: ``dppo_loss`` and the ``DPPOLoss`` module.

Takes the policy's logits for the response tokens in any leading layout (``[N, V]``, ``[B, T, V]``)
plus what the rollout engine returned, runs the fused op (``dppo_ext.ops``) on the flattened
rows, aggregates the per-token loss the way verl does, and returns the scalar loss with a dict of
metrics. Padding (``response_mask == 0``) rows are skipped inside the kernels and get a zero
gradient.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from .contract import (AGG_MODES, DEFAULT_DELTAS, IGNORE_INDEX, NORM_AGG_MODES, canonical_mode, check_aggregation,
                       check_settings, check_token_ids, resolve_loss_settings)
from .ops import DPPOOutputs, _acc_dtype, _inplace_applies, dppo_loss_forward

__all__ = [
    "AGG_MODES", "DEFAULT_DELTAS", "DPPOLoss", "NORM_AGG_MODES", "aggregate_loss", "check_aggregation", "dppo_loss",
    "dppo_metrics",
]


def aggregate_loss(
    loss_mat: Tensor, mask: Tensor, loss_agg_mode: str = "token-mean", loss_scale_factor: Optional[float] = None
) -> Tensor:
    """Aggregate a per-token loss into a scalar, with verl's mode names and formulas.

    With ``l[b, t]`` the per-token loss, ``m[b, t]`` the mask, ``S_b = sum_t m l`` the sequence sums,
    ``n_b = sum_t m`` the token counts, ``B' = #{b : n_b > 0}`` the non-empty sequences and ``C`` the
    horizon (``loss_scale_factor``, default ``T = mask.shape[-1]``):

    - ``token-mean``: ``sum_b S_b / sum_b n_b``
    - ``token-sum``: ``sum_b S_b``
    - ``seq-mean-token-sum``: ``sum_b S_b / B'``
    - ``seq-mean-token-mean``: ``sum_{b: n_b > 0} (S_b / n_b) / B'``
    - ``seq-mean-token-sum-norm``: ``sum_b S_b / (B' * C)`` (Dr. GRPO; current verl)
    - ``token-sum-norm``: ``sum_b S_b / C`` (what the paper's verl fork computes under the name
      ``seq-mean-token-sum-norm``: ``B'`` times the current verl value)

    Args:
        loss_mat: ``[B, T]`` (or ``[N]``, treated as one sequence) per-token loss.
        mask: same shape, 1 for response tokens, 0 for padding.
        loss_agg_mode: one of ``AGG_MODES``.
        loss_scale_factor: ``C`` of the ``-norm`` modes (verl's ``loss_scale_factor``; pass a constant such
            as the maximum response length when micro-batches are padded to different lengths). Only for
            those modes.
    An empty batch (no response token) gives 0 in every mode.
    """
    check_aggregation(loss_agg_mode, loss_scale_factor)
    if mask.shape != loss_mat.shape:  # a broadcast mask would silently change the normaliser
        raise ValueError(f"mask must have the loss's shape {tuple(loss_mat.shape)}, got {tuple(mask.shape)}")
    if loss_mat.dim() == 1:
        loss_mat, mask = loss_mat.unsqueeze(0), mask.unsqueeze(0)
    mask = mask.to(loss_mat.dtype)
    seq_sum = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "token-mean":
        return seq_sum.sum() / mask.sum().clamp(min=1)
    if loss_agg_mode == "token-sum":
        return seq_sum.sum()
    horizon = float(max(loss_mat.shape[-1], 1) if loss_scale_factor is None else loss_scale_factor)
    if loss_agg_mode == "token-sum-norm":
        return seq_sum.sum() / horizon
    tokens_per_seq = mask.sum(-1)
    non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sum = seq_sum / tokens_per_seq.clamp(min=1)
    seq_mean = (seq_sum * non_empty).sum() / non_empty.sum().clamp(min=1)
    return seq_mean / horizon if loss_agg_mode == "seq-mean-token-sum-norm" else seq_mean


@torch.no_grad()
def dppo_metrics(out: DPPOOutputs, rollout_logprobs: Tensor, advantages: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """The op's per-row outputs summarised over valid rows, as 0-d tensors (no host sync).

    Keys: ``masked_frac`` (all / ``_pos`` A > 0 / ``_neg`` A < 0), ``mismatch_mean`` and
    ``mismatch_max`` (|pi - mu|, the paper's training-inference mismatch), ``divergence_mean``,
    ``entropy_mean``, ``ratio_max`` (pi / mu, log-ratio clamped at 20), ``num_tokens``.
    """
    v = valid.to(out.loss.dtype)
    n = v.sum()

    def mean(x: Tensor, w: Tensor) -> Tensor:
        return (x * w).sum() / w.sum().clamp(min=1)

    def vmax(x: Tensor) -> Tensor:
        return torch.where(valid, x, torch.zeros_like(x)).amax() if x.numel() else x.new_zeros(())

    masked = 1.0 - out.mask
    mismatch = (out.logp.exp() - rollout_logprobs.exp()).abs()
    # A token impossible under both policies (both log-probs -inf) has ratio 0, as its weight (docs/contract.md);
    # a row without a distribution keeps its NaN, so the metric shows it.
    impossible = torch.isneginf(out.logp) & torch.isneginf(rollout_logprobs)
    ratio = torch.where(impossible, 0.0, torch.exp((out.logp - rollout_logprobs).clamp(max=20.0)))
    return {
        "masked_frac": mean(masked, v),
        "masked_frac_pos": mean(masked, v * (advantages > 0)),
        "masked_frac_neg": mean(masked, v * (advantages < 0)),
        "mismatch_mean": mean(mismatch, v),
        "mismatch_max": vmax(mismatch),
        "divergence_mean": mean(out.divergence, v),
        "entropy_mean": mean(out.entropy, v),
        "ratio_max": vmax(ratio),
        "num_tokens": n,
    }


def broadcast_advantages(advantages: Tensor, lead: torch.Size, layout: str) -> Tensor:
    """Advantages as ``lead`` (the rows' shape): per token as given, or per sequence (``[B]``, or TRL's
    ``[B, 1]``) expanded over the ``T`` tokens of ``[B, T]`` rows."""
    if advantages.shape == lead:
        return advantages
    if len(lead) == 2 and advantages.shape in (lead[:1], torch.Size((lead[0], 1))):
        return advantages.reshape(lead[0], 1).expand(lead)
    raise ValueError(
        f"advantages must have shape {tuple(lead)} (per token) or {tuple(lead[:1])} or {(lead[0], 1)} (per sequence, "
        f"for [B, T, *] {layout}), got {tuple(advantages.shape)}")


def _check_row_shapes(lead: torch.Size, dims: str, **tensors: Optional[Tensor]) -> None:
    """Every given tensor (None passes) must have the rows' shape ``lead``, which ``dims`` names in the message."""
    for name, t in tensors.items():
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} must have shape {tuple(lead)} ({dims}), got {tuple(t.shape)}")


def _check_topk_shapes(lead: torch.Size, topk_ids: Optional[Tensor], topk_logprobs: Optional[Tensor]) -> None:
    for name, t in (("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
        if t is not None and t.shape[:-1] != lead:
            raise ValueError(f"{name} must have shape {tuple(lead)} + (K,), got {tuple(t.shape)}")


class _FlatRows(NamedTuple):
    """An aggregating entry point's inputs as the per-row op takes them (``_flat_rows``)."""

    valid: Tensor  # [*lead] bool, the response tokens
    tokens: Tensor  # [N] int64, IGNORE_INDEX where not valid
    rollout_logprobs: Tensor  # [N], accumulation dtype
    advantages: Tensor  # [N], accumulation dtype
    topk_ids: Optional[Tensor]  # [N, K] int64
    topk_logprobs: Optional[Tensor]  # [N, K], accumulation dtype
    anchor_logprobs: Optional[Tensor]  # [N], accumulation dtype


def _flat_rows(lead: torch.Size, acc: torch.dtype, device: torch.device, tokens: Tensor, rollout_logprobs: Tensor,
               advantages: Tensor, response_mask: Optional[Tensor], topk_ids: Optional[Tensor],
               topk_logprobs: Optional[Tensor], anchor_logprobs: Optional[Tensor]) -> _FlatRows:
    """The checked ``[*lead, ...]`` inputs flattened to ``N = lead.numel()`` rows, float ones in ``acc``; a row
    outside ``response_mask`` gets the token ``IGNORE_INDEX``, which the op skips."""
    valid = torch.ones(lead, dtype=torch.bool, device=device) if response_mask is None else response_mask.bool()
    flat_tokens = torch.where(valid, tokens.long(), torch.full_like(tokens, IGNORE_INDEX, dtype=torch.long))
    rows = lead.numel()

    def flat(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
        return None if t is None else t.reshape(rows, *t.shape[len(lead):]).to(dtype)

    return _FlatRows(valid, flat_tokens.reshape(rows), flat(rollout_logprobs, acc), flat(advantages, acc),
                     flat(topk_ids, torch.long), flat(topk_logprobs, acc), flat(anchor_logprobs, acc))


def dppo_loss(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    *,
    response_mask: Optional[Tensor] = None,
    mode: str = "binary_tv",
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: Optional[float] = None,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
    vocab_parallel_group: Optional["torch.distributed.ProcessGroup"] = None,
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
            ``dppo_kl`` and the other names of ``dppo_ext.ops.MODE_ALIASES`` are accepted too.
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
            derives them with one extra all-gather per call.

    Returns:
        ``(loss, metrics)``: the scalar loss and a dict of 0-d metric tensors (see
        :func:`dppo_metrics`).
    """
    mode, delta_low, delta_high = resolve_loss_settings(mode, delta_low, delta_high, loss_agg_mode, loss_scale_factor)
    check_token_ids("tokens", tokens)
    check_token_ids("topk_ids", topk_ids)
    forward = dppo_loss_forward
    if vocab_parallel_group is not None or _is_dtensor(logits):
        logits, tokens, rollout_logprobs, advantages, response_mask, topk_ids, topk_logprobs, anchor_logprobs, \
            forward = _vocab_parallel_inputs(logits, tokens, rollout_logprobs, advantages, response_mask, topk_ids,
                                             topk_logprobs, anchor_logprobs, vocab_parallel_group, vocab_offsets)
    if logits.dim() < 2:
        raise ValueError(f"logits must be [..., V] with at least 2 dims, got shape {tuple(logits.shape)}")
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    _check_row_shapes(lead, "the logits' leading dims", tokens=tokens, rollout_logprobs=rollout_logprobs,
                      response_mask=response_mask, anchor_logprobs=anchor_logprobs)
    advantages = broadcast_advantages(advantages, lead, "logits")
    _check_topk_shapes(lead, topk_ids, topk_logprobs)
    _inplace_applies(inplace_backward, logits)
    rows = _flat_rows(lead, _acc_dtype(logits.dtype), logits.device, tokens, rollout_logprobs, advantages, response_mask, topk_ids,
                      topk_logprobs, anchor_logprobs)
    out = forward(
        logits.reshape(lead.numel(), vocab), rows.tokens, rows.rollout_logprobs, rows.advantages, rows.topk_ids,
        rows.topk_logprobs, rows.anchor_logprobs,
        mode=mode, temperature=temperature, delta_low=delta_low, delta_high=delta_high, ratio_cap=ratio_cap,
        compute_entropy=compute_entropy, inplace_backward=inplace_backward)
    loss = aggregate_loss(out.loss.reshape(lead), rows.valid, loss_agg_mode, loss_scale_factor)
    metrics = dppo_metrics(out, rows.rollout_logprobs, rows.advantages, rows.valid.reshape(lead.numel()))
    return loss, metrics


def _is_dtensor(t: Tensor) -> bool:
    from .vocab_parallel import is_dtensor

    return is_dtensor(t)


def _vocab_parallel_inputs(logits, tokens, rollout_logprobs, advantages, response_mask, topk_ids, topk_logprobs,
                           anchor_logprobs, group, vocab_offsets):
    """The local inputs and the per-row forward for vocab-parallel logits (a process group or a DTensor)."""
    from . import vocab_parallel as vp

    if vp.is_dtensor(logits):
        if group is not None or vocab_offsets is not None:
            raise ValueError("logits is a DTensor: its device mesh and placements define the vocabulary split, do "
                             "not also pass vocab_parallel_group / vocab_offsets")
        logits, group, vocab_offsets = vp.dtensor_vocab_shard(logits)
    named = {"tokens": tokens, "rollout_logprobs": rollout_logprobs, "advantages": advantages,
             "response_mask": response_mask, "topk_ids": topk_ids, "topk_logprobs": topk_logprobs,
             "anchor_logprobs": anchor_logprobs}
    local = [vp.replicated_local(t, name) for name, t in named.items()]
    forward = functools.partial(vp.dppo_loss_forward_vocab_parallel, group=group, vocab_offsets=vocab_offsets)
    return (logits, *local, forward)


class _LossModule(nn.Module):
    """The settings that ``DPPOLoss`` and ``FusedLinearDPPOLoss`` share: checked at construction
    (``flags``: the module's own bool settings), stored, and passed
    to the loss function by ``_settings()``."""

    def __init__(
        self,
        mode: str,
        temperature: float,
        delta_low: Optional[float],
        delta_high: Optional[float],
        ratio_cap: float,
        loss_agg_mode: str,
        loss_scale_factor: Optional[float],
        compute_entropy: bool,
        vocab_parallel_group: Optional["torch.distributed.ProcessGroup"],
        vocab_offsets: Optional[Sequence[int]],
        **flags: bool,
    ) -> None:
        super().__init__()
        # checked in this order: the op's settings, each bool setting, then the aggregation
        check_settings(mode, temperature, delta_low, delta_high, ratio_cap)
        for name, flag in {"compute_entropy": compute_entropy, **flags}.items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        check_aggregation(loss_agg_mode, loss_scale_factor)
        self.mode = canonical_mode(mode)
        self.temperature = temperature
        self.delta_low = delta_low
        self.delta_high = delta_high
        self.ratio_cap = ratio_cap
        self.loss_agg_mode = loss_agg_mode
        self.loss_scale_factor = loss_scale_factor
        self.compute_entropy = compute_entropy
        self.vocab_parallel_group = vocab_parallel_group
        self.vocab_offsets = vocab_offsets

    def _settings(self) -> dict:
        """The shared settings as keyword arguments of ``dppo_loss`` / ``fused_linear_dppo_loss``."""
        return dict(mode=self.mode, temperature=self.temperature, delta_low=self.delta_low, delta_high=self.delta_high,
                    ratio_cap=self.ratio_cap, loss_agg_mode=self.loss_agg_mode,
                    loss_scale_factor=self.loss_scale_factor, compute_entropy=self.compute_entropy,
                    vocab_parallel_group=self.vocab_parallel_group, vocab_offsets=self.vocab_offsets)

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, temperature={self.temperature}, delta_low={self.delta_low}, "
                f"delta_high={self.delta_high}, ratio_cap={self.ratio_cap}, loss_agg_mode={self.loss_agg_mode!r}, "
                f"loss_scale_factor={self.loss_scale_factor}")


class DPPOLoss(_LossModule):
    """``nn.Module`` form of :func:`dppo_loss` holding the settings; ``forward`` takes the tensors.

    The settings are checked here, at construction (the same rules as the op's: a known mode, a finite
    temperature > 0, thresholds that are None or finite and >= 0, ratio_cap > 0, a known loss_agg_mode).

    Example::

        crit = DPPOLoss(mode="binary_tv", delta_low=0.15, delta_high=0.15)
        loss, metrics = crit(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    """

    def __init__(
        self,
        mode: str = "binary_tv",
        *,
        temperature: float = 1.0,
        delta_low: Optional[float] = None,
        delta_high: Optional[float] = None,
        ratio_cap: float = 10.0,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: Optional[float] = None,
        compute_entropy: bool = True,
        inplace_backward: bool = False,
        vocab_parallel_group: Optional["torch.distributed.ProcessGroup"] = None,
        vocab_offsets: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(mode, temperature, delta_low, delta_high, ratio_cap, loss_agg_mode, loss_scale_factor,
                         compute_entropy, vocab_parallel_group, vocab_offsets, inplace_backward=inplace_backward)
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
            logits, tokens, rollout_logprobs, advantages, response_mask=response_mask, topk_ids=topk_ids,
            topk_logprobs=topk_logprobs, anchor_logprobs=anchor_logprobs, inplace_backward=self.inplace_backward,
            **self._settings())

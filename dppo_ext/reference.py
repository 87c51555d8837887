"""Readable pure-PyTorch reference of the DPPO loss (docs/contract.md).

This module is the test oracle for ``torch.ops.dppo.*`` and the baseline the benchmarks time.
It is deliberately naive: it materialises the full-vocabulary ``log_softmax`` in the
accumulation dtype (float32, or float64 for float64 logits), gathers from it, computes the
entropy over the whole vocabulary and lets plain autograd produce the gradient. It never imports
the compiled extension, so it vouches for the kernels independently.

Every function is free of data-dependent Python branching, so it runs under
``torch.compile(fullgraph=True)`` (that compiled version is the second benchmark baseline).

Per row i (contract): ``s = z / T``, ``lse = logsumexp(s)``, ``logp = s[a] - lse``,
``pi = exp(logp)``, ``mu_a = exp(anchor or rollout log-prob)``; a divergence ``D`` by mode; the
trust-region mask ``M``; the importance weight ``w = min(exp(min(logp - m, 20)), C)``; the loss
``l = -A * w * M * logp``. Rows whose token is ``-100`` are padding: every output is 0 and so is
their gradient.
"""

from __future__ import annotations

import math

import torch

from .contract import (
    AGG_MODES,
    DEFAULT_AGG_MODE,
    DEFAULT_MASK_DIRECTION,
    DEFAULT_MODE,
    DEFAULT_RATIO_CAP,
    IGNORE_INDEX,
    LOG_RATIO_CLAMP,
    MASS_FLOOR,
    MODES,
    TOPK_MODES,
    accumulation_dtype,
    check_mask_direction,
    resolve_deltas,
)

__all__ = [
    "LOG_MASS_FLOOR",
    "METRIC_KEYS",
    "OUTPUT_KEYS",
    "aggregate_loss_reference",
    "dppo_loss_full_reference",
    "dppo_loss_reference",
    "log1mexp",
]

LOG_MASS_FLOOR = math.log(MASS_FLOOR)
OUTPUT_KEYS = ("loss", "logp", "divergence", "mask", "weight", "entropy", "lse")
METRIC_KEYS = (
    "masked_frac",
    "masked_frac_pos",
    "masked_frac_neg",
    "mismatch_mean",
    "mismatch_max",
    "divergence_mean",
    "entropy_mean",
    "ratio_max",
    "num_tokens",
    "mismatch_k3",
    "log_ratio_min",
    "log_ratio_max",
    "log_ratio_outlier_frac",
    "ess",
    "seq_masked_frac",
)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0``, accurate at both ends (Maechler's two-branch form).

    ``x = 0`` gives ``-inf``; ``x = -inf`` gives 0.
    """
    near_zero = x > -math.log(2.0)
    # Each branch is evaluated on an input clamped into its own accurate range, so the branch
    # that torch.where discards never produces a spurious NaN.
    a = torch.log(-torch.expm1(torch.clamp(x, min=-math.log(2.0))))
    b = torch.log1p(-torch.exp(torch.clamp(x, max=-math.log(2.0))))
    return torch.where(near_zero, a, b)


def _binary_kl(logp: torch.Tensor, log1m_pi: torch.Tensor, log_mu: torch.Tensor) -> torch.Tensor:
    """KL(Bernoulli(mu) || Bernoulli(pi)) from log-probabilities; 0*log0 = 0; clamped at >= 0.

    ``log1m_pi`` is ``log(1 - pi)`` computed from the other tokens' mass; it is floored at
    ``log(1e-12)`` so ``pi == 1`` in floating point gives a large finite value.
    """
    mu = torch.exp(log_mu)
    zero = torch.zeros_like(mu)
    head = torch.where(mu > 0, mu * (log_mu - logp), zero)
    tail = torch.where(mu < 1, (1 - mu) * (log1mexp(log_mu) - torch.clamp(log1m_pi, min=LOG_MASS_FLOOR)), zero)
    return torch.clamp(head + tail, min=0)


def _topk_divergences(
    log_q_full: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K TV and KL between the rollout's top-K (p) and the trainer's softmax (q).

    log_q_full: [N, V] trainer log-softmax; topk_ids: [N, K]; topk_logprobs: [N, K].
    Returns (tv [N], kl [N]) with the "rest" buckets floored at 1e-12.
    """
    log_q = torch.gather(log_q_full, 1, topk_ids)
    q = torch.exp(log_q)
    p = torch.exp(topk_logprobs)
    p_rest = torch.clamp(1 - p.sum(dim=1), min=MASS_FLOOR)
    q_rest = torch.clamp(1 - q.sum(dim=1), min=MASS_FLOOR)
    tv = 0.5 * ((p - q).abs().sum(dim=1) + (p_rest - q_rest).abs())
    kl_terms = torch.where(p > 0, p * (topk_logprobs - log_q), torch.zeros_like(p))
    kl = kl_terms.sum(dim=1) + p_rest * (torch.log(p_rest) - torch.log(q_rest))
    return tv, kl


def kept_set_mask(kept_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, V]`` bool, True at the ids of each row's kept set (``kept_ids [N, S]``, ``-1`` padding; any id outside
    ``[0, V)`` is left out, as a padding row's kept set, which the op never reads, may hold one)."""
    ids = kept_ids.long()
    n = ids.shape[0]
    inside = (ids >= 0) & (ids < vocab)
    spill = torch.where(inside, ids, torch.full_like(ids, vocab))  # padding lands in an extra column
    mask = torch.zeros((n, vocab + 1), dtype=torch.bool, device=kept_ids.device)
    return mask.scatter(1, spill, True)[:, :vocab]


def dppo_loss_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    anchor_logprobs: torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    mode: str = DEFAULT_MODE,
    temperature: float = 1.0,
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    compute_entropy: bool = True,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
) -> dict[str, torch.Tensor]:
    """Per-row DPPO loss, the naive way (full-vocabulary log-softmax, autograd backward).

    Args:
        logits: [N, V] any float dtype; upcast to float32 (float64 stays float64).
        tokens: [N] int sampled token ids; -100 marks a padding row.
        rollout_logprobs: [N] rollout log-prob of each sampled token (may be -inf).
        advantages: [N] per-token advantages.
        topk_ids: [N, K] rollout top-K token ids (top-K modes).
        topk_logprobs: [N, K] rollout log-probs of those ids (top-K modes).
        anchor_logprobs: [N] optional log-probs that replace the rollout's in the mask test only.
        kept_ids: [N, S] optional token ids the rollout's truncation kept (-1 padding): every output is
            then that of the softmax renormalised over the kept set (sampling replay, docs/contract.md),
            the entropy included; logits outside the set get a zero gradient. Not validated here.
        mode: one of ``MODES``.
        temperature, delta_low, delta_high, ratio_cap: the contract's scalars (a None threshold takes
            ``DEFAULT_DELTAS[mode]``).
        compute_entropy: if False the entropy output is all zeros.
        mask_direction: ``"advantage"`` (the side the advantage picks) or ``"symmetric"`` (both sides).

    Returns:
        dict with ``OUTPUT_KEYS``, each [N] in the accumulation dtype. ``loss``, ``logp`` and
        ``entropy`` carry gradients w.r.t. ``logits``; the others are detached constants. A row
        without a distribution (its scaled logits hold a NaN or +inf, or are all -inf, so its lse is
        not finite) has NaN outputs and a NaN gradient.
    """
    if mode not in MODES:  # the oracle takes the canonical names only (aliases are the API's business)
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_mask_direction(mask_direction)
    delta_low, delta_high = resolve_deltas(mode, delta_low, delta_high)
    if mode in TOPK_MODES and (topk_ids is None or topk_logprobs is None):
        raise ValueError(f"mode {mode!r} needs topk_ids and topk_logprobs")
    acc = accumulation_dtype(logits.dtype)
    valid = tokens != IGNORE_INDEX
    zero = torch.zeros((), dtype=acc, device=logits.device)
    safe_tokens = torch.where(valid, tokens, torch.zeros_like(tokens)).long()

    scaled = logits.to(acc) / temperature
    # Rows without a distribution: NaN (0 elsewhere), added to every output so that the value and
    # the gradient of such a row are NaN, as torch.nn.functional.cross_entropy's are.
    poison = torch.where(torch.isfinite(torch.logsumexp(scaled.detach(), dim=-1)), zero, math.nan)
    if kept_ids is not None:
        # Replay: the tokens outside the kept set get -inf, so the softmax below is renormalised over the set
        # and their logits get no gradient. A NaN or +inf outside the set still poisons the row (above).
        kept = kept_set_mask(kept_ids, logits.shape[-1])
        scaled = torch.where(kept, scaled, torch.full_like(scaled, -math.inf))
    log_probs = torch.log_softmax(scaled, dim=-1)  # [N, V], the naive full-vocabulary buffer
    lse = torch.logsumexp(scaled, dim=-1).detach()
    poison = poison + torch.where(torch.isfinite(lse), zero, math.nan)
    logp = torch.where(valid, torch.gather(log_probs, 1, safe_tokens[:, None]).squeeze(1) + poison, zero)

    m = rollout_logprobs.to(acc)
    la = anchor_logprobs.to(acc) if anchor_logprobs is not None else m
    adv = advantages.to(acc)
    lp = logp.detach()
    pi = torch.exp(lp)
    mu_a = torch.exp(la)

    if mode == "binary_kl":
        # log(1 - pi) from the mass of the other tokens (no cancellation as pi -> 1).
        others = log_probs.detach().scatter(1, safe_tokens[:, None], -math.inf)
        divergence = _binary_kl(lp, torch.logsumexp(others, dim=-1), la)
    elif mode in TOPK_MODES:
        ids = torch.where(valid[:, None], topk_ids, torch.zeros_like(topk_ids)).long()
        tv, kl = _topk_divergences(log_probs.detach(), ids, topk_logprobs.to(acc))
        divergence = tv if mode == "topk_tv" else kl
    elif mode == "ratio":
        divergence = torch.exp(torch.clamp(lp - la, max=LOG_RATIO_CLAMP))
    else:  # binary_tv, none
        divergence = (pi - mu_a).abs()

    # The two one-sided tests of the trust region; the advantage direction applies the one A's sign picks.
    if mode == "ratio":
        up, down = divergence > 1 + delta_high, divergence < 1 - delta_low
    else:
        up, down = (pi > mu_a) & (divergence > delta_high), (pi < mu_a) & (divergence > delta_low)
    if mode == "none":
        invalid = torch.zeros_like(up)
    elif mask_direction == "symmetric":
        invalid = up | down
    else:
        invalid = torch.where(adv > 0, up, down)
    mask = (~invalid).to(acc) + poison

    log_ratio = lp - m
    weight = torch.clamp(torch.exp(torch.clamp(log_ratio, max=LOG_RATIO_CLAMP)), max=ratio_cap)
    # Both log-probs -inf (a token impossible under both policies, finite logits): weight 0.
    weight = torch.where(torch.isneginf(lp) & torch.isneginf(m), zero, weight) + poison

    coef = -adv * weight * mask
    loss = torch.where(coef == 0, zero, coef * logp)

    if compute_entropy:
        probs = torch.exp(log_probs)
        safe_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
        entropy = -(probs * safe_log_probs).sum(dim=-1)
    else:
        entropy = torch.zeros_like(lse)

    outputs = {
        "loss": loss,
        "logp": logp,
        "divergence": divergence + poison,
        "mask": mask,
        "weight": weight,
        "entropy": entropy + poison,
        "lse": lse + poison,
    }
    return {key: torch.where(valid, value, zero) for key, value in outputs.items()}


def aggregate_loss_reference(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = DEFAULT_AGG_MODE, loss_scale_factor: float | None = None
) -> torch.Tensor:
    """Aggregate a per-token loss into a scalar with current verl's ``agg_loss`` meanings (docs/aggregation.md).

    Args:
        loss_mat: [B, T] (or [N], treated as one sequence) per-token losses.
        mask: same shape, bool or 0/1; only its nonzero entries count.
        mode: ``token-mean`` (sum / number of valid tokens), ``token-sum`` (sum),
            ``seq-mean-token-sum`` (mean over sequences of per-sequence sums), ``seq-mean-token-mean``
            (mean over sequences of per-sequence means), ``seq-mean-token-sum-norm``
            (``seq-mean-token-sum`` / C), ``token-sum-norm`` (sum / C: the paper's verl fork's
            ``seq-mean-token-sum-norm``). C = ``loss_scale_factor``, default T = mask.shape[-1].

    Sequences with no valid token are left out of the sequence means; an empty selection gives
    0, not NaN.

    Returns:
        0-d tensor in ``loss_mat``'s dtype.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if loss_mat.dim() == 1:
        loss_mat = loss_mat[None]
        mask = mask[None]
    weights = mask.to(loss_mat.dtype)
    masked = torch.where(weights != 0, loss_mat * weights, torch.zeros_like(loss_mat))
    seq_sums = masked.sum(dim=-1)
    seq_counts = weights.sum(dim=-1)
    horizon = max(mask.shape[-1], 1) if loss_scale_factor is None else loss_scale_factor
    if mode == "token-mean":
        return masked.sum() / torch.clamp(weights.sum(), min=1)
    if mode == "token-sum":
        return masked.sum()
    if mode == "token-sum-norm":
        return masked.sum() / horizon
    seq_valid = seq_counts > 0
    if mode == "seq-mean-token-mean":
        per_seq = seq_sums / torch.clamp(seq_counts, min=1)
    else:
        per_seq = seq_sums
    per_seq = torch.where(seq_valid, per_seq, torch.zeros_like(per_seq))
    seq_mean = per_seq.sum() / torch.clamp(seq_valid.sum(), min=1).to(loss_mat.dtype)
    return seq_mean / horizon if mode == "seq-mean-token-sum-norm" else seq_mean


def _masked_mean(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``select``; 0 for an empty selection."""
    picked = torch.where(select, values, torch.zeros_like(values))
    return picked.sum() / torch.clamp(select.sum(), min=1).to(values.dtype)


def _masked_max(values: torch.Tensor, select: torch.Tensor) -> torch.Tensor:
    """Max of non-negative ``values`` where ``select``; 0 for an empty selection."""
    picked = torch.where(select, values, torch.zeros_like(values))
    return torch.cat([picked.reshape(-1), values.new_zeros(1)]).amax()


def _signed_extreme(values: torch.Tensor, select: torch.Tensor, reduce) -> torch.Tensor:
    """``reduce`` (``torch.amin`` / ``torch.amax``) of ``values`` where ``select``; 0 for an empty selection."""
    fill = math.inf if reduce is torch.amin else -math.inf
    picked = torch.where(select, values, torch.full_like(values, fill))
    extreme = reduce(torch.cat([picked.reshape(-1), values.new_full((1,), fill)]))
    return torch.where(select.any(), extreme, torch.zeros_like(extreme))


def dppo_loss_full_reference(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    response_mask: torch.Tensor | None = None,
    mode: str = DEFAULT_MODE,
    topk_ids: torch.Tensor | None = None,
    topk_logprobs: torch.Tensor | None = None,
    anchor_logprobs: torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    delta_low: float | None = None,
    delta_high: float | None = None,
    ratio_cap: float = DEFAULT_RATIO_CAP,
    loss_agg_mode: str = DEFAULT_AGG_MODE,
    loss_scale_factor: float | None = None,
    compute_entropy: bool = True,
    mask_direction: str = DEFAULT_MASK_DIRECTION,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """End-to-end naive equivalent of ``dppo_ext.dppo_loss``: scalar loss plus metrics.

    Args:
        logits: [..., V] (e.g. [B, T, V]).
        tokens, rollout_logprobs: [...] matching ``logits.shape[:-1]``.
        advantages: [...] per token, or [B] (or [B, 1]) per sequence when ``logits`` is [B, T, V].
        response_mask: [...] bool or 0/1; None means every token counts. Tokens with mask 0
            (or token id -100) are padding.
        topk_ids, topk_logprobs: [..., K]; anchor_logprobs: [...]; kept_ids: [..., S].
        loss_agg_mode, loss_scale_factor: see aggregate_loss_reference.
        delta_low, delta_high: None takes ``DEFAULT_DELTAS[mode]``.
        Other arguments: as in ``dppo_loss_reference``.

    Returns:
        (loss 0-d, metrics) where metrics maps ``METRIC_KEYS`` to detached 0-d float tensors,
        all over the valid tokens: masked_frac = fraction with mask 0; masked_frac_pos /
        masked_frac_neg = the same fraction among tokens with A > 0 / A < 0; mismatch_mean /
        mismatch_max = mean / max of |pi - mu| (mu = the rollout's probability); divergence_mean;
        entropy_mean; ratio_max = max of pi / mu (log-ratio clamped at 20, not capped at C);
        num_tokens = number of valid tokens; the mismatch metrics of docs/contract.md, with
        delta = clamp(logp - m, -20, 20) (0 where both are -inf) and r = exp(delta): mismatch_k3 =
        mean(r - 1 - delta), log_ratio_min / log_ratio_max, log_ratio_outlier_frac = share with
        |delta| > ln 2, ess = (sum r)^2 / (n * sum r^2); seq_masked_frac = 0 (no sequence mask: see
        ``dppo_ext.reference_masks``). Empty selections give 0.
    """
    if mode not in MODES:  # the oracle takes the canonical names only (aliases are the API's business)
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    delta_low, delta_high = resolve_deltas(mode, delta_low, delta_high)
    lead = logits.shape[:-1]
    vocab = logits.shape[-1]
    if len(lead) == 2 and advantages.shape in (lead[:1], (lead[0], 1)):
        advantages = advantages.reshape(-1, 1).expand(lead)
    if response_mask is None:
        valid = tokens != IGNORE_INDEX
    else:
        valid = (response_mask != 0) & (tokens != IGNORE_INDEX)
    flat_tokens = torch.where(valid, tokens, torch.full_like(tokens, IGNORE_INDEX)).reshape(-1)
    out = dppo_loss_reference(
        logits.reshape(-1, vocab),
        flat_tokens,
        rollout_logprobs.reshape(-1),
        advantages.reshape(-1),
        topk_ids=None if topk_ids is None else topk_ids.reshape(-1, topk_ids.shape[-1]),
        topk_logprobs=None if topk_logprobs is None else topk_logprobs.reshape(-1, topk_logprobs.shape[-1]),
        anchor_logprobs=None if anchor_logprobs is None else anchor_logprobs.reshape(-1),
        kept_ids=None if kept_ids is None else kept_ids.reshape(-1, kept_ids.shape[-1]),
        mode=mode,
        temperature=temperature,
        delta_low=delta_low,
        delta_high=delta_high,
        ratio_cap=ratio_cap,
        compute_entropy=compute_entropy,
        mask_direction=mask_direction,
    )
    loss_mat = out["loss"].reshape(lead)
    loss = aggregate_loss_reference(loss_mat, valid, loss_agg_mode, loss_scale_factor)

    flat_valid = valid.reshape(-1)
    acc = out["loss"].dtype
    adv = advantages.reshape(-1).to(acc)
    masked_out = (1 - out["mask"]).detach()
    logp = out["logp"].detach()
    m = rollout_logprobs.reshape(-1).to(acc)
    mismatch = (logp.exp() - m.exp()).abs()
    impossible = torch.isneginf(logp) & torch.isneginf(m)  # a NaN row keeps its NaN
    ratio = torch.where(impossible, torch.zeros_like(logp), torch.exp(torch.clamp(logp - m, max=LOG_RATIO_CLAMP)))
    delta = torch.where(impossible, torch.zeros_like(logp), torch.clamp(logp - m, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    r = torch.exp(delta)
    n_valid = flat_valid.sum().to(acc)
    r_valid = torch.where(flat_valid, r, torch.zeros_like(r))
    r_sum_sq = (r_valid**2).sum()
    ess = torch.where(r_sum_sq > 0, r_valid.sum() ** 2 / (n_valid * r_sum_sq), torch.zeros_like(r_sum_sq))
    metrics = {
        "masked_frac": _masked_mean(masked_out, flat_valid),
        "masked_frac_pos": _masked_mean(masked_out, flat_valid & (adv > 0)),
        "masked_frac_neg": _masked_mean(masked_out, flat_valid & (adv < 0)),
        "mismatch_mean": _masked_mean(mismatch, flat_valid),
        "mismatch_max": _masked_max(mismatch, flat_valid),
        "divergence_mean": _masked_mean(out["divergence"], flat_valid),
        "entropy_mean": _masked_mean(out["entropy"].detach(), flat_valid),
        "ratio_max": _masked_max(ratio, flat_valid),
        "num_tokens": n_valid,
        "mismatch_k3": _masked_mean(r - 1 - delta, flat_valid),
        "log_ratio_min": _signed_extreme(delta, flat_valid, torch.amin),
        "log_ratio_max": _signed_extreme(delta, flat_valid, torch.amax),
        "log_ratio_outlier_frac": _masked_mean((delta.abs() > math.log(2.0)).to(acc), flat_valid),
        "ess": ess,
        "seq_masked_frac": torch.zeros((), dtype=acc),  # no sequence mask here: dppo_ext.reference_masks has them
    }
    return loss, metrics

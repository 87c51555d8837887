"""Parity with the official DPPO implementation (sail-sg/Stable-RL, built on verl).

The functions below re-derive, independently and in plain PyTorch, the formulas Stable-RL publishes in
``verl/trainer/ppo/core_algos.py`` (the per-token trust-region mask of ``_compute_token_mask_for_policy_loss``
and the surrogate of ``compute_policy_loss_with_mask``), ``verl/workers/actor/utils.py`` (``compute_topk_kl``:
top-K plus one "rest" bucket) and the fork's ``agg_loss``; the aggregation also against current verl's
``agg_loss`` (verl-project/verl, since PR 5417). They keep that code's numerical conventions: the importance
ratio's log clamped at 20 then capped at ``clip_ratio_c``, a 1e-8 smoothing inside the binary KL's second log,
and the top-K masses clamped at 1e-12. Our op computes the binary KL without the smoothing, so the comparison
runs where those epsilons are negligible (no token with pi or mu within 1e-4 of 1, no mu = 0, which their form
turns into NaN), and skips rows whose mask decision is a near-tie.

Their loss modes map onto ours: dppo_binary_tv/kl -> binary_tv/kl, dppo_topk_tv/kl -> topk_tv/kl,
ppo (GRPO) -> ratio, pg_no_mask (CISPO-like) -> none, and each *_recompute variant -> the same mode
with ``anchor_logprobs`` = the recomputed old-policy log-probs. Their aggregation names map onto ours
as ``FORK_AGG`` says: the fork's ``seq-mean-token-sum-norm`` (sum / T) is our ``token-sum-norm``; our
``seq-mean-token-sum-norm`` is current verl's (sum / (non-empty sequences * T)).
"""

from __future__ import annotations

import pytest
import torch
from dppo_testing import ambiguous_rows, reference_outputs

from dppo_ext import dppo_loss, dppo_loss_per_row
from dppo_ext.contract import AGG_MODES, TOPK_MODES

# Stable-RL loss mode -> (our mode, uses the recomputed old-policy log-probs as mask anchor).
MODE_MAP = {
    "dppo_binary_tv": ("binary_tv", False),
    "dppo_binary_kl": ("binary_kl", False),
    "dppo_topk_tv": ("topk_tv", False),
    "dppo_topk_kl": ("topk_kl", False),
    "ppo": ("ratio", False),
    "pg_no_mask": ("none", False),
    "dppo_binary_tv_recompute": ("binary_tv", True),
    "dppo_binary_kl_recompute": ("binary_kl", True),
    "ppo_recompute": ("ratio", True),
}
CLIP_LOW, CLIP_HIGH, CLIP_RATIO_C = 0.05, 0.08, 10.0


def stable_rl_topk(scaled_logits: torch.Tensor, ids: torch.Tensor, rollout_lp: torch.Tensor):
    """Top-K + rest KL and TV between the rollout (P) and the trainer (Q, from logits already
    divided by the temperature). Shapes: [..., V], [..., K], [..., K] -> ([...], [...])."""
    log_q_all = torch.log_softmax(scaled_logits, dim=-1)
    log_q = log_q_all.gather(-1, ids)
    q = log_q.exp()
    p = rollout_lp.exp()
    floor = 1e-12
    q_rest = (1.0 - q.sum(-1)).clamp(min=floor)
    p_rest = (1.0 - p.sum(-1)).clamp(min=floor)
    kl = (p * (rollout_lp - log_q)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    tv = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    return kl, tv


def stable_rl_token_mask(loss_mode: str, log_prob, rollout_lp, old_lp, adv, topk_kl=None, topk_tv=None):
    """1 = keep, 0 = outside the trust region; also the quantity each mode tests (or None)."""
    prob, mu, old = log_prob.exp(), rollout_lp.exp(), old_lp.exp()
    recompute = loss_mode.endswith("_recompute")
    ref_lp, ref_p = (old_lp, old) if recompute else (rollout_lp, mu)
    base = loss_mode.removesuffix("_recompute")
    if base == "dppo_binary_kl":
        smooth = 1e-8
        stat = ref_p * (ref_lp - log_prob) + (1 - ref_p) * torch.log((1 - ref_p + smooth) / (1 - prob + smooth))
        bad_pos, bad_neg = (stat > CLIP_HIGH) & (prob > ref_p), (stat > CLIP_LOW) & (prob < ref_p)
    elif base == "dppo_binary_tv":
        diff = prob - ref_p
        stat = diff.abs()
        bad_pos, bad_neg = diff > CLIP_HIGH, diff < -CLIP_LOW
    elif base in ("dppo_topk_kl", "dppo_topk_tv"):
        stat = topk_kl if base == "dppo_topk_kl" else topk_tv
        bad_pos, bad_neg = (stat > CLIP_HIGH) & (prob > mu), (stat > CLIP_LOW) & (prob < mu)
    elif base == "ppo":
        stat = torch.exp(log_prob - ref_lp)
        bad_pos, bad_neg = stat > 1 + CLIP_HIGH, stat < 1 - CLIP_LOW
    elif base == "pg_no_mask":
        stat = None
        bad_pos = bad_neg = torch.zeros_like(prob, dtype=torch.bool)
    else:
        raise ValueError(loss_mode)
    bad = torch.where(adv > 0, bad_pos, bad_neg)
    return 1.0 - bad.to(prob.dtype), stat


def stable_rl_pg_losses(log_prob, rollout_lp, adv, mask):
    """-A * sg(min(exp(min(log pi - log mu, 20)), clip_ratio_c)) * sg(mask) * log pi per token
    (sg = stop-gradient: the ratio and the mask are constants, only log pi is differentiated)."""
    ratio = torch.exp(torch.clamp(log_prob - rollout_lp, max=20.0)).clamp(max=CLIP_RATIO_C).detach()
    return -adv * ratio * mask.detach() * log_prob


# The fork's loss_agg_mode -> ours.
FORK_AGG = {
    "token-mean": "token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum-norm": "token-sum-norm",
}
VERL_AGG = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def stable_rl_agg_loss(loss_mat, loss_mask, mode):
    """The fork's agg_loss on one micro-batch (dp_size 1, batch sizes from the batch itself)."""
    loss_mask = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        return (loss_mat * loss_mask).sum() / loss_mask.sum()
    seq_sum = (loss_mat * loss_mask).sum(-1)
    counts = loss_mask.sum(-1)
    seq_has = (counts > 0).to(loss_mat.dtype)
    if mode == "seq-mean-token-sum":
        return (seq_sum * seq_has).sum() / seq_has.sum()
    if mode == "seq-mean-token-mean":
        return (seq_sum / (counts + 1e-8) * seq_has).sum() / seq_has.sum()
    if mode == "seq-mean-token-sum-norm":
        return seq_sum.sum() / loss_mask.shape[-1]
    raise ValueError(mode)


def verl_agg_loss(loss_mat, loss_mask, mode):
    """Current verl's agg_loss on one micro-batch (dp_size 1, batch sizes from the batch, no loss_scale_factor)."""
    loss_mask = loss_mask.to(loss_mat.dtype)
    seq_sum = (loss_mat * loss_mask).sum(-1)
    counts = loss_mask.sum(-1)
    seq_has = (counts > 0).to(loss_mat.dtype)
    if mode == "token-mean":
        return seq_sum.sum() / loss_mask.sum()
    if mode == "token-sum":
        return seq_sum.sum()
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = (seq_sum * seq_has).sum() / seq_has.sum()
        return loss / loss_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss
    if mode == "seq-mean-token-mean":
        return (seq_sum / (counts + 1e-8) * seq_has).sum() / seq_has.sum()
    raise ValueError(mode)


def _inputs(dtype: torch.dtype, seed: int, b: int = 6, t: int = 12, v: int = 97, k: int = 8, temperature: float = 0.8):
    """[B, T, V] logits in a regime where Stable-RL's epsilons are negligible: pi, mu < 0.999,
    mu > 0, rollout = trainer logits + noise, old policy = a smaller perturbation."""
    gen = torch.Generator().manual_seed(seed)
    z = (1.5 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)).to(dtype)
    z64 = z.double()
    roll_logits = z64 + 0.8 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)
    rollout_all = torch.log_softmax(roll_logits / temperature, dim=-1)
    old_all = torch.log_softmax(
        (z64 + 0.3 * torch.randn(b, t, v, generator=gen, dtype=torch.float64)) / temperature, -1
    )
    tokens = torch.multinomial(rollout_all.exp().reshape(-1, v), 1, generator=gen).reshape(b, t)
    rollout_lp = rollout_all.gather(-1, tokens[..., None]).squeeze(-1)
    old_lp = old_all.gather(-1, tokens[..., None]).squeeze(-1)
    topk_lp, topk_ids = rollout_all.topk(k, dim=-1)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 7:] = False
    mask[4, 3:] = False
    return {
        "logits": z,
        "tokens": tokens,
        "rollout_lp": rollout_lp,
        "old_lp": old_lp,
        "topk_ids": topk_ids,
        "topk_lp": topk_lp,
        "adv": adv,
        "mask": mask,
        "temperature": temperature,
    }


def _theirs(loss_mode: str, d: dict):
    """Per-token (loss, mask, statistic) the Stable-RL way, in float64."""
    scaled = d["logits"].double() / d["temperature"]
    log_prob = torch.log_softmax(scaled, -1).gather(-1, d["tokens"][..., None]).squeeze(-1)
    adv = d["adv"][:, None].expand_as(log_prob)
    topk_kl, topk_tv = stable_rl_topk(scaled, d["topk_ids"], d["topk_lp"])
    mask, stat = stable_rl_token_mask(loss_mode, log_prob, d["rollout_lp"], d["old_lp"], adv, topk_kl, topk_tv)
    mask = mask * d["mask"]
    return stable_rl_pg_losses(log_prob, d["rollout_lp"], adv, mask), mask, stat, log_prob


def _ours(loss_mode: str, d: dict):
    mode, recompute = MODE_MAP[loss_mode]
    acc = torch.float64 if d["logits"].dtype == torch.float64 else torch.float32
    v = d["logits"].shape[-1]
    tokens = torch.where(d["mask"], d["tokens"], -100).reshape(-1)
    kwargs = {
        "logits": d["logits"].reshape(-1, v),
        "tokens": tokens,
        "rollout_logprobs": d["rollout_lp"].reshape(-1).to(acc),
        "advantages": d["adv"][:, None].expand_as(d["rollout_lp"]).reshape(-1).to(acc),
        "topk_ids": d["topk_ids"].reshape(-1, d["topk_ids"].shape[-1]) if mode in TOPK_MODES else None,
        "topk_logprobs": d["topk_lp"].reshape(-1, d["topk_lp"].shape[-1]).to(acc) if mode in TOPK_MODES else None,
        "anchor_logprobs": d["old_lp"].reshape(-1).to(acc) if recompute else None,
        "mode": mode,
        "temperature": d["temperature"],
        "delta_low": CLIP_LOW,
        "delta_high": CLIP_HIGH,
        "ratio_cap": CLIP_RATIO_C,
    }
    with torch.no_grad():
        out = dppo_loss_per_row(**kwargs)
    return out, kwargs


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=("float64", "float32"))
@pytest.mark.parametrize("loss_mode", list(MODE_MAP))
def test_per_token_parity(loss_mode, dtype):
    d = _inputs(dtype, seed=list(MODE_MAP).index(loss_mode))
    loss_t, mask_t, stat_t, log_prob = _theirs(loss_mode, d)
    out, kwargs = _ours(loss_mode, d)
    # The regime: no probability near 1, no mu = 0 (their smoothing / 0 * inf would matter).
    valid = d["mask"].reshape(-1)
    assert log_prob.exp().max() < 0.999 and d["rollout_lp"].exp().max() < 0.999
    assert torch.isfinite(d["rollout_lp"]).all()
    kw64 = dict(kwargs, logits=kwargs["logits"].double())
    for key in ("rollout_logprobs", "advantages", "topk_logprobs", "anchor_logprobs"):
        if kw64[key] is not None:
            kw64[key] = kw64[key].double()
    ref64 = reference_outputs(kw64)
    keep = valid & ~ambiguous_rows(kw64, ref64, margin=1e-4)
    assert keep.sum() > 0.8 * valid.sum(), "too many near-tie rows for a meaningful comparison"
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 2e-5}

    torch.testing.assert_close(out.mask.double()[keep], mask_t.reshape(-1)[keep], rtol=0, atol=0)
    torch.testing.assert_close(out.loss.double()[keep], loss_t.reshape(-1)[keep], **tol)
    torch.testing.assert_close(out.logp.double()[valid], log_prob.reshape(-1)[valid], **tol)
    if stat_t is not None:
        # binary KL: their 1e-8 smoothing shifts the value by ~1e-8 / (1 - pi) <= 1e-5 here.
        stat_tol = {"rtol": 1e-4, "atol": 1e-6} if "binary_kl" in loss_mode else tol
        torch.testing.assert_close(out.divergence.double()[valid], stat_t.reshape(-1)[valid], **stat_tol)
    if MODE_MAP[loss_mode][0] != "none":
        assert (mask_t.reshape(-1)[valid] == 0).any(), "the parity inputs should mask some tokens"


AGG_CASES = [("fork", agg, ours) for agg, ours in FORK_AGG.items()] + [("verl", agg, agg) for agg in VERL_AGG]


def test_agg_cases_cover_our_modes():
    assert {ours for _, _, ours in AGG_CASES} == set(AGG_MODES)


@pytest.mark.parametrize("source, agg, ours", AGG_CASES, ids=[f"{s}-{a}" for s, a, _ in AGG_CASES])
@pytest.mark.parametrize("loss_mode", ("dppo_binary_tv", "dppo_topk_kl", "ppo_recompute"))
def test_aggregated_loss_parity(loss_mode, source, agg, ours):
    """The scalar loss of dppo_ext.dppo_loss equals Stable-RL's pg_loss through the fork's or current verl's
    agg_loss, under the name ``FORK_AGG`` / verl gives."""
    d = _inputs(torch.float64, seed=100 + AGG_MODES.index(ours))
    loss_t, _, _, _ = _theirs(loss_mode, d)
    want = (stable_rl_agg_loss if source == "fork" else verl_agg_loss)(loss_t, d["mask"], agg)
    mode, recompute = MODE_MAP[loss_mode]
    got, _ = dppo_loss(
        d["logits"],
        d["tokens"],
        d["rollout_lp"],
        d["adv"],
        response_mask=d["mask"],
        mode=mode,
        topk_ids=d["topk_ids"] if mode in TOPK_MODES else None,
        topk_logprobs=d["topk_lp"] if mode in TOPK_MODES else None,
        anchor_logprobs=d["old_lp"] if recompute else None,
        temperature=d["temperature"],
        delta_low=CLIP_LOW,
        delta_high=CLIP_HIGH,
        ratio_cap=CLIP_RATIO_C,
        loss_agg_mode=ours,
    )
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-10)


def test_gradient_parity():
    """Stable-RL differentiates -A * sg(ratio) * sg(mask) * log pi; so does the op."""
    d = _inputs(torch.float64, seed=7)
    logits = d["logits"].clone().requires_grad_(True)
    log_prob = torch.log_softmax(logits / d["temperature"], -1).gather(-1, d["tokens"][..., None]).squeeze(-1)
    adv = d["adv"][:, None].expand_as(log_prob)
    mask, _ = stable_rl_token_mask("dppo_binary_tv", log_prob.detach(), d["rollout_lp"], d["old_lp"], adv)
    loss_t = stable_rl_agg_loss(
        stable_rl_pg_losses(log_prob, d["rollout_lp"], adv, mask * d["mask"]), d["mask"], "token-mean"
    )
    loss_t.backward()
    ours = d["logits"].clone().requires_grad_(True)
    loss_o, _ = dppo_loss(
        ours,
        d["tokens"],
        d["rollout_lp"],
        d["adv"],
        response_mask=d["mask"],
        mode="binary_tv",
        temperature=d["temperature"],
        delta_low=CLIP_LOW,
        delta_high=CLIP_HIGH,
        ratio_cap=CLIP_RATIO_C,
    )
    loss_o.backward()
    torch.testing.assert_close(ours.grad, logits.grad, rtol=1e-7, atol=1e-12)

"""Parity of the mask family with the frameworks that run it, in float64 on the same inputs.

TRL 1.16 is installed: its ``GRPOTrainer.get_off_policy_mask`` is imported and called. Its ``sequence_mask`` /
``token_mask`` modes are inline in ``GRPOTrainer._generate_and_score_completions`` (trl/trainer/grpo_trainer.py of
trl 1.16.0), so their formula is written here from that code. prime-rl, verl and OpenRLHF are not installed: each
formula is written from the framework's source at the commit named beside it (read, never copied). The frameworks
take their masks from the old policy's log-probs recomputed once per batch; ours from the op's current ``logp``: the
same numbers on a batch's first optimizer step, which is what these inputs are (``pi_old = pi``).

Conventions that differ (docs/names.md): prime-rl's surrogate is ``-A * r`` with ``r = pi / mu`` differentiable and
uncapped (ours ``-A * w * log pi`` with ``w = min(r, C)`` a constant: the same gradient while ``r < C``, a different
loss value); verl's ``k1`` options bound ``exp(k1) = mu / pi`` (so an asymmetric ``"lower_upper"`` band is a band on
``mu / pi``, not on ``pi / mu``) and clamp each log-ratio at +-20 (as we do); TRL and OpenRLHF do not clamp.
"""

from __future__ import annotations

import math

import pytest
import torch

from dppo_ext import SequenceMask, dppo_loss, dppo_loss_per_row, icepop_deltas

B, T, V = 6, 9, 41


def _inputs(seed: int = 0, spread: float = 0.4) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    scale = spread * torch.linspace(0.05, 2.0, B, dtype=torch.float64)[:, None]
    rollout = (logp + scale * torch.randn(B, T, generator=gen, dtype=torch.float64)).clamp(max=-1e-6)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.3, 2.0, -2.0], dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 6:] = False
    mask[4, 1:] = False
    return dict(logits=logits, tokens=tokens, logp=logp, rollout=rollout, adv=adv, mask=mask)


def _rows(x: dict, **settings) -> torch.Tensor:
    """Our per-row mask on [B, T] (padding rows -100), rows of a sequence named by their b."""
    tokens = torch.where(x["mask"], x["tokens"], torch.full_like(x["tokens"], -100)).reshape(-1)
    out = dppo_loss_per_row(
        x["logits"].reshape(B * T, V),
        tokens,
        x["rollout"].reshape(-1),
        x["adv"][:, None].expand(B, T).reshape(-1),
        sequence_ids=torch.arange(B).repeat_interleave(T),
        **settings,
    )
    return out.mask.reshape(B, T)


def _mixed(keep: torch.Tensor, mask: torch.Tensor) -> None:
    assert keep[mask].any() and (~keep[mask]).any(), "the inputs must keep some tokens and drop others"


# ---- TRL 1.16 -------------------------------------------------------------------------------------------------------


def test_trl_off_policy_mask_is_ours_called_on_its_own_code():
    grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    x = _inputs(seed=1)
    threshold = 0.05
    theirs = grpo.GRPOTrainer.get_off_policy_mask(
        advantages=x["adv"][:, None],
        per_token_logps=x["logp"],
        sampling_per_token_logps=x["rollout"],
        mask=x["mask"].double(),
        off_policy_threshold=threshold,
    )  # [B, 1], 1 = keep
    ours = _rows(x, mode="none", sequence_mask=SequenceMask.off_policy(threshold))
    keep = theirs.bool().expand(B, T)
    _mixed(keep, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], keep[x["mask"]].double(), rtol=0, atol=0)


def _trl_is_mask(x: dict, mode: str, clip_min, clip_max) -> torch.Tensor:
    """trl 1.16.0 grpo_trainer.py, _generate_and_score_completions: the ratio of the old policy to vLLM's per token
    (token_*) or exp of its sum over the completion (sequence_*), zeroed outside [clip_min, clip_max] (*_mask)."""
    diff = (x["logp"] - x["rollout"]) * x["mask"]
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode == "sequence_mask" else diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ~((ratio < low) | (ratio > high)).expand(B, T)


@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.2, None)])
def test_trl_sequence_mask(clip_min, clip_max):
    x = _inputs(seed=2)
    keep = _trl_is_mask(x, "sequence_mask", clip_min, clip_max)
    ours = _rows(x, mode="none", sequence_mask=SequenceMask.from_trl("sequence_mask", clip_min, clip_max))
    _mixed(keep, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], keep[x["mask"]].double(), rtol=0, atol=0)


def test_trl_token_mask_is_the_symmetric_ratio_mode():
    x = _inputs(seed=3)
    clip_min, clip_max = 0.7, 1.5
    keep = _trl_is_mask(x, "token_mask", clip_min, clip_max)
    low, high = icepop_deltas(clip_min, clip_max)
    ours = _rows(x, mode="ratio", mask_direction="symmetric", delta_low=low, delta_high=high)
    _mixed(keep, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], keep[x["mask"]].double(), rtol=0, atol=0)


# ---- prime-rl (PrimeIntellect-ai/prime-rl 559b44772e471d1538537b8805cc77f3824a5e64, src/prime_rl/trainer/rl/loss.py)


def _prime_rl_loss(logits: torch.Tensor, x: dict, ipo: bool, threshold: float, kl_tau: float) -> torch.Tensor:
    """ipo_loss_fn / default_loss_fn per sample, summed over the samples (loss_scale 1): keep = not masked, pg =
    keep * A * r with r = exp(log pi - log mu) differentiable, plus kl_tau * (log r)^2 on every loss-mask token."""
    logp = torch.log_softmax(logits, -1).gather(-1, x["tokens"][..., None]).squeeze(-1)
    log_r = logp - x["rollout"]
    diff = torch.exp(logp) - torch.exp(x["rollout"])
    adv = x["adv"][:, None].expand(B, T)
    if ipo:
        masked = diff.abs() > threshold
    else:
        masked = torch.where(adv > 0, diff > threshold, diff < -threshold)
    keep = x["mask"] & ~masked
    per_token = -(keep * adv * torch.exp(log_r)) + kl_tau * (x["mask"] * log_r**2)
    return per_token.sum()


@pytest.mark.parametrize("ipo", (True, False), ids=("ipo", "default_dppo_kl"))
def test_prime_rl_gradient(ipo):
    """prime-rl's IPO (symmetric |pi - mu| > 0.1) and default loss (advantage-conditioned, 0.2) with kl_tau: the same
    gradient as ours (binary_tv, token-sum, uncapped weight, kl_tau on all tokens); the loss value differs by the
    surrogate (A * r vs A * r * log pi)."""
    x = _inputs(seed=4, spread=0.6)
    threshold, kl_tau = (0.1, 1e-3) if ipo else (0.2, 1e-3)
    z1 = x["logits"].clone().requires_grad_(True)
    theirs = _prime_rl_loss(z1, x, ipo, threshold, kl_tau)
    theirs.backward()
    z2 = x["logits"].clone().requires_grad_(True)
    ours, metrics = dppo_loss(
        z2,
        x["tokens"],
        x["rollout"],
        x["adv"],
        response_mask=x["mask"],
        mode="binary_tv",
        mask_direction="symmetric" if ipo else "advantage",
        delta_low=threshold,
        delta_high=threshold,
        ratio_cap=math.inf,
        kl_tau=kl_tau,
        loss_agg_mode="token-sum",
    )
    ours.backward()
    assert 0 < float(metrics["masked_frac"]) < 1
    torch.testing.assert_close(z2.grad, z1.grad, rtol=1e-10, atol=1e-13)
    assert not torch.isclose(ours, theirs), "the surrogates' values differ (documented in docs/names.md)"


# ---- verl (verl-project/verl 20c30bf8b70e37fae4b38f5ccf170f20e349395d, verl/trainer/ppo/rollout_corr_helper.py)


def _verl_rejection(x: dict, option: str, threshold: str) -> torch.Tensor:
    """compute_rollout_rejection_mask for one seq_* option: log_ratio = log pi_old - log mu clamped at +-20; k1 =
    -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio; masked sum / mean (its masked_mean divides
    by the count + 1e-8) / max (masked -inf, an empty row 0); k1 keeps log(lower) <= value <= log(upper) (lower
    defaults to 1 / upper), k2 / k3 keep value <= upper."""
    log_r = (x["logp"] - x["rollout"]).clamp(-20, 20)
    _, reduce, stat = option.split("_")
    per_token = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": torch.exp(log_r) - 1 - log_r}[stat]
    m = x["mask"].double()
    if reduce == "sum":
        value = (per_token * m).sum(-1)
    elif reduce == "mean":
        value = (per_token * m).sum(-1) / (m.sum(-1) + 1e-8)
    else:
        value = per_token.masked_fill(~x["mask"], -math.inf).max(-1).values
        value = torch.where(value == -math.inf, torch.zeros_like(value), value)
    if stat == "k1":
        upper = float(threshold.split("_")[-1])
        lower = float(threshold.split("_")[0]) if "_" in threshold else 1 / upper
        keep = (value >= math.log(lower)) & (value <= math.log(upper))
    else:
        keep = value <= float(threshold)
    return keep[:, None].expand(B, T)


@pytest.mark.parametrize(
    "option, threshold",
    [
        ("seq_sum_k1", "2.0"),
        ("seq_sum_k1", "0.5_1.5"),
        ("seq_mean_k1", "0.8_1.1"),
        ("seq_sum_k2", "0.3"),
        ("seq_mean_k2", "0.02"),
        ("seq_sum_k3", "0.3"),
        ("seq_mean_k3", "0.02"),
        ("seq_max_k2", "0.1"),
        ("seq_max_k3", "0.1"),
    ],
)
def test_verl_rejection_modes(option, threshold):
    x = _inputs(seed=5)
    keep = _verl_rejection(x, option, threshold)
    ours = _rows(x, mode="none", sequence_mask=SequenceMask.from_verl(option, threshold))
    _mixed(keep, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], keep[x["mask"]].double(), rtol=0, atol=0)


def test_verl_k1_band_is_on_mu_over_pi():
    """verl's k1 is log(mu / pi): its band "0.5_1.5" keeps sum(log pi - log mu) in [-log 1.5, -log 0.5], which is
    TRL's ratio band [1 / 1.5, 2] on pi / mu, not [0.5, 1.5]."""
    verl = SequenceMask.from_verl("seq_sum_k1", "0.5_1.5")
    same, other = SequenceMask.ratio_band("sum", 1 / 1.5, 2.0), SequenceMask.ratio_band("sum", 0.5, 1.5)
    assert (verl.low, verl.high) == (pytest.approx(same.low), pytest.approx(same.high))
    assert (verl.low, verl.high) != (pytest.approx(other.low), pytest.approx(other.high))


# ---- OpenRLHF (OpenRLHF/OpenRLHF 3c3be6234e0cb353e76bb8019947db9dfe99fca7, openrlhf/models/loss.py, PolicyLoss) --


def test_openrlhf_icepop_and_seq_mask_tis():
    """icepop keeps a token when low <= exp(log pi_old - log mu) <= high; seq-mask-tis keeps a sequence when the exp
    of the masked mean of that log-ratio is in [low, high] (its is_correction_threshold, default [0.5, 5.0])."""
    x = _inputs(seed=6, spread=1.0)
    low, high = 0.5, 2.0
    log_r = x["logp"] - x["rollout"]
    icepop = (torch.exp(log_r) >= low) & (torch.exp(log_r) <= high)
    d_low, d_high = icepop_deltas(low, high)
    ours = _rows(x, mode="ratio", mask_direction="symmetric", delta_low=d_low, delta_high=d_high)
    _mixed(icepop, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], icepop[x["mask"]].double(), rtol=0, atol=0)
    m = x["mask"].double()
    seq = torch.exp((log_r * m).sum(-1) / m.sum(-1))
    keep = ((seq >= low) & (seq <= high))[:, None].expand(B, T)
    ours = _rows(x, mode="none", sequence_mask=SequenceMask.ratio_band("mean", low, high))
    _mixed(keep, x["mask"])
    torch.testing.assert_close(ours[x["mask"]], keep[x["mask"]].double(), rtol=0, atol=0)

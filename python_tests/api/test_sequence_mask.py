"""Sequence masks and the squared-log-ratio penalty (docs/contract.md, "Sequence masks", "Log-ratio penalty"), composed
by every entry point on the op's per-row outputs: loss, gradient and metrics against the float64 reference of
``dppo_ext.reference_masks`` (one Python loop per sequence), the packed-row forms (``sequence_ids``, ``cu_seqlens``),
the edge cases (empty, one-token, all-masked sequences) and the errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from dppo_ext import (
    DPPOLoss,
    FusedLinearDPPOLoss,
    SequenceMask,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
)
from dppo_ext.reference import dppo_loss_reference
from dppo_ext.reference_masks import composed_rows_reference, dppo_loss_composed_reference


def _batch(seed: int = 0, b: int = 5, t: int = 7, h: int = 8, v: int = 37, noise: float = 0.5):
    """[B, T] float64 inputs with a mismatch that varies by sequence: sequence 0 on-policy, the last one padding
    only (an empty sequence), sequence 1 of one response token."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    logits = hidden @ weight.T
    tokens = torch.randint(0, v, (b, t), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    scale = noise * torch.linspace(0, 2, b, dtype=torch.float64)[:, None]
    rollout = (lp + scale * torch.randn(b, t, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 1:] = False
    mask[-1] = False
    mask[2, 5:] = False
    return dict(hidden=hidden, weight=weight, logits=logits, tokens=tokens, rollout=rollout, adv=adv, mask=mask)


MASKS = {
    "seq_mean_k3": SequenceMask("k3", "mean", high=0.05),
    "seq_sum_k1_band": SequenceMask("k1", "sum", high=0.3, low=-0.3),
    "seq_max_k2": SequenceMask("k2", "max", high=0.1),
    "seq_mean_tv": SequenceMask("tv", "mean", high=0.02),
    "off_policy": SequenceMask.off_policy(0.01),
}


def _grad(fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    loss, metrics = fn(x)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("agg", ("token-mean", "seq-mean-token-mean"))
@pytest.mark.parametrize("kl_tau, kl_mask_type", [(0.0, "all"), (0.01, "all"), (0.02, "unmasked"), (0.05, "masked")])
@pytest.mark.parametrize("name", list(MASKS) + [None])
def test_dppo_loss_matches_the_composed_reference(name, kl_tau, kl_mask_type, agg):
    if name is None and kl_tau == 0:
        pytest.skip("nothing composed: the plain op, tested elsewhere")
    x = _batch()
    seq_mask = MASKS[name] if name else None
    kw = dict(kl_tau=kl_tau, kl_mask_type=kl_mask_type, sequence_mask=seq_mask)
    op = dict(mode="binary_tv", delta_low=0.05, delta_high=0.05)
    want, want_grad, want_metrics = _grad(
        lambda z: dppo_loss_composed_reference(
            z, x["tokens"], x["rollout"], x["adv"], response_mask=x["mask"], loss_agg_mode=agg, **kw, **op
        ),
        x["logits"],
    )
    got, got_grad, metrics = _grad(
        lambda z: dppo_loss(
            z, x["tokens"], x["rollout"], x["adv"], response_mask=x["mask"], loss_agg_mode=agg, **kw, **op
        ),
        x["logits"],
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-13)
    for key in ("masked_frac", "seq_masked_frac"):
        torch.testing.assert_close(metrics[key], want_metrics[key], rtol=1e-12, atol=1e-12, msg=key)
    if name is not None:
        assert 0 < float(metrics["seq_masked_frac"]) < 1, "the inputs must keep some sequences and drop others"


@pytest.mark.parametrize("name", ["seq_mean_k3", "seq_sum_k1_band"])
def test_every_entry_point_composes_the_same(name):
    x = _batch(seed=1)
    settings = dict(mode="ratio", mask_direction="symmetric", kl_tau=0.01, sequence_mask=MASKS[name])
    want, _ = dppo_loss(x["logits"], x["tokens"], x["rollout"], x["adv"], response_mask=x["mask"], **settings)
    args = (x["tokens"], x["rollout"], x["adv"])
    hidden, weight = x["hidden"], x["weight"]
    results = {
        "DPPOLoss": DPPOLoss(**settings)(x["logits"], *args, response_mask=x["mask"]),
        "fused (grad)": fused_linear_dppo_loss(
            hidden.requires_grad_(True), weight, *args, response_mask=x["mask"], **settings
        ),
        "fused (no grad)": fused_linear_dppo_loss(hidden.detach(), weight, *args, response_mask=x["mask"], **settings),
        "FusedLinearDPPOLoss": FusedLinearDPPOLoss(**settings)(hidden.detach(), weight, *args, response_mask=x["mask"]),
    }
    for key, (loss, _metrics) in results.items():
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-13, msg=key)
    # The fused function's hidden gradient is the logits path's through the LM head.
    z = x["logits"].detach().clone().requires_grad_(True)
    dppo_loss(z, *args, response_mask=x["mask"], **settings)[0].backward()
    h = hidden.detach().clone().requires_grad_(True)
    fused_linear_dppo_loss(h, weight, *args, response_mask=x["mask"], **settings)[0].backward()
    torch.testing.assert_close(h.grad, z.grad @ weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("form", ("sequence_ids", "cu_seqlens"))
def test_packed_rows_match_the_padded_batch(form):
    """The same sequences packed into flat rows (padding dropped), named by sequence_ids or cu_seqlens, give the
    padded batch's per-row outputs (per-row entry points, on logits and fused)."""
    x = _batch(seed=2)
    seq_mask = MASKS["seq_mean_k3"]
    settings = dict(mode="binary_tv", kl_tau=0.01, sequence_mask=seq_mask)
    b, t = x["tokens"].shape
    keep = x["mask"].reshape(-1)
    ids = torch.arange(b).repeat_interleave(t)[keep]
    lengths = x["mask"].sum(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    adv = x["adv"][:, None].expand(b, t).reshape(-1)
    rows = (x["tokens"].reshape(-1)[keep], x["rollout"].reshape(-1)[keep], adv[keep])
    packed = {"sequence_ids": ids} if form == "sequence_ids" else {"cu_seqlens": cu}
    got = dppo_loss_per_row(x["logits"].reshape(b * t, -1)[keep], *rows, **packed, **settings)
    fused = fused_linear_dppo_loss_per_row(
        x["hidden"].reshape(b * t, -1)[keep], x["weight"], *rows, **packed, **settings
    )
    ref = dppo_loss_reference(x["logits"].reshape(b * t, -1)[keep], *rows, mode="binary_tv")
    want, _ = composed_rows_reference(
        ref,
        rows[1],
        rows[2],
        torch.ones_like(rows[0], dtype=torch.bool),
        ids.tolist(),
        kl_tau=0.01,
        sequence_mask=seq_mask,
    )
    assert (want["mask"] == 0).any() and (want["mask"] == 1).any()
    for out in (got, fused):
        torch.testing.assert_close(out.mask, want["mask"], rtol=0, atol=0)
        torch.testing.assert_close(out.loss, want["loss"], rtol=1e-10, atol=1e-13)


def test_edge_sequences():
    """An empty sequence is never masked and counts in no metric; a one-token sequence's statistic is its token's
    for every reduction; a batch whose every sequence is masked has loss 0 and a zero gradient (never NaN)."""
    x = _batch(seed=3)
    for reduce in ("sum", "mean", "max"):
        stat = SequenceMask("k2", reduce, high=1e-12)
        ref = dppo_loss_reference(x["logits"][1], x["tokens"][1], x["rollout"][1], x["adv"][1].expand(7))
        _out, frac = composed_rows_reference(
            ref, x["rollout"][1], x["adv"][1].expand(7), x["mask"][1], [0] * 7, sequence_mask=stat
        )
        z = x["logits"].detach().clone().requires_grad_(True)
        loss, metrics = dppo_loss(z, x["tokens"], x["rollout"], x["adv"], response_mask=x["mask"], sequence_mask=stat)
        loss.backward()
        # every non-empty sequence but the on-policy one (k2 = 0 there) is dropped; the empty one does not count
        assert float(metrics["seq_masked_frac"]) == pytest.approx(3 / 4)
        assert not torch.isnan(z.grad).any()
        assert (z.grad[1:4] == 0).all() and (z.grad[-1] == 0).all()
    everything = SequenceMask("k3", "max", low=1e9)  # k3 <= exp(20) - 21 < 1e9: every sequence is below the bound
    z = x["logits"].detach().clone().requires_grad_(True)
    loss, metrics = dppo_loss(z, x["tokens"], x["rollout"], x["adv"], response_mask=x["mask"], sequence_mask=everything)
    loss.backward()
    assert (
        float(loss.detach()) == 0.0
        and float(metrics["seq_masked_frac"]) == 1.0
        and float(metrics["masked_frac"]) == 1.0
    )
    assert (z.grad == 0).all()


def test_negative_advantages_only_keeps_the_other_tokens():
    x = _batch(seed=4)
    adv = torch.stack([torch.linspace(-1, 1, 7, dtype=torch.float64)] * 5)  # per token: both signs in a sequence
    opsm = SequenceMask("k1", "mean", high=-1.0, negative_advantages_only=True)  # mean k1 > -1: every sequence
    out = dppo_loss_per_row(
        x["logits"].reshape(35, -1),
        x["tokens"].reshape(-1),
        x["rollout"].reshape(-1),
        adv.reshape(-1),
        mode="none",
        sequence_mask=opsm,
        sequence_ids=torch.arange(5).repeat_interleave(7),
    )
    torch.testing.assert_close(out.mask, (adv.reshape(-1) >= 0).double(), rtol=0, atol=0)


def test_penalty_gradient_is_two_tau_delta():
    """d/dlogp of kl_tau * delta^2 is 2 * kl_tau * delta: with mode 'none' and A = 0 the loss is the penalty alone, and
    its logits gradient is 2 * kl_tau * delta * (onehot - softmax)."""
    x = _batch(seed=5)
    n, tau = 35, 0.3
    z = x["logits"].reshape(n, -1).detach().clone().requires_grad_(True)
    tokens, rollout = x["tokens"].reshape(-1), x["rollout"].reshape(-1)
    out = dppo_loss_per_row(z, tokens, rollout, torch.zeros(n, dtype=torch.float64), mode="none", kl_tau=tau)
    out.loss.sum().backward()
    p = torch.softmax(x["logits"].reshape(n, -1), -1)
    delta = (torch.log(p.gather(1, tokens[:, None])).squeeze(1) - rollout).clamp(-20, 20)
    want = 2 * tau * delta[:, None] * (torch.nn.functional.one_hot(tokens, p.shape[1]) - p)
    torch.testing.assert_close(z.grad, want, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(out.loss, tau * delta**2, rtol=1e-12, atol=1e-15)


def test_gradcheck_with_both_compositions():
    """The weight min(pi / mu, C) is a constant for autograd: pinned at the cap C = 0.5 (every delta > -ln 2) so that
    gradcheck's perturbation cannot move it; sequence 0 far off-policy (delta = 1: masked), the others near it."""
    x = _batch(seed=6, b=3, t=4, v=7)
    lp = torch.log_softmax(x["logits"], -1).gather(-1, x["tokens"][..., None]).squeeze(-1)
    shift = torch.tensor([[1.0], [0.01], [-0.02]], dtype=torch.float64)
    rollout = lp - shift
    z = x["logits"].detach().clone().requires_grad_(True)
    seq_mask = SequenceMask("k3", "mean", high=0.05)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2, 2:] = False

    def fn(logits):
        return dppo_loss(
            logits,
            x["tokens"],
            rollout,
            x["adv"],
            response_mask=mask,
            ratio_cap=0.5,
            mode="none",
            kl_tau=0.1,
            sequence_mask=seq_mask,
        )

    assert float(fn(z)[1]["seq_masked_frac"]) == pytest.approx(1 / 3)
    assert torch.autograd.gradcheck(lambda logits: fn(logits)[0], (z,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(kl_tau=-0.1), ValueError, r"kl_tau must be a finite number >= 0 \(0: no penalty\), got -0.1"),
        (dict(kl_tau=math.nan), ValueError, r"kl_tau must be a finite number >= 0"),
        (
            dict(kl_mask_type="kept"),
            ValueError,
            r"kl_mask_type must be one of \('all', 'unmasked', 'masked'\), got 'kept'",
        ),
        (
            dict(sequence_mask="seq_mean_k3"),
            TypeError,
            r"sequence_mask must be a dppo_ext.SequenceMask or None, got a str",
        ),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, error, match):
    x = _batch()
    for call in (
        lambda: dppo_loss(x["logits"], x["tokens"], x["rollout"], x["adv"], **kwargs),
        lambda: DPPOLoss(**kwargs),
        lambda: FusedLinearDPPOLoss(**kwargs),
    ):
        with pytest.raises(error, match=match):
            call()


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: SequenceMask("k4", "mean", high=1.0), r"statistic must be one of \('k1', 'k2', 'k3', 'tv'\)"),
        (lambda: SequenceMask("k3", "median", high=1.0), r"reduce must be one of \('sum', 'mean', 'max'\)"),
        (lambda: SequenceMask("k3", "mean"), r"needs a bound"),
        (lambda: SequenceMask("k1", "sum", high=-1.0, low=1.0), r"low must be <= high"),
        (lambda: SequenceMask("k3", "mean", high=math.inf), r"high must be a finite number or None"),
        (lambda: SequenceMask.from_verl("token_k3", 0.1), r"rollout_rs must be one of verl's sequence options"),
        (lambda: SequenceMask.from_verl("seq_max_k1", 2.0), r"'seq_max_k1' is not a verl option"),
        (lambda: SequenceMask.from_verl("seq_sum_k1", "x_2"), r"rollout_rs_threshold for 'seq_sum_k1' must be"),
        (lambda: SequenceMask.from_trl("token_truncate", None, 3.0), r"only vllm_importance_sampling_mode="),
        (
            lambda: SequenceMask.from_trl("sequence_mask", 0.0, 3.0),
            r"vllm_importance_sampling_clip_min must be a number > 0 or None, got 0.0",
        ),
    ],
)
def test_bad_sequence_masks_are_refused(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            dict(sequence_ids=torch.zeros(3, dtype=torch.long)),
            r"sequence_ids must be an integer tensor of shape \(35,\)",
        ),
        (dict(sequence_ids=torch.full((35,), -1)), r"sequence_ids must be >= 0, got a minimum of -1"),
        (
            dict(cu_seqlens=torch.tensor([0, 10, 30])),
            r"cu_seqlens must be a non-decreasing integer tensor \[S \+ 1\] from 0 to N=35",
        ),
        (dict(cu_seqlens=torch.tensor([0, 20, 10, 35])), r"cu_seqlens must be a non-decreasing"),
        (dict(sequence_ids=torch.zeros(35, dtype=torch.long), cu_seqlens=torch.tensor([0, 35])), r"not both"),
    ],
)
def test_bad_sequence_boundaries_are_refused(kwargs, match):
    x = _batch()
    with pytest.raises(ValueError, match=match):
        dppo_loss_per_row(
            x["logits"].reshape(35, -1),
            x["tokens"].reshape(-1),
            x["rollout"].reshape(-1),
            x["adv"].repeat_interleave(7),
            sequence_mask=MASKS["seq_mean_k3"],
            **kwargs,
        )

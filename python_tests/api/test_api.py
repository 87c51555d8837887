"""dppo_ext.dppo_loss / DPPOLoss against dppo_ext.reference.dppo_loss_full_reference.

[B, T, V] logits with a response mask (right padding and one fully masked sequence), per-token and
per-sequence advantages, every aggregation mode, the metrics, padding rows' zero gradient, the
nn.Module form and the in-place backward, end to end.
"""

from __future__ import annotations

import pytest
import torch
from dppo_testing import DEVICES, DTYPES, TOL, ambiguous_rows, as_dtype, reference_outputs, sample_inputs

import dppo_ext
from dppo_ext import DPPOLoss, dppo_loss
from dppo_ext.contract import AGG_MODES, DEFAULT_DELTAS, MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import METRIC_KEYS, aggregate_loss_reference, dppo_loss_full_reference

B, T = 4, 10


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def batch_inputs(
    device,
    dtype,
    mode: str,
    *,
    seed: int = 0,
    per_sequence_adv: bool = False,
    noncontiguous: bool = True,
    anchor: bool = False,
) -> dict:
    """dppo_loss keyword arguments for [B, T, V] logits (V = 129).

    Sequence 1 is right-padded after 6 tokens, sequence 3 is fully masked. With ``noncontiguous``
    the logits are the ``[:, :-1]`` view of a [B, T + 1, V] buffer.
    """
    flat = sample_inputs(device, dtype, mode, "v129", seed=seed, anchor=anchor)
    n, v = B * T, flat["logits"].shape[1]
    gen = torch.Generator().manual_seed(seed + 101)
    # Draw rows among the valid ones whose mask decision is clear of a tie (see ambiguous_rows).
    flat64 = as_dtype(flat, torch.float64)
    allowed = ((flat["tokens"] != -100) & ~ambiguous_rows(flat64, reference_outputs(flat64))).nonzero().flatten().cpu()
    rows = allowed[torch.randint(0, allowed.numel(), (n,), generator=gen)]
    rows_dev = rows.to(device)

    def pick(x):
        return None if x is None else x[rows_dev].reshape(B, T, *x.shape[1:])

    logits = pick(flat["logits"])
    if noncontiguous:
        buf = torch.zeros(B, T + 1, v, dtype=dtype, device=device)
        buf[:, :T] = logits
        logits = buf[:, :T]
    mask = torch.ones(B, T, dtype=torch.bool, device=device)
    mask[1, 6:] = False
    mask[3] = False
    acc = accumulation_dtype(dtype)
    advantages = torch.randn(B, generator=gen, dtype=torch.float64).to(device=device, dtype=acc)
    if not per_sequence_adv:
        advantages = advantages[:, None] + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64).to(device, acc)
    return {
        "logits": logits,
        "tokens": pick(flat["tokens"]),
        "rollout_logprobs": pick(flat["rollout_logprobs"]),
        "advantages": advantages,
        "response_mask": mask,
        "mode": mode,
        "topk_ids": pick(flat["topk_ids"]),
        "topk_logprobs": pick(flat["topk_logprobs"]),
        "anchor_logprobs": pick(flat["anchor_logprobs"]),
        "temperature": flat["temperature"],
        "delta_low": flat["delta_low"],
        "delta_high": flat["delta_high"],
        "ratio_cap": flat["ratio_cap"],
    }


def _no_mask_ties(kw: dict) -> bool:
    """Whether every valid token's mask decision is clear of a tie (so precisions agree)."""
    lead = kw["tokens"].shape
    adv = kw["advantages"]
    if adv.shape != lead:
        adv = adv[:, None].expand(lead)
    flat = {
        "logits": kw["logits"].reshape(-1, kw["logits"].shape[-1]).double(),
        "tokens": torch.where(kw["response_mask"], kw["tokens"], -100).reshape(-1),
        "rollout_logprobs": kw["rollout_logprobs"].reshape(-1).double(),
        "advantages": adv.reshape(-1).double(),
        "topk_ids": None if kw["topk_ids"] is None else kw["topk_ids"].reshape(-1, kw["topk_ids"].shape[-1]),
        "topk_logprobs": None
        if kw["topk_logprobs"] is None
        else kw["topk_logprobs"].reshape(-1, kw["topk_ids"].shape[-1]).double(),
        "anchor_logprobs": None if kw["anchor_logprobs"] is None else kw["anchor_logprobs"].reshape(-1).double(),
        "mode": kw["mode"],
        "temperature": kw["temperature"],
        "delta_low": kw["delta_low"],
        "delta_high": kw["delta_high"],
        "ratio_cap": kw["ratio_cap"],
    }
    return not ambiguous_rows(flat, reference_outputs(flat)).any()


def _tols(dtype: torch.dtype) -> dict:
    return {"rtol": TOL[dtype]["fwd_rtol"] * 5, "atol": TOL[dtype]["fwd_atol"] * 5}


def _compare(kw: dict, dtype: torch.dtype, **extra) -> None:
    """Loss, metrics and logits gradient of dppo_loss vs the float64 full reference."""
    assert _no_mask_ties(kw)
    leaf_op = kw["logits"].detach().clone().requires_grad_(True)
    loss, metrics = dppo_loss(**dict(kw, logits=leaf_op), **extra)
    kw64 = dict(kw)
    for key in ("rollout_logprobs", "advantages", "topk_logprobs", "anchor_logprobs"):
        if kw[key] is not None:
            kw64[key] = kw[key].double()
    leaf_ref = kw["logits"].detach().double().requires_grad_(True)
    ref_loss, ref_metrics = dppo_loss_full_reference(**dict(kw64, logits=leaf_ref), **extra)
    acc = accumulation_dtype(dtype)
    assert loss.shape == () and loss.dtype == acc
    torch.testing.assert_close(loss.double(), ref_loss.detach(), **_tols(dtype))
    assert set(metrics) == set(METRIC_KEYS)
    for key in METRIC_KEYS:
        assert metrics[key].shape == (), key
        torch.testing.assert_close(metrics[key].double(), ref_metrics[key].double(), **_tols(dtype), msg=key)
    loss.backward()
    ref_loss.backward()
    grad = leaf_op.grad
    assert grad.dtype == dtype
    pad = ~kw["response_mask"]
    assert (grad[pad] == 0).all(), "masked (padding) positions must get an exactly zero gradient"
    # Low precision: the gradient is rounded to the logits dtype (half an ulp of the largest entry).
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}.get(dtype, 0.0)
    atol = TOL[dtype]["grad_atol"] * 10 + ulp * leaf_ref.grad.abs().max().item()
    torch.testing.assert_close(grad.double(), leaf_ref.grad, rtol=TOL[dtype]["grad_rtol"] * 10, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_dppo_loss_matches_full_reference(device, mode, agg):
    kw = batch_inputs(device, torch.float32, mode)
    _compare(kw, torch.float32, loss_agg_mode=agg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl"))
def test_dppo_loss_dtypes_per_sequence_advantages(device, dtype, mode):
    kw = batch_inputs(device, dtype, mode, seed=1, per_sequence_adv=True)
    assert kw["advantages"].shape == (B,)
    _compare(kw, dtype, loss_agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("mode", ("binary_kl", "ratio"))
def test_dppo_loss_anchor_contiguous_flat(mode):
    """[N, V] (already flat, contiguous) logits with a mask anchor."""
    kw = batch_inputs("cpu", torch.float64, mode, seed=2, noncontiguous=False, anchor=True)
    flat = {k: (v.reshape(B * T, *v.shape[2:]) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    _compare(flat, torch.float64, loss_agg_mode="token-mean")


@pytest.mark.parametrize("mode", MODES)
def test_default_thresholds(mode):
    """delta_low/delta_high = None resolve to the same per-mode defaults in the API and the oracle."""
    assert dppo_ext.DEFAULT_DELTAS[mode] == DEFAULT_DELTAS[mode]
    kw = batch_inputs("cpu", torch.float64, mode, seed=3)
    kw.pop("delta_low")
    kw.pop("delta_high")
    loss, metrics = dppo_loss(**kw)
    ref_loss, ref_metrics = dppo_loss_full_reference(**kw)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(metrics["masked_frac"], ref_metrics["masked_frac"])


def test_metrics_by_hand():
    """A 2 x 3 case whose metrics are computed here from first principles."""
    v = 5
    logits = torch.zeros(2, 3, v, dtype=torch.float64)  # uniform: pi = 0.2 everywhere
    tokens = torch.zeros(2, 3, dtype=torch.long)
    rollout = torch.log(torch.tensor([[0.5, 0.2, 0.1], [0.05, 0.6, 0.2]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0, -1.0], [1.0, 2.0, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    loss, m = dppo_loss(
        logits,
        tokens,
        rollout,
        adv,
        response_mask=mask,
        mode="binary_tv",
        delta_low=0.05,
        delta_high=0.1,
        ratio_cap=3.0,
    )
    # |pi - mu| over the 5 valid tokens: 0.3, 0, 0.1, 0.15, 0.4.
    # Masked: (A>0, pi>mu, D>0.1) -> token (1,0) [0.15]; (A<=0, pi<mu, D>0.05) -> none
    # ((0,2): pi > mu; (0,1): D = 0). A>0 tokens: (0,0) pi<mu kept, (1,0) masked, (1,1) pi<mu kept.
    assert m["num_tokens"].item() == 5
    assert m["masked_frac"].item() == pytest.approx(1 / 5)
    assert m["masked_frac_pos"].item() == pytest.approx(1 / 3)
    assert m["masked_frac_neg"].item() == pytest.approx(0.0)
    assert m["mismatch_mean"].item() == pytest.approx((0.3 + 0 + 0.1 + 0.15 + 0.4) / 5)
    assert m["mismatch_max"].item() == pytest.approx(0.4)
    assert m["divergence_mean"].item() == pytest.approx((0.3 + 0 + 0.1 + 0.15 + 0.4) / 5)
    assert m["entropy_mean"].item() == pytest.approx(torch.log(torch.tensor(5.0)).item())
    assert m["ratio_max"].item() == pytest.approx(4.0)  # 0.2 / 0.05, above the cap: the metric is uncapped
    # loss = -A * min(pi/mu, 3) * M * log(0.2), token-mean over 5 tokens.
    w = [0.4, 1.0, 2.0, 3.0, 0.2 / 0.6]
    a = [1.0, -1.0, -1.0, 1.0, 2.0]
    keep = [1, 1, 1, 0, 1]
    lp = torch.log(torch.tensor(0.2)).item()
    want = sum(-ai * wi * ki * lp for ai, wi, ki in zip(a, w, keep)) / 5
    assert loss.item() == pytest.approx(want)


def test_aggregation_modes_by_hand():
    """Current verl's agg_loss formulas (verl-project/verl core_algos.py since PR 5417) plus the paper's fork's
    sum / T, on a 3 x 4 case with one empty sequence, against the reference and the API helper."""
    loss_mat = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    total, t, non_empty = 1 + 2 + 5 + 6 + 7 + 8, 4, 2
    want = {
        "token-mean": total / 6,
        "token-sum": total,
        "seq-mean-token-sum": ((1 + 2) + (5 + 6 + 7 + 8)) / non_empty,  # the empty sequence is left out
        "seq-mean-token-mean": ((1 + 2) / 2 + (5 + 6 + 7 + 8) / 4) / non_empty,
        "seq-mean-token-sum-norm": total / non_empty / t,  # current verl: seq-mean, then / horizon T
        "token-sum-norm": total / t,  # the fork (sail-sg/Stable-RL) under the name seq-mean-token-sum-norm
    }
    assert set(want) == set(AGG_MODES) == set(dppo_ext.AGG_MODES)
    for agg, value in want.items():
        assert aggregate_loss_reference(loss_mat, mask, agg).item() == pytest.approx(value), agg
        assert dppo_ext.aggregate_loss(loss_mat, mask, agg).item() == pytest.approx(value), agg
        empty = aggregate_loss_reference(loss_mat, torch.zeros_like(mask), agg)
        assert empty.item() == 0.0, agg
        assert dppo_ext.aggregate_loss(loss_mat, torch.zeros_like(mask), agg).item() == 0.0, agg
    # verl's loss_scale_factor replaces the horizon T of the -norm modes
    for agg, value in (("seq-mean-token-sum-norm", total / non_empty / 7), ("token-sum-norm", total / 7)):
        assert aggregate_loss_reference(loss_mat, mask, agg, 7).item() == pytest.approx(value), agg
        assert dppo_ext.aggregate_loss(loss_mat, mask, agg, loss_scale_factor=7).item() == pytest.approx(value), agg


def test_aggregation_errors():
    loss_mat, mask = torch.ones(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of .*got 'seq-sum'"):
        dppo_ext.aggregate_loss(loss_mat, mask, "seq-sum")
    with pytest.raises(ValueError, match=r"loss_scale_factor is only used by .*loss_agg_mode='token-mean'"):
        dppo_ext.aggregate_loss(loss_mat, mask, "token-mean", loss_scale_factor=4)
    with pytest.raises(ValueError, match=r"loss_scale_factor must be > 0 or None, got 0"):
        dppo_ext.aggregate_loss(loss_mat, mask, "token-sum-norm", loss_scale_factor=0)
    with pytest.raises(ValueError, match=r"mask must have the loss's shape \(2, 3\), got \(3,\)"):
        dppo_ext.aggregate_loss(loss_mat, torch.ones(3), "token-mean")
    kw = batch_inputs("cpu", torch.float32, "binary_tv")
    with pytest.raises(ValueError, match=r"loss_scale_factor is only used by"):
        dppo_loss(**kw, loss_scale_factor=5.0)
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of"):
        DPPOLoss(loss_agg_mode="sum")


def test_loss_scale_factor_end_to_end():
    """dppo_loss / DPPOLoss pass loss_scale_factor through: the -norm losses scale by T / C exactly."""
    kw = batch_inputs("cpu", torch.float64, "binary_tv", seed=2)
    for agg in ("seq-mean-token-sum-norm", "token-sum-norm"):
        base, _ = dppo_loss(**kw, loss_agg_mode=agg)
        scaled, _ = dppo_loss(**kw, loss_agg_mode=agg, loss_scale_factor=25.0)
        torch.testing.assert_close(scaled, base * T / 25.0, rtol=1e-12, atol=0)
        want, _ = dppo_loss_full_reference(**kw, loss_agg_mode=agg, loss_scale_factor=25.0)
        torch.testing.assert_close(scaled, want, rtol=1e-9, atol=1e-12)
        crit = DPPOLoss(
            mode="binary_tv",
            temperature=kw["temperature"],
            delta_low=kw["delta_low"],
            delta_high=kw["delta_high"],
            ratio_cap=kw["ratio_cap"],
            loss_agg_mode=agg,
            loss_scale_factor=25.0,
        )
        got, _ = crit(
            kw["logits"], kw["tokens"], kw["rollout_logprobs"], kw["advantages"], response_mask=kw["response_mask"]
        )
        torch.testing.assert_close(got, scaled, rtol=0, atol=0)


@pytest.mark.parametrize(
    "alias, mode",
    [("dppo_tv", "binary_tv"), ("dppo_kl", "binary_kl"), ("dppo_binary_tv", "binary_tv"), ("dppo_topk_kl", "topk_kl")],
)
def test_mode_aliases(alias, mode):
    """verl's loss_mode names (dppo_tv / dppo_kl) and the fork's (dppo_binary_tv, ...) select our modes, with the
    mode's default thresholds, in the function, the module and the raw op wrapper."""
    assert dppo_ext.MODE_ALIASES[alias] == mode
    kw = batch_inputs("cpu", torch.float64, mode, seed=6)
    kw = {k: v for k, v in kw.items() if k not in ("delta_low", "delta_high")}
    want, want_metrics = dppo_loss(**kw)
    got, got_metrics = dppo_loss(**dict(kw, mode=alias))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_metrics["masked_frac"], want_metrics["masked_frac"], rtol=0, atol=0)
    crit = DPPOLoss(mode=alias)
    assert crit.mode == mode
    flat = {k: kw[k] for k in ("tokens", "rollout_logprobs")}
    v = kw["logits"].shape[-1]
    op_kw = dict(
        tokens=flat["tokens"].reshape(-1),
        rollout_logprobs=flat["rollout_logprobs"].reshape(-1),
        advantages=torch.zeros(B * T, dtype=torch.float64),
        temperature=kw["temperature"],
        topk_ids=None if kw["topk_ids"] is None else kw["topk_ids"].reshape(B * T, -1),
        topk_logprobs=None if kw["topk_logprobs"] is None else kw["topk_logprobs"].reshape(B * T, -1),
    )
    logits = kw["logits"].reshape(B * T, v)
    torch.testing.assert_close(
        dppo_ext.dppo_loss_per_row(logits, mode=alias, **op_kw).divergence,
        dppo_ext.dppo_loss_per_row(logits, mode=mode, **op_kw).divergence,
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match=r"mode must be one of .*or an alias.*got 'dppo'"):
        dppo_loss(**dict(kw, mode="dppo"))


def test_module_matches_function():
    kw = batch_inputs("cpu", torch.float32, "topk_tv", seed=4)
    crit = DPPOLoss(
        mode="topk_tv",
        temperature=kw["temperature"],
        delta_low=kw["delta_low"],
        delta_high=kw["delta_high"],
        ratio_cap=kw["ratio_cap"],
        loss_agg_mode="seq-mean-token-sum",
    )
    loss_m, metrics_m = crit(
        kw["logits"],
        kw["tokens"],
        kw["rollout_logprobs"],
        kw["advantages"],
        response_mask=kw["response_mask"],
        topk_ids=kw["topk_ids"],
        topk_logprobs=kw["topk_logprobs"],
    )
    loss_f, metrics_f = dppo_loss(**kw, loss_agg_mode="seq-mean-token-sum")
    torch.testing.assert_close(loss_m, loss_f, rtol=0, atol=0)
    for key in METRIC_KEYS:
        torch.testing.assert_close(metrics_m[key], metrics_f[key], rtol=0, atol=0)
    assert "topk_tv" in repr(crit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_dtype_id)
def test_inplace_backward_end_to_end(device, dtype):
    """Through a linear head: the in-place gradient reaches the weights unchanged."""
    kw = batch_inputs(device, dtype, "binary_kl", seed=5, noncontiguous=False)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(B, T, 16, generator=gen).to(device=device, dtype=dtype)
    w0 = (0.3 * torch.randn(kw["logits"].shape[-1], 16, generator=gen)).to(device=device, dtype=dtype)

    def run(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weight = w0.clone().requires_grad_(True)
        logits = hidden @ weight.t()
        loss, _ = dppo_loss(**dict(kw, logits=logits), inplace_backward=inplace)
        loss.backward()
        return loss.detach(), weight.grad

    loss_ref, grad_ref = run(False)
    loss_inp, grad_inp = run(True)
    torch.testing.assert_close(loss_inp, loss_ref, rtol=0, atol=0)
    torch.testing.assert_close(grad_inp, grad_ref, rtol=0, atol=0)
    assert grad_ref.abs().sum() > 0


def test_api_shape_errors():
    kw = batch_inputs("cpu", torch.float32, "binary_tv")
    with pytest.raises(ValueError, match=r"advantages must have shape \(4, 10\) .*or \(4,\)"):
        dppo_loss(**dict(kw, advantages=kw["advantages"][:, :3]))
    with pytest.raises(ValueError, match=r"tokens must have shape \(4, 10\)"):
        dppo_loss(**dict(kw, tokens=kw["tokens"][:2]))
    with pytest.raises(ValueError, match=r"response_mask must have shape \(4, 10\)"):
        dppo_loss(**dict(kw, response_mask=kw["response_mask"][:, :2]))
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of"):
        dppo_loss(**kw, loss_agg_mode="seq-sum")
    with pytest.raises(ValueError, match=r"mode must be one of"):
        dppo_loss(**dict(kw, mode="kl"))
    with pytest.raises(ValueError, match=r"mode 'topk_tv' needs the rollout's top-K"):
        dppo_loss(**dict(kw, mode="topk_tv"))


def test_response_mask_float_and_all_masked():
    kw = batch_inputs("cpu", torch.float32, "binary_tv", seed=6)
    loss_b, metrics_b = dppo_loss(**kw)
    loss_f, metrics_f = dppo_loss(**dict(kw, response_mask=kw["response_mask"].float()))
    torch.testing.assert_close(loss_f, loss_b, rtol=0, atol=0)
    none = torch.zeros_like(kw["response_mask"])
    leaf = kw["logits"].detach().clone().requires_grad_(True)
    loss_0, metrics_0 = dppo_loss(**dict(kw, logits=leaf, response_mask=none))
    assert loss_0.item() == 0.0 and metrics_0["num_tokens"].item() == 0
    assert all(torch.isfinite(v) for v in metrics_0.values())
    loss_0.backward()
    assert (leaf.grad == 0).all()


@pytest.mark.parametrize("mode", [m for m in MODES if m not in TOPK_MODES])
def test_flat_and_batched_layouts_agree(mode):
    kw = batch_inputs("cpu", torch.float32, mode, seed=8, noncontiguous=False)
    loss_b, _ = dppo_loss(**kw, loss_agg_mode="token-mean")
    flat = {k: (v.reshape(B * T, *v.shape[2:]) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    loss_f, _ = dppo_loss(**flat, loss_agg_mode="token-mean")
    torch.testing.assert_close(loss_f, loss_b)


@pytest.mark.slow
def test_full_reference_compiles_fullgraph():
    """The benchmark baseline torch.compile(dppo_loss_full_reference, fullgraph=True) traces and
    agrees with eager (no data-dependent Python branching in the oracle)."""
    torch._dynamo.reset()
    kw = batch_inputs("cpu", torch.float32, "topk_kl", seed=9, per_sequence_adv=True)
    leaf_e = kw["logits"].detach().clone().requires_grad_(True)
    leaf_c = kw["logits"].detach().clone().requires_grad_(True)
    loss_e, metrics_e = dppo_loss_full_reference(**dict(kw, logits=leaf_e), loss_agg_mode="seq-mean-token-mean")
    compiled = torch.compile(dppo_loss_full_reference, fullgraph=True)
    loss_c, metrics_c = compiled(**dict(kw, logits=leaf_c), loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(loss_c, loss_e)
    for key in METRIC_KEYS:
        torch.testing.assert_close(metrics_c[key], metrics_e[key], msg=key)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(leaf_c.grad, leaf_e.grad)


def test_the_module_holds_one_settings_object_that_reads_and_writes_as_attributes():
    """DPPOLoss keeps its settings as the one LossSettings the functions resolve (the canonical mode, the mode's
    default thresholds in place of None); each reads as an attribute, and setting one is checked and resolves the
    rest again: a module changed after construction computes what a module built with the new value computes."""
    kw = batch_inputs("cpu", torch.float64, "topk_kl", seed=3)
    tensors = {k: kw[k] for k in ("logits", "tokens", "rollout_logprobs", "advantages", "topk_ids", "topk_logprobs")}
    crit = DPPOLoss(mode="dppo_tv")
    assert isinstance(crit.settings, dppo_ext._rows.LossSettings)
    assert crit.mode == "binary_tv" and crit.settings.mode == "binary_tv"
    assert (crit.delta_low, crit.delta_high) == DEFAULT_DELTAS["binary_tv"]  # the values the loss uses
    crit.mode = "topk_kl"  # the thresholds were never given: the new mode's defaults
    assert (crit.delta_low, crit.delta_high) == DEFAULT_DELTAS["topk_kl"]
    crit.temperature = 0.7
    crit.delta_high = 0.05
    want, want_metrics = DPPOLoss(mode="topk_kl", temperature=0.7, delta_high=0.05)(**tensors)
    got, got_metrics = crit(**tensors)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_metrics["masked_frac"], want_metrics["masked_frac"], rtol=0, atol=0)
    assert "temperature=0.7" in repr(crit) and "delta_high=0.05" in repr(crit)
    with pytest.raises(ValueError, match="temperature"):
        crit.temperature = float("nan")
    with pytest.raises(ValueError, match="mode"):
        crit.mode = "clip"
    assert crit.temperature == 0.7 and crit.mode == "topk_kl"  # a refused value changes nothing

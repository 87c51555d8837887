"""``mask_direction`` (docs/contract.md, "Mask"): the symmetric trust region (prime-rl's IPO on ``binary_tv``,
IcePop on ``ratio``) beside the paper's advantage-conditioned one, through the op, every entry point of the API
family and the float64 reference.

The five checks of an op test (forward and gradient vs the reference, gradcheck, opcheck, error messages), plus the
rule's own property: the symmetric mask is the advantage mask taken with both signs of the advantage.
"""

from __future__ import annotations

import math

import pytest
import torch
from dppo_testing import (
    DEVICES,
    DTYPES,
    TOL,
    ambiguous_rows,
    as_dtype,
    assert_no_worse,
    reference_outputs,
    sample_inputs,
)

from dppo_ext import (
    DPPOLoss,
    FusedLinearDPPOLoss,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
    icepop_deltas,
)
from dppo_ext.contract import MASK_DIRECTIONS, MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import OUTPUT_KEYS, dppo_loss_full_reference, dppo_loss_reference

OUTPUT_NAMES = ("loss", "logp", "divergence", "mask", "weight", "entropy", "lse")


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _symmetric(inputs: dict) -> dict:
    return dict(inputs, mask_direction="symmetric")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ("v129", "v7_k1", "noncontig", "n1_v1", "n0", "many_rows", "extreme"))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_symmetric_forward_matches_reference(device, case, dtype, mode):
    inputs = _symmetric(sample_inputs(device, dtype, mode, case, anchor=case == "v129"))
    with torch.no_grad():
        out = dppo_loss_per_row(**inputs)._asdict()
    inputs64 = as_dtype(inputs, torch.float64)
    ref64 = reference_outputs(inputs64)
    same = reference_outputs(inputs)
    tie = ambiguous_rows(inputs64, ref64)
    valid = inputs["tokens"] != -100
    for key in OUTPUT_KEYS:
        assert out[key].dtype == accumulation_dtype(dtype)
        assert (out[key][~valid] == 0).all()
        select = ~tie if key in ("loss", "mask") else None
        tol = TOL[dtype]
        assert_no_worse(key, out[key], ref64[key], same[key], tol["fwd_atol"], tol["fwd_rtol"], select)


@pytest.mark.parametrize("mode", MODES)
def test_symmetric_mask_is_the_advantage_mask_for_both_signs(mode):
    """The rule's definition: a row is masked symmetrically iff the advantage rule masks it with A > 0 or with
    A <= 0 (the reference checked against itself with flipped advantages, and the op against both)."""
    for case in ("v129", "v7_k1", "extreme"):
        inputs = sample_inputs("cpu", torch.float64, mode, case, anchor=True)
        valid = inputs["tokens"] != -100
        with torch.no_grad():
            sym = dppo_loss_per_row(**_symmetric(inputs)).mask
            pos = dppo_loss_per_row(**dict(inputs, advantages=torch.ones_like(inputs["advantages"]))).mask
            neg = dppo_loss_per_row(**dict(inputs, advantages=-torch.ones_like(inputs["advantages"]))).mask
        torch.testing.assert_close(sym[valid], (pos * neg)[valid], rtol=0, atol=0)
        if mode != "none":
            adv = dppo_loss_per_row(**inputs).mask
            assert (sym[valid] <= adv[valid]).all(), "the symmetric mask keeps a subset of the advantage mask's rows"


def test_cases_mask_more_rows_symmetrically():
    """The inputs distinguish the two directions: some row is kept by the advantage rule and masked by the
    symmetric one, in every masking mode (otherwise the tests above could not tell them apart)."""
    for mode in (m for m in MODES if m != "none"):
        differ = 0
        for case in ("v129", "v7_k1", "extreme", "noncontig"):
            inputs = sample_inputs("cpu", torch.float64, mode, case)
            adv, sym = reference_outputs(inputs)["mask"], reference_outputs(_symmetric(inputs))["mask"]
            differ += int((adv != sym).sum())
        assert differ > 0, mode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=_dtype_id)
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl", "ratio"))
def test_symmetric_backward_matches_reference_autograd(device, dtype, mode):
    inputs = _symmetric(sample_inputs(device, dtype, mode, "v129", seed=3))
    tie = ambiguous_rows(as_dtype(inputs, torch.float64), reference_outputs(inputs, torch.float64))
    inputs["advantages"] = torch.where(tie, torch.zeros_like(inputs["advantages"]), inputs["advantages"])
    n = inputs["tokens"].shape[0]
    gen = torch.Generator().manual_seed(5)
    acc = accumulation_dtype(dtype)
    g = {k: torch.randn(n, generator=gen, dtype=torch.float64).to(device, acc) for k in ("loss", "logp", "entropy")}

    def grad_of(fn, logits: torch.Tensor) -> torch.Tensor:
        z = logits.detach().clone().requires_grad_(True)
        out = fn(z)
        sum(((out[k].double() * g[k].double()).sum() for k in g), torch.zeros((), dtype=torch.float64)).backward()
        return z.grad

    got = grad_of(
        lambda z: dppo_loss_per_row(z, **{k: v for k, v in inputs.items() if k != "logits"})._asdict(), inputs["logits"]
    )
    rest = {k: v for k, v in as_dtype(inputs, torch.float64).items() if k != "logits"}
    want = grad_of(lambda z: dppo_loss_reference(z, **rest), inputs["logits"].double())
    rest_same = {k: v for k, v in inputs.items() if k != "logits"}
    base = grad_of(lambda z: dppo_loss_reference(z, **rest_same), inputs["logits"])
    tol = TOL[dtype]
    assert_no_worse("grad", got, want, base, tol["grad_atol"], tol["grad_rtol"])


@pytest.mark.parametrize("mode", MODES)
def test_symmetric_gradcheck_float64(mode):
    inputs = _symmetric(sample_inputs("cpu", torch.float64, mode, "v7_k1", seed=4, anchor=True))
    lp = reference_outputs(inputs)["logp"]
    valid = inputs["tokens"] != -100
    # The weight pinned at the cap (a constant under gradcheck's perturbation), mask decisions off their ties.
    inputs["rollout_logprobs"] = torch.where(valid, (lp - 1.0).clamp(max=0.0), inputs["rollout_logprobs"])
    inputs["ratio_cap"] = 0.5
    tie = ambiguous_rows(inputs, reference_outputs(inputs), margin=1e-3)
    inputs["advantages"] = torch.where(tie, torch.zeros_like(inputs["advantages"]), inputs["advantages"])
    logits = inputs.pop("logits").detach().clone().requires_grad_(True)

    def fn(z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = dppo_loss_per_row(z, **inputs)
        return out.loss, out.logp, out.entropy

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


def _op_args(inputs: dict) -> tuple:
    return (
        inputs["logits"],
        inputs["tokens"],
        inputs["rollout_logprobs"],
        inputs["advantages"],
        inputs["topk_ids"],
        inputs["topk_logprobs"],
        inputs["anchor_logprobs"],
        inputs["mode"],
        float(inputs["temperature"]),
        float(inputs["delta_low"]),
        float(inputs["delta_high"]),
        float(inputs["ratio_cap"]),
        True,
        None,
        "symmetric",
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ("binary_tv", "ratio"))
def test_opcheck_forward_symmetric(device, mode):
    inputs = sample_inputs(device, torch.float32, mode, "v129", requires_grad=True)
    torch.library.opcheck(torch.ops.dppo.dppo_loss_forward.default, _op_args(inputs))


def test_the_op_defaults_to_the_advantage_direction():
    inputs = sample_inputs("cpu", torch.float64, "binary_tv", "v129")
    args = _op_args(inputs)
    default = torch.ops.dppo.dppo_loss_forward(*args[:-2])
    explicit = torch.ops.dppo.dppo_loss_forward(*args[:-1], "advantage")
    for a, b in zip(default, explicit):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_vocab_parallel_epilogue_takes_the_direction():
    """The statistics of two vocabulary slices, merged by the epilogue with the symmetric direction, give the
    single-device op's outputs."""
    for mode in ("binary_tv", "topk_tv", "ratio"):
        inputs = sample_inputs("cpu", torch.float64, mode, "v129")
        logits, tokens = inputs["logits"], inputs["tokens"]
        ids = inputs["topk_ids"] if mode in TOPK_MODES else None
        offsets = [0, 50, logits.shape[1]]
        stats = torch.stack(
            [
                torch.ops.dppo.dppo_vocab_parallel_stats(logits[:, a:b], tokens, ids, a, 1.0, True)
                for a, b in zip(offsets, offsets[1:])
            ]
        )
        args = _op_args(inputs)
        merged = torch.ops.dppo.dppo_vocab_parallel_epilogue(stats, offsets, *args[1:8], *args[9:13], None, "symmetric")
        single = torch.ops.dppo.dppo_loss_forward(*args)
        for name, a, b in zip(OUTPUT_NAMES, merged, single):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{mode} {name}")


@pytest.mark.parametrize("mode", ("binary_tv", "ratio"))
def test_every_entry_point_takes_the_direction(mode):
    """dppo_loss, DPPOLoss, the fused-linear function, its per-row form and its module give the float64
    reference's symmetric loss and mask (aggregated: dppo_loss_full_reference)."""
    gen = torch.Generator().manual_seed(11)
    b, t, h, v = 3, 5, 8, 33
    hidden = torch.randn(b, t, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    logits = hidden @ weight.T
    tokens = torch.randint(0, v, (b, t), generator=gen)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    rollout = (lp + 0.6 * torch.randn(b, t, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.randn(b, generator=gen, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:] = False
    kw = dict(response_mask=mask, mode=mode, mask_direction="symmetric", delta_low=0.05, delta_high=0.1)
    want, want_metrics = dppo_loss_full_reference(logits, tokens, rollout, adv, **kw)
    adv_kw = dict(kw, mask_direction="advantage")
    assert not torch.equal(
        dppo_loss_full_reference(logits, tokens, rollout, adv, **adv_kw)[1]["masked_frac"], want_metrics["masked_frac"]
    ), "the inputs must tell the two directions apart"
    settings = {k: kw[k] for k in ("mode", "mask_direction", "delta_low", "delta_high")}
    results = {
        "dppo_loss": dppo_loss(logits, tokens, rollout, adv, **kw),
        "DPPOLoss": DPPOLoss(**settings)(logits, tokens, rollout, adv, response_mask=mask),
        "fused_linear_dppo_loss": fused_linear_dppo_loss(hidden, weight, tokens, rollout, adv, **kw),
        "FusedLinearDPPOLoss": FusedLinearDPPOLoss(**settings)(
            hidden, weight, tokens, rollout, adv, response_mask=mask
        ),
    }
    for name, (loss, metrics) in results.items():
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(metrics["masked_frac"], want_metrics["masked_frac"], msg=name)
    flat = torch.where(mask, tokens, torch.full_like(tokens, -100)).reshape(-1)
    adv_rows = adv[:, None].expand(b, t).reshape(-1)
    per_row = fused_linear_dppo_loss_per_row(
        hidden.reshape(-1, h), weight, flat, rollout.reshape(-1), adv_rows, **{k: kw[k] for k in settings}
    )
    ref = dppo_loss_reference(logits.reshape(-1, v), flat, rollout.reshape(-1), adv_rows, **settings)
    torch.testing.assert_close(per_row.mask, ref["mask"], rtol=0, atol=0)
    torch.testing.assert_close(per_row.loss, ref["loss"], rtol=1e-10, atol=1e-12)


def test_icepop_band_keeps_exactly_the_ratios_inside_it():
    """IcePop's [low, high] through icepop_deltas: mode ratio, symmetric, keeps a row iff low <= pi / mu <= high,
    whatever its advantage."""
    low, high = 0.5, 2.0
    delta_low, delta_high = icepop_deltas(low, high)
    assert (delta_low, delta_high) == (0.5, 1.0)
    inputs = sample_inputs("cpu", torch.float64, "ratio", "v129", seed=3)
    inputs.update(mask_direction="symmetric", delta_low=delta_low, delta_high=delta_high)
    out = dppo_loss_per_row(**inputs)
    valid = inputs["tokens"] != -100
    ratio = torch.exp(out.logp - inputs["rollout_logprobs"])
    inside = (ratio >= low) & (ratio <= high)
    assert (~inside[valid]).any() and inside[valid].any()
    torch.testing.assert_close(out.mask[valid], inside[valid].double(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "low, high", [(1.2, 2.0), (0.5, 0.9), (-0.1, 2.0), (0.5, math.inf), (math.nan, 2.0), ("0.5", 2.0)]
)
def test_icepop_deltas_refuses_a_band_without_one_inside(low, high):
    with pytest.raises(ValueError, match=r"IcePop band \[low, high\] must satisfy 0 <= low <= 1 <= high"):
        icepop_deltas(low, high)


@pytest.mark.parametrize("bad", ("both", "Symmetric", "", None, 1))
def test_a_bad_direction_is_refused_naming_the_argument(bad):
    inputs = sample_inputs("cpu", torch.float32, "binary_tv", "v129")
    message = r"mask_direction must be one of \('advantage', 'symmetric'\)"
    for call in (
        lambda: dppo_loss_per_row(**dict(inputs, mask_direction=bad)),
        lambda: dppo_loss(**dict(inputs, mask_direction=bad)),
        lambda: DPPOLoss(mask_direction=bad),
        lambda: FusedLinearDPPOLoss(mask_direction=bad),
        lambda: dppo_loss_reference(**dict(inputs, mask_direction=bad)),
    ):
        with pytest.raises(ValueError, match=message) as err:
            call()
        assert repr(bad) in str(err.value)
    if isinstance(bad, str):
        with pytest.raises(ValueError, match=r"mask_direction must be one of 'advantage', 'symmetric'; got"):
            torch.ops.dppo.dppo_loss_forward(*_op_args(inputs)[:-1], bad)


def test_directions_are_the_contract_names():
    assert MASK_DIRECTIONS == ("advantage", "symmetric")

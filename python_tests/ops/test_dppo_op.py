"""torch.ops.dppo.dppo_loss_forward / dppo_loss_backward against dppo_ext.reference.

The five checks of every op test file: (1) every forward output vs the reference, (2) gradients
vs autograd of the reference with a random upstream gradient on loss, logp and entropy, (3)
gradcheck in float64, (4) torch.library.opcheck, (5) every error message; plus in-place backward,
a torch.compile(fullgraph=True) smoke test and finiteness under extreme inputs.

For float16/bfloat16 (and float32) the op is compared with the float64 reference evaluated on the
same (already rounded) logits, and its worst error must be at most twice the worst error of the
same-precision PyTorch path (the reference run in the logits' own dtype) plus the dtype's
tolerance from dppo_testing.TOL.
"""

from __future__ import annotations

import math

import pytest
import torch
from dppo_testing import (
    CASES,
    DELTAS,
    DEVICES,
    DTYPES,
    TOL,
    ambiguous_rows,
    as_dtype,
    assert_no_worse,
    lse_rounding_allowance,
    reference_outputs,
    sample_inputs,
    tie_rows_for,
)

from dppo_ext import dppo_loss_per_row
from dppo_ext.contract import DEFAULT_DELTAS, MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import OUTPUT_KEYS, dppo_loss_reference

DIFFERENTIABLE = ("loss", "logp", "entropy")


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_outputs(inputs: dict, **kw) -> dict[str, torch.Tensor]:
    return dppo_loss_per_row(**inputs, **kw)._asdict()


def check_forward(inputs: dict, dtype: torch.dtype, out: dict[str, torch.Tensor]) -> None:
    """Every op output vs the float64 reference (mask/loss skip rows at a mask tie)."""
    tol = TOL[dtype]
    inputs64 = as_dtype(inputs, torch.float64)
    ref64 = reference_outputs(inputs64)
    same = reference_outputs(inputs)
    tie = ambiguous_rows(inputs64, ref64)
    n = inputs["tokens"].shape[0]
    valid = inputs["tokens"] != -100
    acc = accumulation_dtype(dtype)
    for key in OUTPUT_KEYS:
        got = out[key]
        assert got.shape == (n,), f"{key}: shape {tuple(got.shape)}, expected ({n},)"
        assert got.dtype == acc, f"{key}: dtype {got.dtype}, expected {acc}"
        assert got.device == inputs["logits"].device
        assert (got[~valid] == 0).all(), f"{key}: padding rows must be exactly 0, got {got[~valid].tolist()}"
        select = ~tie if key in ("loss", "mask") else None
        assert_no_worse(key, got, ref64[key], same[key], tol["fwd_atol"], tol["fwd_rtol"], select)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_reference(device, case, dtype, mode):
    inputs = sample_inputs(device, dtype, mode, case)
    assert inputs["logits"].is_contiguous() != CASES[case].noncontiguous
    with torch.no_grad():
        out = _op_outputs(inputs)
    check_forward(inputs, dtype, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_forward_with_anchor(device, dtype, mode):
    inputs = sample_inputs(device, dtype, mode, "v129", anchor=True, seed=1)
    with torch.no_grad():
        out = _op_outputs(inputs)
    check_forward(inputs, dtype, out)
    # The anchor changes the mask test only: the weight still uses the rollout log-prob.
    no_anchor = dict(inputs, anchor_logprobs=None)
    with torch.no_grad():
        out_plain = _op_outputs(no_anchor)
    torch.testing.assert_close(out["weight"], out_plain["weight"], rtol=0, atol=0)
    torch.testing.assert_close(out["logp"], out_plain["logp"], rtol=0, atol=0)


def test_cases_exercise_both_mask_values():
    """The forward tests would be blind to mask bugs if the inputs never masked a row."""
    for mode in MODES:
        masked = kept = 0
        for case in CASES:
            inputs = sample_inputs("cpu", torch.float64, mode, case)
            ref = reference_outputs(inputs)
            valid = inputs["tokens"] != -100
            masked += int((ref["mask"][valid] == 0).sum())
            kept += int((ref["mask"][valid] == 1).sum())
        assert kept > 0
        assert (masked > 0) == (mode != "none"), f"{mode}: masked={masked}"


@pytest.mark.parametrize("case", list(CASES))
def test_sample_inputs_are_decisive(case):
    """No row of the test inputs decides its mask within rounding of a tie (divergence vs a threshold, or pi vs mu
    once the divergence is above one), for the test thresholds and the mode defaults, in any dtype, seed or anchor
    variant the tests use. Such a row's decision is flipped by one ulp of a path's log-prob, and the ulps differ by
    host: torch's kernels, which make the inputs, round differently under AVX2 and AVX-512 (docs/contract.md,
    "Ties")."""
    for mode in MODES:
        for dtype in DTYPES:
            for seed in (0, 3, 4, 5):
                for anchor in (False, True):
                    inputs = sample_inputs("cpu", dtype, mode, case, seed=seed, anchor=anchor)
                    tie = tie_rows_for(inputs, [DELTAS[mode], DEFAULT_DELTAS[mode]])
                    assert not tie.any(), (
                        f"{mode}/{dtype}/seed={seed}/anchor={anchor}: rows "
                        f"{tie.nonzero().flatten().tolist()} sit at a tie"
                    )


def _upstream(n: int, acc: torch.dtype, device, tie: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + 17)
    g = {key: torch.randn(n, generator=gen, dtype=torch.float64).to(device=device, dtype=acc) for key in DIFFERENTIABLE}
    g["loss"] = torch.where(tie, torch.zeros_like(g["loss"]), g["loss"])  # a flipped mask changes the grad
    return g


def _weighted_sum(out: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((out[key] * g[key].to(out[key].dtype)).sum() for key in DIFFERENTIABLE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_reference_autograd(device, case, dtype, mode):
    inputs = sample_inputs(device, dtype, mode, case, seed=2)
    inputs64 = as_dtype(inputs, torch.float64)
    tie = ambiguous_rows(inputs64, reference_outputs(inputs64))
    g = _upstream(inputs["tokens"].shape[0], accumulation_dtype(dtype), device, tie)

    def grad_of(fn, kw: dict) -> torch.Tensor:
        logits = kw["logits"].detach().clone().requires_grad_(True)
        out = fn(**dict(kw, logits=logits))
        out = out if isinstance(out, dict) else out._asdict()
        _weighted_sum(out, g).backward()
        return logits.grad

    grad_op = grad_of(dppo_loss_per_row, inputs)
    grad64 = grad_of(dppo_loss_reference, inputs64)
    grad_same = grad_of(dppo_loss_reference, inputs)
    assert grad_op.dtype == dtype and grad_op.shape == inputs["logits"].shape
    valid = inputs["tokens"] != -100
    assert (grad_op[~valid] == 0).all(), "padding rows must get an exactly zero gradient"
    tol = TOL[dtype]
    lse_rounding = lse_rounding_allowance(inputs64, g, dtype)
    assert_no_worse("grad_logits", grad_op, grad64, grad_same, tol["grad_atol"], tol["grad_rtol"], extra=lse_rounding)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=_dtype_id)
@pytest.mark.parametrize("mode", ("binary_kl", "topk_tv"))
def test_compute_entropy_false(device, dtype, mode):
    inputs = sample_inputs(device, dtype, mode, "v129", seed=3)
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = dppo_loss_per_row(**dict(inputs, logits=logits), compute_entropy=False)
    assert (out.entropy == 0).all()
    (out.loss.sum() + out.entropy.sum()).backward()
    ref_logits = inputs["logits"].detach().clone().requires_grad_(True)
    ref = dppo_loss_reference(**dict(inputs, logits=ref_logits), compute_entropy=False)
    ref["loss"].sum().backward()
    tie = ambiguous_rows(as_dtype(inputs, torch.float64), reference_outputs(as_dtype(inputs, torch.float64)))
    assert not tie.any()
    torch.testing.assert_close(
        out.loss, ref["loss"], **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {})
    )
    torch.testing.assert_close(
        logits.grad, ref_logits.grad, **({"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {})
    )


@pytest.mark.parametrize("mode", ("binary_tv", "ratio", "none"))
def test_topk_inputs_ignored_outside_topk_modes(mode):
    inputs = sample_inputs("cpu", torch.float32, mode, "v129")
    topk = sample_inputs("cpu", torch.float32, "topk_tv", "v129")
    with torch.no_grad():
        plain = _op_outputs(inputs)
        with_topk = _op_outputs(dict(inputs, topk_ids=topk["topk_ids"], topk_logprobs=topk["topk_logprobs"]))
    for key in OUTPUT_KEYS:
        torch.testing.assert_close(plain[key], with_topk[key], rtol=0, atol=0)


def _gradcheck_inputs(mode: str, anchor: bool) -> dict:
    """Small float64 inputs whose weight is pinned at the cap (w = C = 0.5: the weight is a
    constant for autograd, so it must not vary under gradcheck's perturbation) and whose mask
    decisions are far from ties (tied rows get A = 0, hence an exactly zero loss)."""
    inputs = sample_inputs("cpu", torch.float64, mode, "v7_k1", seed=4, anchor=anchor)
    lp = reference_outputs(inputs)["logp"]
    valid = inputs["tokens"] != -100
    rollout = torch.where(valid, (lp - 1.0).clamp(max=0.0), inputs["rollout_logprobs"])
    rollout[2] = -math.inf
    inputs = dict(inputs, rollout_logprobs=rollout, ratio_cap=0.5)
    tie = ambiguous_rows(inputs, reference_outputs(inputs), margin=1e-3)
    inputs["advantages"] = torch.where(tie, torch.zeros_like(inputs["advantages"]), inputs["advantages"])
    return inputs


@pytest.mark.parametrize("anchor", (False, True), ids=("rollout", "anchor"))
@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_float64(mode, anchor):
    inputs = _gradcheck_inputs(mode, anchor)
    assert (reference_outputs(inputs)["weight"][inputs["tokens"] != -100] == 0.5).all()
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
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("mode", "dtype", "case"),
    [
        ("binary_tv", torch.float32, "v129"),
        ("topk_kl", torch.bfloat16, "noncontig"),
        ("binary_kl", torch.float64, "v7_k1"),
    ],
    ids=("binary_tv-float32", "topk_kl-bfloat16-noncontig", "binary_kl-float64"),
)
def test_opcheck_forward(device, mode, dtype, case):
    inputs = sample_inputs(device, dtype, mode, case, requires_grad=True, anchor=mode == "binary_kl")
    torch.library.opcheck(torch.ops.dppo.dppo_loss_forward.default, _op_args(inputs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_dtype_id)
def test_opcheck_backward(device, dtype):
    inputs = sample_inputs(device, dtype, "topk_tv", "v129")
    with torch.no_grad():
        out = dppo_loss_per_row(**inputs)
    n = out.loss.shape[0]
    acc = accumulation_dtype(dtype)
    gen = torch.Generator().manual_seed(6)
    gt = torch.randn(n, generator=gen).to(device=device, dtype=acc)
    ge = torch.randn(n, generator=gen).to(device=device, dtype=acc)
    logits, tokens, t = inputs["logits"], inputs["tokens"], float(inputs["temperature"])
    torch.library.opcheck(torch.ops.dppo.dppo_loss_backward.default, (gt, ge, logits, tokens, out.lse, out.entropy, t))
    torch.library.opcheck(torch.ops.dppo.dppo_loss_backward.default, (gt, None, logits, tokens, out.lse, None, t))
    torch.library.opcheck(
        torch.ops.dppo.dppo_loss_backward_.default, (gt, ge, logits.clone(), tokens, out.lse, out.entropy, t)
    )


def test_backward_op_direct_formula():
    """dppo_loss_backward against the contract's closed form, in float64."""
    inputs = sample_inputs("cpu", torch.float64, "none", "v129", seed=7)
    out = dppo_loss_per_row(**inputs)
    n = out.loss.shape[0]
    gen = torch.Generator().manual_seed(8)
    gt, gh = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    t = inputs["temperature"]
    grad = torch.ops.dppo.dppo_loss_backward(gt, gh, inputs["logits"], inputs["tokens"], out.lse, out.entropy, t)
    logq = torch.log_softmax(inputs["logits"] / t, dim=-1)
    p = logq.exp()
    valid = inputs["tokens"] != -100
    onehot = torch.nn.functional.one_hot(inputs["tokens"].clamp(min=0), p.shape[1]).double()
    h = -(p * logq).sum(-1, keepdim=True)
    want = (gt[:, None] * (onehot - p) - gh[:, None] * p * (logq + h)) / t
    want = torch.where(valid[:, None], want, torch.zeros_like(want))
    torch.testing.assert_close(grad, want, rtol=1e-9, atol=1e-12)
    inplace = inputs["logits"].clone()
    torch.ops.dppo.dppo_loss_backward_(gt, gh, inplace, inputs["tokens"], out.lse, out.entropy, t)
    torch.testing.assert_close(inplace, want, rtol=1e-9, atol=1e-12)


# (5) error messages ----------------------------------------------------------------------------


def _bad(kw: dict, **changes) -> dict:
    return dict(kw, **changes)


def _error_cases(kw: dict, topk_kw: dict) -> list[tuple[str, dict, type, str]]:
    n, v = kw["logits"].shape
    dev = kw["logits"].device
    m, a = kw["rollout_logprobs"], kw["advantages"]
    return [
        ("logits_1d", _bad(kw, logits=kw["logits"][0]), ValueError, r"logits must be 2-D \[N, V\]"),
        ("logits_3d", _bad(kw, logits=kw["logits"][None]), ValueError, r"logits must be 2-D \[N, V\]"),
        (
            "logits_int",
            _bad(kw, logits=kw["logits"].long()),
            TypeError,
            r"logits must be float32, float16, bfloat16 or float64",
        ),
        (
            "logits_stride",
            _bad(kw, logits=kw["logits"].t().contiguous().t()),
            ValueError,
            r"contiguous along the vocabulary",
        ),
        ("logits_empty_vocab", _bad(kw, logits=kw["logits"][:, :0]), ValueError, r"non-empty vocabulary"),
        ("tokens_len", _bad(kw, tokens=kw["tokens"][:-1]), ValueError, rf"tokens must be 1-D with N={n} rows"),
        ("tokens_2d", _bad(kw, tokens=kw["tokens"][:, None]), ValueError, rf"tokens must be 1-D with N={n} rows"),
        ("rollout_len", _bad(kw, rollout_logprobs=m[1:]), ValueError, rf"rollout_logprobs must be 1-D with N={n}"),
        ("advantages_2d", _bad(kw, advantages=a[:, None]), ValueError, rf"advantages must be 1-D with N={n}"),
        ("anchor_len", _bad(kw, anchor_logprobs=m[:2]), ValueError, rf"anchor_logprobs must be 1-D with N={n}"),
        ("tokens_int32", _bad(kw, tokens=kw["tokens"].int()), TypeError, r"tokens must have dtype Long"),
        ("rollout_f64", _bad(kw, rollout_logprobs=m.double()), TypeError, r"rollout_logprobs must have dtype Float"),
        ("advantages_f16", _bad(kw, advantages=a.half()), TypeError, r"advantages must have dtype Float"),
        (
            "token_ge_v",
            _bad(kw, tokens=torch.full_like(kw["tokens"], v)),
            IndexError,
            rf"tokens must hold ids in \[0, V={v}\)",
        ),
        (
            "token_neg",
            _bad(kw, tokens=torch.full_like(kw["tokens"], -1)),
            IndexError,
            r"tokens must hold ids in .*got -1",
        ),
        ("temperature_0", _bad(kw, temperature=0.0), ValueError, r"temperature must be a finite number > 0, got 0"),
        ("temperature_neg", _bad(kw, temperature=-1.0), ValueError, r"temperature must be a finite number > 0, got -1"),
        ("temperature_nan", _bad(kw, temperature=float("nan")), ValueError, r"temperature must be a finite number > 0"),
        ("delta_low_neg", _bad(kw, delta_low=-0.1), ValueError, r"delta_low must be a finite number >= 0, got -0.1"),
        ("delta_high_neg", _bad(kw, delta_high=-1.0), ValueError, r"delta_high must be a finite number >= 0, got -1"),
        ("ratio_cap_0", _bad(kw, ratio_cap=0.0), ValueError, r"ratio_cap must be > 0, got 0"),
        ("ratio_cap_neg", _bad(kw, ratio_cap=-2.0), ValueError, r"ratio_cap must be > 0, got -2"),
        ("mode_unknown", _bad(kw, mode="binary_js"), ValueError, r"mode must be one of .*got 'binary_js'"),
        ("topk_mode_no_topk", _bad(kw, mode="topk_kl"), ValueError, r"mode 'topk_kl' needs the rollout's top-K"),
        (
            "topk_ids_only",
            _bad(topk_kw, topk_logprobs=None),
            ValueError,
            r"topk_ids and topk_logprobs must be given together",
        ),
        (
            "topk_rows",
            _bad(topk_kw, topk_ids=topk_kw["topk_ids"][1:]),
            ValueError,
            rf"topk_ids must be 2-D \[N, K\] with N={n}",
        ),
        (
            "topk_k_mismatch",
            _bad(topk_kw, topk_logprobs=topk_kw["topk_logprobs"][:, :1]),
            ValueError,
            r"topk_logprobs must be 2-D \[N, K\] with N=.* and K=",
        ),
        (
            "topk_id_ge_v",
            _bad(topk_kw, topk_ids=torch.full_like(topk_kw["topk_ids"], v)),
            IndexError,
            rf"topk_ids must hold ids in \[0, V={v}\)",
        ),
        (
            "topk_id_neg",
            _bad(topk_kw, topk_ids=torch.full_like(topk_kw["topk_ids"], -100)),
            IndexError,
            r"topk_ids must hold ids in .*got -100",
        ),
        (
            "topk_logprobs_pos",
            _bad(topk_kw, topk_logprobs=topk_kw["topk_logprobs"].abs() + 0.5),
            ValueError,
            r"topk_logprobs must be log-probabilities",
        ),
        (
            "topk_logprobs_f64",
            _bad(topk_kw, topk_logprobs=topk_kw["topk_logprobs"].double()),
            TypeError,
            r"topk_logprobs must have dtype Float",
        ),
        (
            "rollout_positive",
            _bad(kw, rollout_logprobs=m.abs() + 0.1),
            ValueError,
            r"rollout_logprobs must be log-probabilities \(<= 0, -inf allowed, not NaN\), "
            r"got [0-9.e+]+ at flat position 0",
        ),
        (
            "rollout_nan",
            _bad(kw, rollout_logprobs=torch.full_like(m, math.nan)),
            ValueError,
            r"rollout_logprobs must be log-probabilities .*got nan",
        ),
        (
            "anchor_positive",
            _bad(kw, anchor_logprobs=torch.full_like(m, 2.0)),
            ValueError,
            r"anchor_logprobs must be log-probabilities .*got 2",
        ),
        ("advantages_nan", _bad(kw, advantages=torch.full_like(a, math.nan)), ValueError, r"advantages must be finite"),
        ("advantages_inf", _bad(kw, advantages=torch.full_like(a, math.inf)), ValueError, r"advantages must be finite"),
    ] + (
        [
            (
                "tokens_device",
                _bad(kw, tokens=kw["tokens"].cpu()),
                ValueError,
                r"tokens must be on the same device as logits",
            ),
            (
                "rollout_device",
                _bad(kw, rollout_logprobs=m.cpu()),
                ValueError,
                r"rollout_logprobs must be on the same device",
            ),
            (
                "topk_device",
                _bad(topk_kw, topk_ids=topk_kw["topk_ids"].cpu()),
                ValueError,
                r"topk_ids must be on the same device",
            ),
        ]
        if dev.type == "cuda"
        else []
    )


_ERROR_NAMES = [
    c[0]
    for c in _error_cases(
        sample_inputs("cpu", torch.float32, "binary_tv", "v129"), sample_inputs("cpu", torch.float32, "topk_tv", "v129")
    )
]
_CUDA_ERROR_NAMES = ["tokens_device", "rollout_device", "topk_device"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", _ERROR_NAMES + _CUDA_ERROR_NAMES)
def test_error_messages(device, name):
    if name in _CUDA_ERROR_NAMES and device == "cpu":
        pytest.skip("a device mismatch needs a second device")
    kw = sample_inputs(device, torch.float32, "binary_tv", "v129")
    topk_kw = sample_inputs(device, torch.float32, "topk_tv", "v129")
    cases = {c[0]: c[1:] for c in _error_cases(kw, topk_kw)}
    bad_kw, exc, pattern = cases[name]
    with pytest.raises(exc, match=pattern):
        dppo_loss_per_row(**bad_kw)


def test_backward_op_error_messages():
    kw = sample_inputs("cpu", torch.float32, "binary_tv", "v7_k1")
    out = dppo_loss_per_row(**kw)
    logits, tokens = kw["logits"], kw["tokens"]
    gt = torch.ones_like(out.loss)
    with pytest.raises(ValueError, match=r"grad_target must be 1-D with N=9"):
        torch.ops.dppo.dppo_loss_backward(gt[1:], None, logits, tokens, out.lse, None, 1.0)
    with pytest.raises(TypeError, match=r"lse must have dtype Float"):
        torch.ops.dppo.dppo_loss_backward(gt, None, logits, tokens, out.lse.double(), None, 1.0)
    with pytest.raises(ValueError, match=r"grad_entropy and entropy must be given together"):
        torch.ops.dppo.dppo_loss_backward(gt, gt, logits, tokens, out.lse, None, 1.0)
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0"):
        torch.ops.dppo.dppo_loss_backward(gt, None, logits, tokens, out.lse, None, 0.0)


# in-place backward, torch.compile, extremes -----------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ("contiguous", "column_slice"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=_dtype_id)
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl"))
def test_inplace_backward(device, dtype, mode, layout):
    inputs = sample_inputs(device, dtype, mode, "noncontig", seed=9)
    g = _upstream(
        inputs["tokens"].shape[0],
        accumulation_dtype(dtype),
        device,
        torch.zeros_like(inputs["tokens"], dtype=torch.bool),
    )

    ref_logits = inputs["logits"].detach().clone().requires_grad_(True)
    _weighted_sum(dppo_loss_per_row(**dict(inputs, logits=ref_logits))._asdict(), g).backward()

    # The logits are a non-leaf (as a model's output is: inplace_backward refuses leaves) computed
    # from the leaf `source`; column_slice: a [:, 2:V+2] view of a wider buffer, only that window is
    # written.
    n, v = inputs["logits"].shape
    if layout == "contiguous":
        source = inputs["logits"].detach().clone().requires_grad_(True)
        logits = source.clone()
    else:
        source = torch.zeros(n, v + 5, dtype=dtype, device=device)
        source[:, 2 : v + 2] = inputs["logits"].detach()
        source.requires_grad_(True)
        logits = source.clone()[:, 2 : v + 2]
    assert logits.is_contiguous() == (layout == "contiguous")
    seen = []
    logits.register_hook(seen.append)
    out = dppo_loss_per_row(**dict(inputs, logits=logits), inplace_backward=True)
    _weighted_sum(out._asdict(), g).backward()
    assert len(seen) == 1
    grad = seen[0]
    assert grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr(), (
        "inplace_backward must write the gradient into the logits' storage"
    )
    torch.testing.assert_close(grad, ref_logits.grad, rtol=0, atol=0)
    window = source.grad if layout == "contiguous" else source.grad[:, 2 : v + 2]
    torch.testing.assert_close(window, ref_logits.grad, rtol=0, atol=0)
    if layout == "column_slice":
        assert (source.grad[:, :2] == 0).all() and (source.grad[:, v + 2 :] == 0).all()
        buffer = torch.as_strided(logits.detach(), (n, v + 5), (v + 5, 1), logits.storage_offset() - 2)
        assert (buffer[:, :2] == 0).all() and (buffer[:, v + 2 :] == 0).all(), "writes outside the logits view"


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    inputs = sample_inputs(device, torch.float32, "topk_kl", "v129", seed=10)

    def step(logits, tokens, rollout, adv, ids, lps):
        out = dppo_loss_per_row(
            logits,
            tokens,
            rollout,
            adv,
            topk_ids=ids,
            topk_logprobs=lps,
            mode="topk_kl",
            temperature=1.0,
            delta_low=0.2,
            delta_high=0.3,
        )
        return out.loss.sum() + 0.1 * out.entropy.sum() + out.logp.sum(), out.mask

    args = [inputs[k] for k in ("tokens", "rollout_logprobs", "advantages", "topk_ids", "topk_logprobs")]
    z_eager = inputs["logits"].detach().clone().requires_grad_(True)
    z_comp = inputs["logits"].detach().clone().requires_grad_(True)
    loss_e, mask_e = step(z_eager, *args)
    loss_c, mask_c = torch.compile(step, fullgraph=True)(z_comp, *args)
    loss_e.backward()
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(mask_c, mask_e, rtol=0, atol=0)
    torch.testing.assert_close(z_comp.grad, z_eager.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_extreme_inputs_stay_finite(device, dtype, mode):
    """Huge (+-1e30; +-1e4 for float16), flat and tiny logits with -inf rollout log-probs."""
    inputs = sample_inputs(device, dtype, mode, "extreme", seed=11, requires_grad=True)
    assert torch.isinf(inputs["rollout_logprobs"]).any()
    out = dppo_loss_per_row(**inputs)
    for key, value in out._asdict().items():
        assert torch.isfinite(value).all(), f"{key} not finite: {value.tolist()}"
    (out.loss.sum() + out.logp.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(inputs["logits"].grad).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("anchor", (False, True), ids=("rollout", "anchor"))
def test_reference_matches_scalar_formulas(mode, anchor):
    """The oracle itself, row by row against the contract written with Python floats."""
    inputs = sample_inputs("cpu", torch.float64, mode, "v7_k1", anchor=anchor, seed=12)
    ref = reference_outputs(inputs)
    for i in range(inputs["tokens"].shape[0]):
        want = _scalar_row(inputs, i)
        for key, value in want.items():
            assert ref[key][i].item() == pytest.approx(value, rel=1e-10, abs=1e-12), (i, key)


def _scalar_row(kw: dict, i: int) -> dict[str, float]:
    """The contract for one row, in plain Python floats."""
    a = int(kw["tokens"][i])
    if a == -100:
        return dict.fromkeys(OUTPUT_KEYS, 0.0)
    t = kw["temperature"]
    s = [x / t for x in kw["logits"][i].tolist()]
    mx = max(s)
    lse = mx + math.log(sum(math.exp(x - mx) for x in s))
    lq = [x - lse for x in s]
    lp, pi = lq[a], math.exp(lq[a])
    m = float(kw["rollout_logprobs"][i])
    la = float(kw["anchor_logprobs"][i]) if kw["anchor_logprobs"] is not None else m
    mu = math.exp(la)
    adv = float(kw["advantages"][i])
    mode, dl, dh = kw["mode"], kw["delta_low"], kw["delta_high"]
    if mode == "binary_kl":
        other = sum(math.exp(x) for j, x in enumerate(lq) if j != a)
        l1p = max(math.log(other) if other > 0 else -math.inf, math.log(1e-12))
        kl = (mu * (la - lp) if mu > 0 else 0.0) + ((1 - mu) * (math.log1p(-mu) - l1p) if mu < 1 else 0.0)
        d = max(kl, 0.0)
    elif mode in TOPK_MODES:
        ids, lps = kw["topk_ids"][i].tolist(), kw["topk_logprobs"][i].tolist()
        p, q = [math.exp(x) for x in lps], [math.exp(lq[j]) for j in ids]
        pr, qr = max(1 - sum(p), 1e-12), max(1 - sum(q), 1e-12)
        if mode == "topk_tv":
            d = 0.5 * (sum(abs(x - y) for x, y in zip(p, q)) + abs(pr - qr))
        else:
            d = sum(pk * (lk - lq[j]) for pk, lk, j in zip(p, lps, ids) if pk > 0) + pr * math.log(pr / qr)
    elif mode == "ratio":
        d = math.exp(min(lp - la, 20.0))
    else:
        d = abs(pi - mu)
    if mode == "none":
        keep = 1.0
    elif mode == "ratio":
        keep = 0.0 if (adv > 0 and d > 1 + dh) or (adv <= 0 and d < 1 - dl) else 1.0
    else:
        keep = 0.0 if (adv > 0 and pi > mu and d > dh) or (adv <= 0 and pi < mu and d > dl) else 1.0
    w = min(math.exp(min(lp - m, 20.0)), kw["ratio_cap"])
    coef = -adv * w * keep
    entropy = -sum(math.exp(x) * x for x in lq)
    return {
        "loss": 0.0 if coef == 0 else coef * lp,
        "logp": lp,
        "divergence": d,
        "mask": keep,
        "weight": w,
        "entropy": entropy,
        "lse": lse,
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_dtype_id)
def test_topk_kl_rest_mass_precision(device, dtype):
    """K = 300, pi -> 1, the trainer's top-K mass 1 - 1e-10: the rest bucket q_rest ~ 1e-10 lies far
    below float's resolution near 1, so the top-K log-probs and sums must be formed in double from
    the row's partial sums (as the CUDA epilogue does); in float, q_rest rounds to the 1e-12 floor
    and topk_kl is off by ~0.05 nats."""
    v, k = 1000, 300
    z = torch.zeros(2, v, dtype=torch.float64)
    z[:, 0] = 30.0  # pi -> 1 on token 0, one of the top-K ids
    z[:, k:] = 30.0 + math.log(1e-10 / (v - k))  # the 700 tokens outside the top-K hold 1e-10
    ids = torch.arange(k).repeat(2, 1)
    p = torch.full((2, k), 0.49 / (k - 1), dtype=torch.float64)
    p[:, 0] = 0.5  # rollout: rest mass 0.01 ...
    p[1] *= 0.9  # ... and 0.109
    tokens = torch.tensor([0, 0])
    args = dict(
        logits=z.to(dtype).to(device),
        tokens=tokens.to(device),
        rollout_logprobs=torch.log(p[torch.arange(2), tokens]).float().to(device),
        advantages=torch.tensor([1.0, -1.0]).to(device),
        topk_ids=ids.to(device),
        topk_logprobs=torch.log(p).float().to(device),
        mode="topk_kl",
        temperature=1.0,
    )
    got = dppo_loss_per_row(**args).divergence.double().cpu()
    want = dppo_loss_reference(
        z.to(dtype).double(),
        tokens,
        torch.log(p[torch.arange(2), tokens]),
        torch.tensor([1.0, -1.0]),
        topk_ids=ids,
        topk_logprobs=torch.log(p),
        mode="topk_kl",
    )["divergence"]
    assert torch.allclose(got, want, rtol=1e-5, atol=0), f"topk_kl {got.tolist()} vs float64 {want.tolist()}"

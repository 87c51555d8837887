"""Property tests (hypothesis): random shapes, dtypes, modes and extreme values.

Each example draws N, V, K, the logits dtype, the mode, a temperature, a logit scale from tiny to huge (1e-30
... 1e30; float16 stops at 1e4), a common offset (0, +-1e4, -1e30), a fraction of -inf rollout log-probs, a
fraction of padding rows (possibly all), an optional mask anchor and the entropy flag. Properties: every op
output is finite, padding rows are exactly 0 with a zero gradient, and outputs and gradients agree with
dppo_ext.reference within dppo_testing's tolerance rule. Derandomized, so CI sees the same
examples every run.
"""

from __future__ import annotations

import math

import torch
from dppo_testing import (
    TOL,
    ambiguous_rows,
    as_dtype,
    assert_no_worse,
    lse_rounding_allowance,
    reference_outputs,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dppo_ext import dppo_loss_per_row
from dppo_ext.contract import MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import OUTPUT_KEYS, dppo_loss_reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def op_inputs(draw) -> dict:
    dtype = draw(st.sampled_from(DTYPES))
    mode = draw(st.sampled_from(MODES))
    n = draw(st.integers(0, 12))
    v = draw(st.sampled_from((1, 2, 3, 7, 8, 9, 31, 64, 65, 257, 1031)))
    k = draw(st.integers(1, min(v, 12)))
    top_scale = 1e4 if dtype == torch.float16 else 1e30
    scale = draw(st.sampled_from((1e-30, 0.1, 1.0, 5.0, 30.0, 1e4, top_scale)))
    # A common offset: softmax is shift-invariant, the op must be too (up to its lse rounding).
    offset = draw(st.sampled_from((0.0, 0.0, 0.0, 1e4, -1e4) + (() if dtype == torch.float16 else (-1e30,))))
    temperature = draw(st.sampled_from((0.3, 0.7, 1.0, 1.5)))
    inf_frac = draw(st.sampled_from((0.0, 0.3, 1.0)))
    pad_frac = draw(st.sampled_from((0.0, 0.3, 1.0)))
    anchor = draw(st.booleans())
    compute_entropy = draw(st.booleans())
    delta_low = draw(st.sampled_from((0.0, 0.05, 0.2, 1.0)))
    delta_high = draw(st.sampled_from((0.0, 0.08, 0.28, 1.0)))
    seed = draw(st.integers(0, 2**16))

    gen = torch.Generator().manual_seed(seed)
    acc = accumulation_dtype(dtype)
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * scale + offset
    if dtype == torch.float16:
        z = z.clamp(-6e4, 6e4)
    logits = z.to(dtype)
    z = logits.double()
    rollout_all = torch.log_softmax((z + torch.randn(n, v, generator=gen, dtype=torch.float64)) / temperature, -1)
    tokens = torch.randint(0, v, (n,), generator=gen)
    rollout = rollout_all.gather(1, tokens[:, None]).squeeze(1).clamp(max=0.0)
    rollout = torch.where(torch.rand(n, generator=gen) < inf_frac, -math.inf, rollout)
    tokens = torch.where(torch.rand(n, generator=gen) < pad_frac, -100, tokens)
    topk_lp, topk_ids = rollout_all.topk(k, dim=-1)
    anchor_lp = (rollout.clamp(min=-50.0) + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0.0)
    return {
        "logits": logits,
        "tokens": tokens,
        "rollout_logprobs": rollout.to(acc),
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64).to(acc),
        "topk_ids": topk_ids if mode in TOPK_MODES else None,
        "topk_logprobs": topk_lp.to(acc) if mode in TOPK_MODES else None,
        "anchor_logprobs": anchor_lp.to(acc) if anchor else None,
        "mode": mode,
        "temperature": temperature,
        "delta_low": delta_low,
        "delta_high": delta_high,
        "ratio_cap": draw(st.sampled_from((0.5, 2.0, 10.0))),
        "compute_entropy": compute_entropy,
    }


@SETTINGS
@given(op_inputs())
def test_forward_finite_and_matches_reference(inputs):
    dtype = inputs["logits"].dtype
    with torch.no_grad():
        out = dppo_loss_per_row(**inputs)._asdict()
    valid = inputs["tokens"] != -100
    for key in OUTPUT_KEYS:
        assert torch.isfinite(out[key]).all(), f"{key} not finite: {out[key].tolist()}"
        assert (out[key][~valid] == 0).all(), f"{key}: padding rows must be 0"
    inputs64 = as_dtype(inputs, torch.float64)
    ref64 = reference_outputs(inputs64)
    same = reference_outputs(inputs)
    tie = ambiguous_rows(inputs64, ref64)
    tol = TOL[dtype]
    for key in OUTPUT_KEYS:
        select = ~tie if key in ("loss", "mask") else None
        assert_no_worse(key, out[key], ref64[key], same[key], tol["fwd_atol"], tol["fwd_rtol"], select)


@SETTINGS
@given(op_inputs())
def test_backward_finite_and_matches_reference(inputs):
    dtype = inputs["logits"].dtype
    inputs64 = as_dtype(inputs, torch.float64)
    tie = ambiguous_rows(inputs64, reference_outputs(inputs64))
    n = inputs["tokens"].shape[0]
    gen = torch.Generator().manual_seed(n)
    g = {key: torch.randn(n, generator=gen, dtype=torch.float64) for key in ("loss", "logp", "entropy")}
    g["loss"] = torch.where(tie, torch.zeros_like(g["loss"]), g["loss"])

    def grad_of(fn, kw: dict) -> torch.Tensor:
        logits = kw["logits"].detach().clone().requires_grad_(True)
        out = fn(**dict(kw, logits=logits))
        out = out if isinstance(out, dict) else out._asdict()
        total = sum((out[key] * g[key].to(out[key].dtype)).sum() for key in g)
        total.backward()
        return logits.grad

    grad_op = grad_of(dppo_loss_per_row, inputs)
    assert torch.isfinite(grad_op).all()
    assert (grad_op[inputs["tokens"] == -100] == 0).all()
    grad64 = grad_of(dppo_loss_reference, inputs64)
    grad_same = grad_of(dppo_loss_reference, inputs)
    tol = TOL[dtype]
    assert_no_worse(
        "grad_logits",
        grad_op,
        grad64,
        grad_same,
        tol["grad_atol"],
        tol["grad_rtol"],
        extra=lse_rounding_allowance(inputs64, g, dtype),
    )

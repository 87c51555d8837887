"""dppo_ext.fused_linear against the logits path (LM-head matmul + dppo_ext.dppo_loss_per_row / dppo_loss).

Checks: (1) every forward output and (2) the gradients of hidden, weight and bias under a random upstream
gradient on loss, logp and entropy, for every mode, in float64, float32 and bfloat16, with chunk plans that split
rows unevenly (N = 37, chunk 8), split the vocabulary into uneven tiles, N = 1, N = 0 and the automatic plan;
(3) in float64 also against the op-free dppo_ext.reference with autograd; (4) tied input/output embeddings;
(5) no [N, V] tensor is ever created; (6) fused_linear_dppo_loss and FusedLinearDPPOLoss equal dppo_ext.dppo_loss
and DPPOLoss (same argument names and defaults, every aggregation mode, [B, T, H] and [N, H]); (7) error messages;
(8) the training path that computes the gradients in the forward (fused_linear_dppo_loss with grad): against the
logits path in every aggregation and dtype, frozen head or hidden, a second backward, torch.compile, the vocabulary-
parallel form, and its three LM-head products per step (counted).
Steps (1)-(5) drive the per-row core, fused_linear_dppo_loss_per_row.

Tolerance rule (as test_dppo_op.py): the truth is the float64 logits path on the same rounded inputs; in float32
and bfloat16 the fused result's error must be at most twice the same-precision logits path's error plus the
dtype's tolerance. Rows whose mask decision is within rounding of a tie are left out of loss/mask comparisons and
get no upstream gradient on the loss.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from dppo_testing import TOL, ambiguous_rows, child_env
from torch.utils._python_dispatch import TorchDispatchMode

import dppo_ext
from dppo_ext import (
    DPPOLoss,
    FusedLinearDPPOLoss,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
)
from dppo_ext._lm_head_tiles import FusedLinearPlan, plan_chunks
from dppo_ext.contract import MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import dppo_loss_reference

DTYPES = (torch.float64, torch.float32, torch.bfloat16)
DIFFERENTIABLE = ("loss", "logp", "entropy")
OUTPUTS = ("loss", "logp", "divergence", "mask", "weight", "entropy", "lse")
# Thresholds giving a mix of masked and kept rows on these inputs.
DELTAS = {
    "binary_tv": (0.05, 0.08),
    "binary_kl": (0.05, 0.08),
    "topk_tv": (0.15, 0.2),
    "topk_kl": (0.2, 0.3),
    "ratio": (0.2, 0.28),
    "none": (0.2, 0.2),
}
# Gradient tolerances of the matmul'd gradients (relative to the gradient's scale, see _close_enough).
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2e-2}
# name: (N, V, H, chunk_size, vocab_chunk_size, memory_budget_bytes)
PLANS = {
    "rows_37_chunk_8": (37, 257, 24, 8, None, None),
    "tiles_8x13": (37, 257, 24, 8, 13, None),
    "n1": (1, 257, 24, None, None, None),
    "auto_small_budget": (37, 257, 24, None, None, 10 * 258 * 8),
}


def _id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_inputs(
    n: int, v: int, h: int, mode: str, *, seed: int = 0, temperature: float = 0.8, anchor: bool = False
) -> dict:
    """float64 inputs: hidden [N, H], weight [V, H], bias [V] and the op's per-row inputs.

    The rollout distribution is the model's logits plus noise (mixed masks); tokens are sampled from it; the
    last two rows (when N >= 4) are padding; top-K (K = 5) comes from the rollout distribution.
    """
    g = torch.Generator().manual_seed(seed * 31 + n * 7 + v + sum(map(ord, mode)))
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (2.0 / math.sqrt(h))
    bias = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    logits = hidden @ weight.t() + bias
    rollout = torch.log_softmax((logits + torch.randn(n, v, generator=g, dtype=torch.float64)) / temperature, -1)
    tokens = torch.multinomial(rollout.exp(), 1, generator=g).squeeze(1) if n else torch.zeros(0, dtype=torch.long)
    rollout_logprobs = rollout.gather(1, tokens[:, None]).squeeze(1)
    if n >= 4:
        tokens[-2:] = -100
    topk_logprobs, topk_ids = rollout.topk(5, dim=-1) if mode in TOPK_MODES else (None, None)
    anchor_logprobs = (rollout_logprobs + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    delta_low, delta_high = DELTAS[mode]
    return {
        "hidden": hidden,
        "weight": weight,
        "bias": bias,
        "tokens": tokens,
        "rollout_logprobs": rollout_logprobs,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "topk_ids": topk_ids,
        "topk_logprobs": topk_logprobs,
        "anchor_logprobs": anchor_logprobs if anchor else None,
        "mode": mode,
        "temperature": temperature,
        "delta_low": delta_low,
        "delta_high": delta_high,
        "ratio_cap": 10.0 if mode != "none" else 2.0,
    }


def cast(inputs: dict, dtype: torch.dtype) -> dict:
    """hidden/weight/bias in ``dtype``, per-row floats in its accumulation dtype (everything detached)."""
    acc = accumulation_dtype(dtype)
    out = dict(inputs)
    for key in ("hidden", "weight", "bias"):
        out[key] = inputs[key].detach().to(dtype) if inputs[key] is not None else None
    for key in ("rollout_logprobs", "advantages", "topk_logprobs", "anchor_logprobs"):
        out[key] = inputs[key].to(acc) if inputs[key] is not None else None
    return out


def _op_kwargs(inputs: dict) -> dict:
    keys = (
        "tokens",
        "rollout_logprobs",
        "advantages",
        "topk_ids",
        "topk_logprobs",
        "anchor_logprobs",
        "mode",
        "temperature",
        "delta_low",
        "delta_high",
        "ratio_cap",
    )
    return {k: inputs[k] for k in keys}


def logits_path(hidden, weight, bias, inputs: dict) -> dict:
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    return dppo_loss_per_row(logits, **_op_kwargs(inputs))._asdict()


def reference_path(hidden, weight, bias, inputs: dict) -> dict:
    logits = hidden @ weight.t() + (bias if bias is not None else 0)
    return dppo_loss_reference(logits, **_op_kwargs(inputs))


def fused_path(chunk_size=None, vocab_chunk_size=None, budget=None):
    def run(hidden, weight, bias, inputs: dict) -> dict:
        return fused_linear_dppo_loss_per_row(
            hidden,
            weight,
            bias=bias,
            chunk_size=chunk_size,
            vocab_chunk_size=vocab_chunk_size,
            memory_budget_bytes=budget,
            **_op_kwargs(inputs),
        )._asdict()

    return run


def run_with_grads(path, inputs: dict, upstream: dict) -> tuple[dict, dict]:
    """Outputs and (hidden, weight, bias) gradients of ``sum(out[k] * upstream[k])`` over loss/logp/entropy."""
    leaves = {
        k: None if inputs[k] is None else inputs[k].detach().clone().requires_grad_(True)
        for k in ("hidden", "weight", "bias")
    }
    out = path(leaves["hidden"], leaves["weight"], leaves["bias"], inputs)
    total = sum((out[k] * upstream[k].to(out[k].dtype)).sum() for k in DIFFERENTIABLE)
    total.backward()
    return {k: v.detach() for k, v in out.items()}, {k: None if t is None else t.grad for k, t in leaves.items()}


def upstream_grads(n: int, tie: torch.Tensor, seed: int = 5) -> dict:
    g = torch.Generator().manual_seed(seed)
    up = {k: torch.randn(n, generator=g, dtype=torch.float64) for k in DIFFERENTIABLE}
    up["loss"][tie] = 0.0  # a mask tie may flip under rounding: no loss gradient through that row
    return up


def _close_enough(name: str, got, want, base, scale_tol: float) -> None:
    """max|got - want| <= 2 * max|base - want| + scale_tol * max|want| (+ tiny), and no NaN."""
    got, want, base = got.double(), want.double(), base.double()
    assert not torch.isnan(got).any(), f"{name}: NaN"
    if got.numel() == 0:
        return
    finite = torch.isfinite(want)
    assert torch.equal(got[~finite], want[~finite]), f"{name}: non-finite values differ"
    err = (got - want)[finite].abs().max().item() if finite.any() else 0.0
    base_err = (base - want)[finite].abs().max().item() if finite.any() else 0.0
    scale = want[finite].abs().max().item() if finite.any() else 0.0
    bound = 2 * base_err + scale_tol * scale + 1e-300
    assert err <= bound, f"{name}: fused error {err:.3e} > bound {bound:.3e} (logits path error {base_err:.3e})"


def check_against_logits_path(inputs64: dict, dtype: torch.dtype, fused) -> None:
    inputs = cast(inputs64, dtype)
    truth_in = cast(inputs, torch.float64)  # the same rounded values, in float64
    n = inputs["tokens"].shape[0]
    ref_out = logits_path(truth_in["hidden"], truth_in["weight"], truth_in["bias"], truth_in)
    tie = ambiguous_rows(truth_in, ref_out)
    up = upstream_grads(n, tie)
    want_out, want_grad = run_with_grads(logits_path, truth_in, up)
    base_out, base_grad = run_with_grads(logits_path, inputs, up)
    got_out, got_grad = run_with_grads(fused, inputs, up)

    tol = TOL[dtype]
    keep = ~tie
    for key in OUTPUTS:
        assert got_out[key].shape == (n,) and got_out[key].dtype == accumulation_dtype(dtype), key
        sel = keep if key in ("loss", "mask", "weight") else torch.ones_like(keep)
        _close_enough(key, got_out[key][sel], want_out[key][sel], base_out[key][sel], tol["fwd_rtol"])
    for key in ("hidden", "weight", "bias"):
        assert got_grad[key].dtype == dtype and got_grad[key].shape == inputs[key].shape, key
        _close_enough(f"grad_{key}", got_grad[key], want_grad[key], base_grad[key], GRAD_TOL[dtype])
    valid = inputs["tokens"] != -100
    assert (got_grad["hidden"][~valid] == 0).all(), "padding rows must get a zero hidden gradient"


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("mode", MODES)
def test_matches_logits_path_all_modes(mode, dtype):
    n, v, h, chunk, vchunk, budget = PLANS["tiles_8x13"]
    check_against_logits_path(make_inputs(n, v, h, mode), dtype, fused_path(chunk, vchunk, budget))


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("plan", [p for p in PLANS if p != "tiles_8x13"])
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl"))
def test_matches_logits_path_chunk_plans(plan, mode, dtype):
    n, v, h, chunk, vchunk, budget = PLANS[plan]
    check_against_logits_path(make_inputs(n, v, h, mode, anchor=True), dtype, fused_path(chunk, vchunk, budget))


@pytest.mark.parametrize("mode", MODES)
def test_float64_matches_op_free_reference(mode):
    """Independent of the op: the reference's full log-softmax + autograd, through the same matmul."""
    inputs = make_inputs(37, 257, 24, mode, seed=3)
    tie = ambiguous_rows(inputs, reference_path(inputs["hidden"], inputs["weight"], inputs["bias"], inputs))
    up = upstream_grads(37, tie)
    want_out, want_grad = run_with_grads(reference_path, inputs, up)
    got_out, got_grad = run_with_grads(fused_path(8, 13), inputs, up)
    for key in OUTPUTS:
        torch.testing.assert_close(
            got_out[key][~tie],
            want_out[key][~tie].to(torch.float64),
            rtol=1e-9,
            atol=1e-10,
            msg=lambda m, key=key: f"{key}: {m}",
        )
    for key in ("hidden", "weight", "bias"):
        torch.testing.assert_close(
            got_grad[key], want_grad[key], rtol=1e-8, atol=1e-10, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_no_bias_and_n0():
    inputs = make_inputs(6, 33, 8, "binary_kl")
    inputs["bias"] = None
    up = upstream_grads(6, torch.zeros(6, dtype=torch.bool))
    want_out, want_grad = run_with_grads(logits_path, inputs, up)
    got_out, got_grad = run_with_grads(fused_path(4, 5), inputs, up)
    assert got_grad["bias"] is None
    for key in ("hidden", "weight"):
        torch.testing.assert_close(got_grad[key], want_grad[key], rtol=1e-9, atol=1e-12)
    empty = make_inputs(0, 33, 8, "binary_tv")
    out, grads = run_with_grads(fused_path(), empty, upstream_grads(0, torch.zeros(0, dtype=torch.bool)))
    assert all(t.shape == (0,) for t in out.values())
    assert (grads["weight"] == 0).all() and (grads["bias"] == 0).all() and grads["hidden"].shape == (0, 8)


def test_noncontiguous_hidden_and_expanded_upstream_grads():
    """hidden as a column-slice view; upstream grads from .sum() are stride-0 expands."""
    inputs = make_inputs(37, 257, 24, "binary_kl", anchor=True)
    kw = _op_kwargs(inputs)

    def grads(fused: bool):
        wide = torch.zeros(37, 30, dtype=torch.float64)
        wide[:, 3:27] = inputs["hidden"]
        wide.requires_grad_(True)
        weight = inputs["weight"].clone().requires_grad_(True)
        hidden = wide[:, 3:27]
        out = (
            fused_linear_dppo_loss_per_row(hidden, weight, chunk_size=8, vocab_chunk_size=40, **kw)
            if fused
            else dppo_loss_per_row(hidden @ weight.t(), **kw)
        )
        (out.loss.sum() + out.entropy.sum() - out.logp.sum()).backward()
        return wide.grad, weight.grad

    for got, want in zip(grads(True), grads(False)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32), ids=_id)
def test_tied_embeddings(dtype):
    """weight = the input embedding: its gradient sums the embedding lookup's and the LM head's parts."""
    inputs = make_inputs(37, 257, 24, "binary_tv")
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 257, (37,), generator=g)
    proj0 = (torch.randn(24, 24, generator=g, dtype=torch.float64) / 5).to(dtype)
    emb0 = inputs["weight"].to(dtype)
    acc = accumulation_dtype(dtype)
    kw = _op_kwargs(cast(inputs, dtype))

    def grads(fused: bool):
        emb = emb0.clone().requires_grad_(True)
        proj = proj0.clone().requires_grad_(True)
        hidden = torch.tanh(emb[ids] @ proj)
        if fused:
            out = fused_linear_dppo_loss_per_row(hidden, emb, chunk_size=8, vocab_chunk_size=100, **kw)
        else:
            out = dppo_loss_per_row(hidden @ emb.t(), **kw)
        (out.loss.sum() + 0.5 * out.entropy.sum() + out.logp.to(acc).sum()).backward()
        return emb.grad, proj.grad

    (emb_f, proj_f), (emb_l, proj_l) = grads(True), grads(False)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(emb_f, emb_l, rtol=tol, atol=tol)
    torch.testing.assert_close(proj_f, proj_l, rtol=tol, atol=tol)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("plan", ("rows_37_chunk_8", "tiles_8x13"))
def test_never_materialises_logits(plan):
    n, v, h, chunk, vchunk, budget = PLANS[plan]
    inputs = cast(make_inputs(n, v, h, "binary_tv"), torch.float32)
    up = upstream_grads(n, torch.zeros(n, dtype=torch.bool))
    seen = {}
    for name, path in (("fused", fused_path(chunk, vchunk, budget)), ("logits", logits_path)):
        with _LargestTensor() as mode:
            run_with_grads(path, inputs, up)
        seen[name] = mode.largest
    assert seen["logits"] >= n * v, "the detector must see the logits path's [N, V] tensor"
    limit = max(FusedLinearPlan(chunk, chunk, vchunk or v).buffer_bytes(v, 1), v * h)  # buffer or the weight
    assert seen["fused"] <= limit < n * v, seen


def test_plan_chunks_respects_budget_and_overrides():
    plan = plan_chunks(8192, 151936, 2048, torch.bfloat16)
    budget = max(64 * 1024 * 1024, 8192 * 2048 * 2)
    assert plan.buffer_bytes(151936, 2) <= budget
    assert plan.tile_rows == 8192, "the default plan keeps all rows in one backward tile"
    assert plan_chunks(37, 257, 24, torch.float32, chunk_size=8) == FusedLinearPlan(8, 8, 257)
    assert plan_chunks(37, 257, 24, torch.float32, chunk_size=8, vocab_chunk_size=13) == FusedLinearPlan(8, 8, 13)
    small = plan_chunks(37, 257, 24, torch.float32, memory_budget_bytes=10 * 258 * 4)
    assert small.buffer_bytes(257, 4) <= 10 * 258 * 4 and small.tile_rows < 37
    huge_n = plan_chunks(1_000_000, 151936, 2048, torch.bfloat16)
    assert huge_n.buffer_bytes(151936, 2) <= 1_000_000 * 2048 * 2 and huge_n.tile_rows < 1_000_000
    # the training forward (gradients in the forward): rows only, at least 256 (512 in 16 bits) or 16 MiB of logits
    assert plan_chunks(2048, 32768, 512, torch.float32, grads_in_forward=True) == FusedLinearPlan(256, 0, 0)
    assert plan_chunks(2048, 8192, 512, torch.float32, grads_in_forward=True).chunk_rows == 512
    assert plan_chunks(2048, 32768, 512, torch.bfloat16, grads_in_forward=True).chunk_rows == 256
    # a large head: a chunk's logits up to a quarter of the weight gradient (H / 4 rows)
    assert plan_chunks(8192, 151936, 2048, torch.float32, grads_in_forward=True).chunk_rows == 512
    assert plan_chunks(8192, 151936, 2048, torch.bfloat16, grads_in_forward=True).chunk_rows == 512
    assert plan_chunks(100, 32768, 512, torch.float32, grads_in_forward=True).chunk_rows == 100
    assert plan_chunks(2048, 32768, 512, torch.float32, chunk_size=8, grads_in_forward=True).chunk_rows == 8
    budget = plan_chunks(2048, 1000, 512, torch.float32, memory_budget_bytes=40_000, grads_in_forward=True)
    assert budget.chunk_rows == 10 and budget.buffer_bytes(1000, 4) <= 40_000


def _batch(b=3, t=7, h=16, v=61, seed=4, mode="binary_tv"):
    """[B, T, H] hidden, [V, H] weight, [V] bias and the rollout tensors; sequence 2 is empty, 0 right-padded;
    advantages alternate in sign (sequence 1 negative, so tokens the rollout over-sampled get masked)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / 1.5
    bias = torch.randn(v, generator=g, dtype=torch.float64) / 3
    noise = 2.0 * torch.randn(b, t, v, generator=g, dtype=torch.float64)  # rollout != policy: some tokens masked
    rollout_all = torch.log_softmax(hidden @ weight.t() + bias + noise, -1)
    tokens = torch.multinomial(rollout_all.exp().reshape(-1, v), 1, generator=g).reshape(b, t)
    rollout = rollout_all.gather(-1, tokens[..., None]).squeeze(-1)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2] = False
    topk_lp, topk_ids = rollout_all.topk(4, dim=-1) if mode in TOPK_MODES else (None, None)
    return dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        tokens=tokens,
        rollout_logprobs=rollout,
        advantages=torch.randn(b, generator=g, dtype=torch.float64).abs() * (-1.0) ** torch.arange(b),
        response_mask=mask,
        topk_ids=topk_ids,
        topk_logprobs=topk_lp,
    )


def _logits_and_fused(d: dict, flat: bool, **kw):
    """(loss, metrics, grads of hidden/weight/bias) through dppo_loss on logits and through fused_linear_dppo_loss."""
    results = []
    for fused in (False, True):
        leaves = {k: d[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")}
        hidden = leaves["hidden"]
        rest = {k: d[k] for k in ("tokens", "rollout_logprobs", "response_mask", "topk_ids", "topk_logprobs")}
        adv = d["advantages"][:, None].expand(d["tokens"].shape)
        if flat:  # [N, H] with per-token advantages
            hidden = hidden.reshape(-1, hidden.shape[-1])
            rest = {k: None if x is None else x.reshape(hidden.shape[0], *x.shape[2:]) for k, x in rest.items()}
            adv = adv.reshape(-1)
        elif kw.get("loss_agg_mode", "").startswith("seq"):
            adv = d["advantages"]  # [B]: per-sequence advantages
        if fused:
            loss, metrics = fused_linear_dppo_loss(
                hidden,
                leaves["weight"],
                rest.pop("tokens"),
                rest.pop("rollout_logprobs"),
                adv,
                bias=leaves["bias"],
                chunk_size=4,
                vocab_chunk_size=9,
                **rest,
                **kw,
            )
        else:
            logits = hidden @ leaves["weight"].t() + leaves["bias"]
            loss, metrics = dppo_loss(logits, rest.pop("tokens"), rest.pop("rollout_logprobs"), adv, **rest, **kw)
        grads = torch.autograd.grad(loss, tuple(leaves.values()))
        results.append((loss, metrics, grads))
    return results


@pytest.mark.parametrize("flat", (False, True), ids=("BTH", "NH"))
@pytest.mark.parametrize("agg", dppo_ext.AGG_MODES)
def test_fused_linear_dppo_loss_matches_dppo_loss(agg, flat):
    """fused_linear_dppo_loss(hidden, weight, ...) == dppo_loss(hidden @ weight.T + bias, ...): loss, every metric
    and the hidden/weight/bias gradients, with the per-mode default thresholds (none given)."""
    d = _batch()
    (loss_l, metrics_l, grads_l), (loss_f, metrics_f, grads_f) = _logits_and_fused(
        d, flat, loss_agg_mode=agg, mode="binary_tv", temperature=0.9
    )
    assert loss_f.dim() == 0
    torch.testing.assert_close(loss_f, loss_l, rtol=1e-10, atol=1e-12)
    assert metrics_f.keys() == metrics_l.keys()
    for key in metrics_l:
        torch.testing.assert_close(metrics_f[key], metrics_l[key], rtol=1e-10, atol=1e-12, msg=key)
    for got, want in zip(grads_f, grads_l):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert metrics_l["masked_frac"] > 0, "the inputs should mask some tokens under the default thresholds"


@pytest.mark.parametrize("mode", ("dppo_tv", "dppo_kl", "topk_kl", "ratio"))
def test_fused_linear_dppo_loss_modes_and_aliases(mode):
    """Per-mode defaults and verl's mode names, through the fused path as through dppo_loss."""
    d = _batch(mode=dppo_ext.MODE_ALIASES.get(mode, mode), seed=8)
    (loss_l, metrics_l, grads_l), (loss_f, metrics_f, grads_f) = _logits_and_fused(
        d, False, mode=mode, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=11.0
    )
    torch.testing.assert_close(loss_f, loss_l, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(metrics_f["masked_frac"], metrics_l["masked_frac"], rtol=0, atol=0)
    for got, want in zip(grads_f, grads_l):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_same_signature_as_dppo_loss():
    """One API family: every dppo_loss argument (but logits / inplace_backward) exists in the fused function and
    module with the same default; the modules hold the same settings."""
    import inspect

    def params(fn, skip=()):
        return {n: p.default for n, p in inspect.signature(fn).parameters.items() if n not in skip}

    logits_fn = params(dppo_loss, ("logits", "inplace_backward"))
    fused_fn = params(
        fused_linear_dppo_loss,
        (
            "hidden",
            "weight",
            "bias",
            "chunk_size",
            "vocab_chunk_size",
            "memory_budget_bytes",
            "accum_dtype",
            "logits_dtype",
            "weight_context",
        ),
    )
    assert fused_fn == logits_fn
    logits_mod = params(DPPOLoss.__init__, ("self", "inplace_backward"))
    fused_mod = params(
        FusedLinearDPPOLoss.__init__,
        ("self", "chunk_size", "vocab_chunk_size", "memory_budget_bytes", "accum_dtype", "logits_dtype"),
    )
    assert fused_mod == logits_mod
    assert set(params(DPPOLoss.forward, ("self", "logits"))) | {"bias", "weight", "weight_context"} == set(
        params(FusedLinearDPPOLoss.forward, ("self", "hidden"))
    )


def test_per_row_family_signatures():
    """One API family (docs/names.md): each _per_row variant takes its aggregating function's tensors positionally,
    every setting keyword-only, with the same names and defaults, less the aggregation's."""
    import inspect

    def split(fn):
        params = inspect.signature(fn).parameters.values()
        positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        return positional, {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}

    aggregation = {"response_mask", "loss_agg_mode", "loss_scale_factor"}
    # packed rows name their sequences (the aggregating functions' [B, T] rows are one sequence per b)
    packed = {"sequence_ids": None, "cu_seqlens": None}
    for per_row, aggregating, only_there in (
        (dppo_loss_per_row, dppo_loss, packed),
        (fused_linear_dppo_loss_per_row, fused_linear_dppo_loss, {**packed, "reduce_hidden_grad": True}),
    ):
        rows_pos, rows_kw = split(per_row)
        agg_pos, agg_kw = split(aggregating)
        assert rows_pos == agg_pos, per_row.__name__
        want = {k: v for k, v in agg_kw.items() if k not in aggregation and k != "accum_dtype"}
        assert rows_kw == {**want, **only_there}, per_row.__name__
    assert split(dppo_loss_per_row)[0] == ["logits", "tokens", "rollout_logprobs", "advantages"]


def test_module_form():
    """FusedLinearDPPOLoss on an nn.Linear head equals the function and dppo_loss on the head's logits."""
    d = _batch(seed=2)
    head = torch.nn.Linear(16, 61, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(d["weight"])
        head.bias.copy_(d["bias"])
    crit = FusedLinearDPPOLoss(mode="dppo_kl", temperature=0.8, loss_agg_mode="seq-mean-token-mean", chunk_size=5)
    assert crit.mode == "binary_kl" and "binary_kl" in repr(crit)
    args = (d["tokens"], d["rollout_logprobs"], d["advantages"])
    loss_m, metrics_m = crit(d["hidden"], head.weight, *args, bias=head.bias, response_mask=d["response_mask"])
    loss_m.backward()
    grad_m = head.weight.grad.clone()
    head.weight.grad = None
    loss_l, _ = DPPOLoss(mode="binary_kl", temperature=0.8, loss_agg_mode="seq-mean-token-mean")(
        head(d["hidden"]), *args, response_mask=d["response_mask"]
    )
    loss_l.backward()
    torch.testing.assert_close(loss_m, loss_l, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad_m, head.weight.grad, rtol=1e-9, atol=1e-12)
    assert metrics_m["num_tokens"].item() == d["response_mask"].sum().item()


def _args(**over):
    base = make_inputs(5, 11, 4, "binary_tv")
    kw = dict(
        hidden=base["hidden"],
        weight=base["weight"],
        tokens=base["tokens"],
        rollout_logprobs=base["rollout_logprobs"],
        advantages=base["advantages"],
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, exc, match",
    [
        (dict(hidden=torch.zeros(5)), ValueError, r"hidden must be 2-D \[N, H\], got shape \(5,\)"),
        (dict(weight=torch.zeros(11, 3, dtype=torch.float64)), ValueError, r"weight must be 2-D \[V, H\] with H=4"),
        (dict(weight=torch.zeros(11, 4)), TypeError, r"weight dtype must equal hidden dtype torch.float64"),
        (dict(tokens=torch.zeros(4, dtype=torch.long)), ValueError, r"tokens must be 1-D with N=5 rows"),
        (dict(advantages=torch.zeros(6, dtype=torch.float64)), ValueError, r"advantages must be 1-D with N=5 rows"),
        (dict(bias=torch.zeros(10, dtype=torch.float64)), ValueError, r"bias must be \[V\] with V=11"),
        (dict(chunk_size=0), ValueError, r"chunk_size must be a positive int or None, got 0"),
        (dict(vocab_chunk_size=-3), ValueError, r"vocab_chunk_size must be a positive int or None, got -3"),
        (dict(tokens=torch.full((5,), 11)), (ValueError, IndexError), r"11"),
    ],
)
def test_error_messages(over, exc, match):
    with pytest.raises(exc, match=match):
        fused_linear_dppo_loss_per_row(**_args(**over))


def test_aggregated_error_messages():
    d = _batch()
    args = (d["hidden"], d["weight"], d["tokens"], d["rollout_logprobs"], d["advantages"])
    with pytest.raises(ValueError, match=r"hidden must be \[\.\.\., H\] with at least 2 dims, got shape \(16,\)"):
        fused_linear_dppo_loss(d["hidden"][0, 0], *args[1:])
    with pytest.raises(ValueError, match=r"tokens must have shape \(3, 7\) \(hidden's leading dims\), got \(3, 6\)"):
        fused_linear_dppo_loss(args[0], args[1], d["tokens"][:, :6], *args[3:])
    with pytest.raises(ValueError, match=r"advantages must have shape \(3, 7\) \(per token\) or \(3,\)"):
        fused_linear_dppo_loss(*args[:4], torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'tv'"):
        fused_linear_dppo_loss(*args, mode="tv")
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of .*got 'mean'"):
        FusedLinearDPPOLoss(loss_agg_mode="mean")
    with pytest.raises(ValueError, match=r"loss_scale_factor is only used by"):
        fused_linear_dppo_loss(*args, loss_scale_factor=3.0)
    for grad in (False, True):  # both forwards: the per-row one (no grad) and the one computing gradients
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"loss_agg_mode must be one of .*got None"):
            fused_linear_dppo_loss(args[0].requires_grad_(grad), *args[1:], loss_agg_mode=None)


# gradients in the forward (the aggregated entry point when autograd will differentiate it) -----------------------


def _train_step(
    d: dict,
    fused: bool,
    dtype: torch.dtype,
    *,
    needs=("hidden", "weight", "bias"),
    scale=1.7,
    chunk_size=None,
    agg="token-mean",
    step=None,
    accum_dtype=None,
):
    """(loss, metrics, {name: grad}) of ``scale * loss`` through fused_linear_dppo_loss (the default plan unless
    ``chunk_size``) or dppo_loss on ``hidden @ weight.T + bias``; ``needs``: the leaves that require grad."""
    leaves = {k: d[k].detach().to(dtype).requires_grad_(k in needs) for k in ("hidden", "weight", "bias")}
    args = (d["tokens"], d["rollout_logprobs"], d["advantages"])
    kw = dict(
        response_mask=d["response_mask"],
        topk_ids=d["topk_ids"],
        topk_logprobs=d["topk_logprobs"],
        loss_agg_mode=agg,
        temperature=0.9,
    )

    def run(hidden, weight, bias):
        if fused:
            return fused_linear_dppo_loss(
                hidden, weight, *args, bias=bias, chunk_size=chunk_size, accum_dtype=accum_dtype, **kw
            )
        return dppo_loss(hidden @ weight.t() + bias, *args, **kw)

    loss, metrics = (step or run)(leaves["hidden"], leaves["weight"], leaves["bias"])
    (scale * loss).backward()
    return loss.detach(), metrics, {k: t.grad for k, t in leaves.items() if k in needs}


@pytest.mark.parametrize("chunk_size", (None, 1, 4, 20), ids=("auto", "c1", "c4", "c20"))
@pytest.mark.parametrize("agg", dppo_ext.AGG_MODES)
def test_grads_in_forward_match_logits_path_float64(agg, chunk_size):
    """The gradients computed chunk by chunk in the forward equal the logits path's (every aggregation, chunks that
    split the 21 rows unevenly, one chunk, a loss scaled by 1.7 before backward)."""
    d = _batch(mode="topk_tv")
    d["advantages"] = d["advantages"][:, None].expand(d["tokens"].shape)
    loss_l, metrics_l, grads_l = _train_step(d, False, torch.float64, agg=agg)
    loss_f, metrics_f, grads_f = _train_step(d, True, torch.float64, agg=agg, chunk_size=chunk_size)
    torch.testing.assert_close(loss_f, loss_l, rtol=1e-12, atol=1e-14)
    for key in metrics_l:
        torch.testing.assert_close(metrics_f[key], metrics_l[key], rtol=1e-12, atol=1e-14, msg=key)
    for key in grads_l:
        torch.testing.assert_close(grads_f[key], grads_l[key], rtol=1e-10, atol=1e-13, msg=key)
        assert grads_f[key].abs().max() > 0, key


@pytest.mark.parametrize("needs", (("hidden",), ("weight",), ("weight", "bias")), ids="+".join)
def test_grads_in_forward_only_what_is_needed(needs):
    """A frozen LM head (only hidden requires grad) or frozen hidden states: the needed gradients match, the others
    stay None."""
    d = _batch(seed=6)
    _, _, grads_l = _train_step(d, False, torch.float64, needs=needs)
    _, _, grads_f = _train_step(d, True, torch.float64, needs=needs, chunk_size=5)
    assert grads_f.keys() == set(needs)
    for key in needs:
        torch.testing.assert_close(grads_f[key], grads_l[key], rtol=1e-10, atol=1e-13, msg=key)


@pytest.mark.parametrize(
    "dtype, accum_dtype, sum_block_rows",
    [
        (torch.float32, None, None),
        (torch.bfloat16, None, None),
        (torch.bfloat16, torch.float32, None),
        (torch.bfloat16, torch.float32, 7),
    ],
    ids=("f32", "bf16", "bf16-float32-sums", "bf16-float32-sums-blocks-of-7"),
)
def test_grads_in_forward_low_precision(dtype, accum_dtype, sum_block_rows, monkeypatch):
    """float32 and bfloat16 over 6 chunks (bf16: the weight gradient summed in bf16, the default, or in float32
    with each chunk's bf16 product in one block or in blocks of 7 of the 200 vocabulary rows): the error against
    the float64 logits path on the same rounded inputs is at most twice the same-precision logits path's plus the
    tolerance."""
    if sum_block_rows is not None:
        monkeypatch.setattr(dppo_ext._fused_autograd, "SUM_BLOCK_BYTES", sum_block_rows * 32 * 2)
    d = _batch(b=4, t=30, h=32, v=200, seed=3)
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in d.items()}
    loss_t, _, grads_t = _train_step(rounded, False, torch.float64)
    loss_b, _, grads_b = _train_step(d, False, dtype)
    loss_f, _, grads_f = _train_step(d, True, dtype, chunk_size=20, accum_dtype=accum_dtype)
    _close_enough("loss", loss_f, loss_t, loss_b, TOL[dtype]["fwd_rtol"])
    for key in grads_t:
        assert grads_f[key].dtype == dtype
        _close_enough(f"grad_{key}", grads_f[key], grads_t[key], grads_b[key], GRAD_TOL[dtype])


def test_grads_in_forward_accumulated_in_bfloat16():
    """The default for bf16: the chunks' products are added into the bf16 weight gradient (a result other than
    accum_dtype=torch.float32's partial sums give, one rounding per chunk), and its error against the float64 logits
    path on the same rounded inputs stays within 3x the one-product logits path's error plus a tenth of the bf16
    tolerance (6 chunks; docs/benchmarks.md measures it at scale). hidden and bias are unaffected."""
    dtype = torch.bfloat16
    d = _batch(b=4, t=30, h=32, v=200, seed=3)
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in d.items()}
    _, _, grads_t = _train_step(rounded, False, torch.float64)
    _, _, grads_b = _train_step(d, False, dtype)
    _, _, grads_32 = _train_step(d, True, dtype, chunk_size=20, accum_dtype=torch.float32)
    _, _, grads_16 = _train_step(d, True, dtype, chunk_size=20)
    assert grads_16["weight"].dtype == dtype
    assert not torch.equal(grads_16["weight"], grads_32["weight"]), "bf16 partial sums must round differently"
    torch.testing.assert_close(grads_16["hidden"], grads_32["hidden"], rtol=0, atol=0)
    torch.testing.assert_close(grads_16["bias"], grads_32["bias"], rtol=0, atol=0)
    err = (grads_16["weight"].double() - grads_t["weight"]).abs().max().item()
    base = (grads_b["weight"].double() - grads_t["weight"]).abs().max().item()
    bound = 3 * base + 0.1 * GRAD_TOL[dtype] * grads_t["weight"].abs().max().item()
    assert err <= bound, f"bf16-accumulated weight gradient error {err:.3e} > {bound:.3e} (logits path {base:.3e})"


# Upstream gradients reaching the loss: AMP GradScaler's default 2^16, a plain backward, a scale below 1, a loss
# summed with another one (whose gradient accumulates into the same leaves) and that sum under 2^16.
UPSTREAM_SCALES = {"amp_2^16": 2.0**16, "one": 1.0, "1e-4": 1e-4, "summed": "summed", "summed_2^16": "summed_2^16"}
# Row-wise gradient tolerances (relative to each row's norm) for the loss-scaling tests, per dtype.
ROW_GRAD_TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def _scaled_batch(dtype: torch.dtype) -> dict:
    """N=384 rows over V=1536 with advantages spread over three decades: with token-mean's 1/N, the logits gradient
    of a row with a small advantage is ~1e-9 at an upstream gradient of 1 (below float16's smallest subnormal,
    6e-8) and ~1e-4 under AMP's 2^16 (a normal float16)."""
    g = torch.Generator().manual_seed(11)
    n, v, h = 384, 1536, 32
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    bias = 0.3 * torch.randn(v, generator=g, dtype=torch.float64)
    logits = hidden.to(dtype).double() @ weight.to(dtype).double().t() + bias.to(dtype).double()
    logp = torch.log_softmax(logits, -1)
    tokens = torch.multinomial(logp.exp(), 1, generator=g).squeeze(1)
    rollout = logp.gather(1, tokens[:, None]).squeeze(1) + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)
    advantages = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** -torch.randint(0, 4, (n,), generator=g)
    tokens[-3:] = -100
    return dict(
        hidden=hidden,
        weight=weight,
        bias=bias,
        tokens=tokens,
        rollout_logprobs=rollout.float(),
        advantages=advantages.float(),
    )


def _scaled_step(d: dict, dtype: torch.dtype, fused: bool, upstream) -> dict:
    """{name: grad} of ``upstream * loss`` (``"summed"``: ``loss + aux``, aux a second loss on hidden and weight;
    ``"summed_2^16"``: ``2^16 * (loss + aux)``) through fused_linear_dppo_loss or the logits path, in ``dtype``."""
    leaves = {k: d[k].detach().to(dtype).requires_grad_(True) for k in ("hidden", "weight", "bias")}
    args = (d["tokens"], d["rollout_logprobs"], d["advantages"])
    if fused:
        loss, _ = fused_linear_dppo_loss(leaves["hidden"], leaves["weight"], *args, bias=leaves["bias"])
    else:
        loss, _ = dppo_loss(leaves["hidden"] @ leaves["weight"].t() + leaves["bias"], *args)
    if isinstance(upstream, str):
        aux = 1e-3 * (leaves["hidden"].float() ** 2).mean() + 1e-3 * leaves["weight"].float().abs().mean()
        total = (loss + aux) * (2.0**16 if upstream == "summed_2^16" else 1.0)
    else:
        total = upstream * loss
    total.backward()
    return {k: t.grad for k, t in leaves.items()}


def _unscaled(upstream) -> float:
    return 2.0**16 if upstream == "summed_2^16" else 1.0 if isinstance(upstream, str) else upstream


def _rowwise_close(name: str, got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, tol: float) -> None:
    """Each row (each hidden state, each vocabulary row of the head; the bias as one row): ``|got - want| <=
    2 |base - want| + tol |want|`` (norms over the row), so a row whose gradient underflows cannot hide behind the
    large rows."""
    got, want, base = (
        t.double().reshape(t.shape[0], -1) if t.dim() > 1 else t.double()[None] for t in (got, want, base)
    )
    assert torch.isfinite(got).all(), f"{name}: non-finite"
    err = (got - want).norm(dim=1)
    bound = 2 * (base - want).norm(dim=1) + tol * want.norm(dim=1) + 1e-30
    bad = err > bound
    zero_rows = [int((t.abs().sum(1) == 0).sum()) for t in (got, base)]
    assert not bad.any(), (
        f"{name}: {int(bad.sum())} of {bad.numel()} rows beyond the logits path's error, e.g. row "
        f"{int(bad.nonzero()[0])}: error {err[bad][0]:.3e} > bound {bound[bad][0]:.3e} "
        f"(rows all zero: fused {zero_rows[0]}, logits path {zero_rows[1]})"
    )


@pytest.mark.parametrize("upstream", list(UPSTREAM_SCALES.values()), ids=list(UPSTREAM_SCALES))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=_id)
def test_training_step_under_any_upstream_scale(dtype, upstream):
    """AMP's GradScaler backpropagates 2^16 * loss: the fused training step's gradients equal the logits path's row by
    row (vs float64 on the same rounded inputs: at most twice the same-dtype logits path's error plus the dtype's
    tolerance), whatever the upstream gradient, in float16 (whose range is where the scale matters), bfloat16 and
    float32. A design that computed float16 gradients in the forward at an upstream gradient of 1 and scaled them
    afterwards would flush the small logits gradients (token-mean's 1/N times a small advantage) to 0 first."""
    d = _scaled_batch(dtype)
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in d.items()}
    want = _scaled_step(rounded, torch.float64, False, upstream)
    base = _scaled_step(d, dtype, False, upstream)
    got = _scaled_step(d, dtype, True, upstream)
    scale = _unscaled(upstream)
    for key in want:
        assert got[key].dtype == dtype
        _rowwise_close(
            f"grad_{key}", got[key].double() / scale, want[key] / scale, base[key].double() / scale, ROW_GRAD_TOL[dtype]
        )


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=_id)
def test_training_step_upstream_zero_and_nonfinite(dtype):
    """``0 * loss`` gives exactly zero gradients, as the logits path; an inf or NaN upstream gradient gives
    non-finite gradients (never finite numbers a trainer would step with) in every leaf, as the logits path."""
    d = _scaled_batch(dtype)
    for fused in (False, True):
        zero = _scaled_step(d, dtype, fused, 0.0)
        for key, grad in zero.items():
            assert torch.equal(grad, torch.zeros_like(grad)), (fused, key)
        for upstream in (math.inf, math.nan):
            grads = _scaled_step(d, dtype, fused, upstream)
            for key, grad in grads.items():
                assert not torch.isfinite(grad).all(), f"fused={fused} {key}: finite gradient from upstream {upstream}"


class _Allocations(TorchDispatchMode):
    """Records (dtype, numel) of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("accum_dtype", (None, torch.float32), ids=("default", "float32"))
def test_accum_dtype_decides_the_float32_weight_accumulator(accum_dtype):
    """bfloat16 inputs: by default no tensor of V*H float32 elements exists at all; accum_dtype=torch.float32 sums
    the weight gradient in a [V, H] float32 tensor."""
    d = _batch(b=4, t=30, h=32, v=200, seed=3)
    v, h = d["weight"].shape
    with _Allocations() as seen:
        _train_step(d, True, torch.bfloat16, chunk_size=20, accum_dtype=accum_dtype)
    big_fp32 = [n for dt, n in seen.outputs if dt == torch.float32 and n >= v * h]
    big_bf16 = [n for dt, n in seen.outputs if dt == torch.bfloat16 and n >= v * h]
    assert big_bf16, "the dispatch mode must see the bf16 weight gradient"
    assert (len(big_fp32) > 0) == (accum_dtype is torch.float32), big_fp32


@pytest.mark.parametrize(
    "dtype, accum_dtype, error",
    [
        (
            torch.bfloat16,
            torch.float16,
            "accum_dtype must be None, torch.float32 or torch.bfloat16 (hidden's dtype) "
            "for torch.bfloat16 hidden, got torch.float16",
        ),
        (
            torch.float32,
            torch.bfloat16,
            "accum_dtype must be None or torch.float32 for torch.float32 hidden, got torch.bfloat16",
        ),
        (torch.float32, "bf16", "accum_dtype must be None or a floating-point torch.dtype, got 'bf16'"),
        (torch.float32, torch.int32, "accum_dtype must be None or a floating-point torch.dtype, got torch.int32"),
    ],
)
def test_accum_dtype_refused(dtype, accum_dtype, error):
    """An accum_dtype that is neither the float32 accumulation dtype nor hidden's own is an error naming both."""
    d = _batch(seed=8)
    with pytest.raises(TypeError, match=re.escape(error)):
        _train_step(d, True, dtype, accum_dtype=accum_dtype)
    with pytest.raises(TypeError, match="accum_dtype must be None or a floating-point torch.dtype"):
        FusedLinearDPPOLoss(accum_dtype="float32")


class _Products(TorchDispatchMode):
    """Counts the multiply-adds of every matrix product (a loss step has no product but the LM head's)."""

    def __init__(self) -> None:
        super().__init__()
        self.madds = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            a, b = args[-2:] if func._overloadpacket is torch.ops.aten.mm else args[1:3]
            self.madds += a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunk_size", (None, 4), ids=("auto", "c4"))
def test_training_step_computes_three_lm_head_products(chunk_size):
    """A training step (forward + backward) spends 3 N*V*H multiply-adds on the LM head, as the logits path does
    (logits, grad_hidden, grad_weight), not 4 (a backward that recomputes the logits); a no-grad forward spends 1."""
    d = _batch()
    n, h, v = d["tokens"].numel(), d["hidden"].shape[-1], d["weight"].shape[0]
    with _Products() as logits_count:
        _train_step(d, False, torch.float64)
    with _Products() as fused_count:
        _train_step(d, True, torch.float64, chunk_size=chunk_size)
    assert logits_count.madds == 3 * n * v * h, "the counter must see the logits path's three products"
    assert fused_count.madds == 3 * n * v * h
    with torch.no_grad(), _Products() as no_grad_count:
        fused_linear_dppo_loss(d["hidden"], d["weight"], d["tokens"], d["rollout_logprobs"], d["advantages"])
    assert no_grad_count.madds == n * v * h
    # float16 keeps the recompute path (its gradients depend on the upstream scale: test_training_step_under_any_...)
    with _Products() as fp16_count:
        _train_step(d, True, torch.float16, chunk_size=chunk_size)
    assert fp16_count.madds == 4 * n * v * h


def test_grads_in_forward_second_backward():
    """backward(retain_graph=True) twice: the second backward (the forward's gradients were handed over to the
    first) recomputes them, with the second upstream gradient."""
    d = _batch(seed=5)
    leaves = [d[k].clone().requires_grad_(True) for k in ("hidden", "weight", "bias")]
    loss, _ = fused_linear_dppo_loss(
        leaves[0], leaves[1], d["tokens"], d["rollout_logprobs"], d["advantages"], bias=leaves[2], chunk_size=4
    )
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    second = torch.autograd.grad(3.0 * loss, leaves)
    for a, b in zip(first, second):
        torch.testing.assert_close(b, 3.0 * a, rtol=1e-10, atol=1e-13)


def test_no_grad_forward_and_per_row_api_keep_the_recompute_path():
    """Without grad the fused loss is the same value; the per-row API (arbitrary upstream gradients) and an
    explicit vocab_chunk_size keep recomputing the logits in the backward (4 products)."""
    d = _batch(seed=7)
    n, h, v = d["tokens"].numel(), d["hidden"].shape[-1], d["weight"].shape[0]
    loss_grad, _, _ = _train_step(d, True, torch.float64)
    with torch.no_grad():
        loss_nograd, _ = fused_linear_dppo_loss(
            d["hidden"],
            d["weight"],
            d["tokens"],
            d["rollout_logprobs"],
            d["advantages"],
            bias=d["bias"],
            response_mask=d["response_mask"],
            temperature=0.9,
        )
    torch.testing.assert_close(loss_nograd, loss_grad, rtol=0, atol=0)

    def blocked(hidden, weight, bias):
        return fused_linear_dppo_loss(
            hidden,
            weight,
            d["tokens"],
            d["rollout_logprobs"],
            d["advantages"],
            bias=bias,
            response_mask=d["response_mask"],
            temperature=0.9,
            vocab_chunk_size=9,
        )

    with _Products() as count:
        _, _, grads_b = _train_step(d, True, torch.float64, step=blocked)
    assert count.madds == 4 * n * v * h
    _, _, grads_l = _train_step(d, False, torch.float64)
    for key in grads_l:
        torch.testing.assert_close(grads_b[key], grads_l[key], rtol=1e-10, atol=1e-13, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, accum_dtype",
    [(torch.float64, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)],
    ids=("f64", "bf16", "bf16-float32-sums"),
)
def test_torch_compile_fullgraph_training_step(dtype, accum_dtype):
    """torch.compile(fullgraph=True) of a training step through fused_linear_dppo_loss: the same loss, metrics and
    gradients as eager (in bfloat16 with either accumulation, to bf16 rounding)."""
    d = _batch(seed=9)

    def step(hidden, weight, bias):
        return fused_linear_dppo_loss(
            hidden,
            weight,
            d["tokens"],
            d["rollout_logprobs"],
            d["advantages"],
            bias=bias,
            response_mask=d["response_mask"],
            temperature=0.9,
            chunk_size=4,
            accum_dtype=accum_dtype,
        )

    torch._dynamo.reset()
    loss_c, metrics_c, grads_c = _train_step(d, True, dtype, step=torch.compile(step, fullgraph=True))
    loss_e, metrics_e, grads_e = _train_step(d, True, dtype, step=step)
    if dtype == torch.float64:
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-12, atol=1e-14)
        for key in metrics_e:
            torch.testing.assert_close(metrics_c[key], metrics_e[key], rtol=1e-12, atol=1e-14, msg=key)
        for key in grads_e:
            torch.testing.assert_close(grads_c[key], grads_e[key], rtol=1e-10, atol=1e-13, msg=key)
        return
    # bf16: inductor may round the logits' matmul and bias add once instead of twice, so the compiled step is held
    # to the eager step's own distance from the float64 result on the same rounded inputs
    rounded = {k: (v.to(dtype).double() if k in ("hidden", "weight", "bias") else v) for k, v in d.items()}
    loss_t, _, grads_t = _train_step(rounded, False, torch.float64, agg="token-mean")
    _close_enough("loss", loss_c, loss_t, loss_e, TOL[dtype]["fwd_rtol"])
    for key in grads_e:
        assert grads_c[key].dtype == dtype
        _close_enough(f"grad_{key}", grads_c[key], grads_t[key], grads_e[key], GRAD_TOL[dtype])


_VOCAB_PARALLEL_RANK = """
import os, sys
import torch
import torch.distributed as dist
from dppo_ext import fused_linear_dppo_loss

store, rank, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
d = torch.load(sys.argv[4])
bounds = (0, 23, 61)  # uneven slices of the LM head's rows
lo, hi = bounds[rank], bounds[rank + 1]
hidden = d["hidden"].clone().requires_grad_(True)
weight = d["weight"][lo:hi].clone().requires_grad_(True)
bias = d["bias"][lo:hi].clone().requires_grad_(True)
loss, metrics = fused_linear_dppo_loss(hidden, weight, d["tokens"], d["rollout_logprobs"], d["advantages"], bias=bias,
                                       response_mask=d["response_mask"], temperature=0.9,
                                       vocab_parallel_group=dist.group.WORLD, vocab_offsets=list(bounds))
(1.7 * loss).backward()
torch.save({"loss": loss.detach(), "metrics": metrics, "hidden": hidden.grad, "weight": weight.grad, "bias": bias.grad},
           out)
sys.stdout.flush()
os._exit(0)  # no gloo teardown (docs/distributed.md)
"""


@pytest.mark.slow
def test_vocab_parallel_fused_matches_single_device(tmp_path):
    """The vocabulary-parallel fused path (two gloo ranks, uneven slices of the LM head) gives the loss, the metrics
    and the gradients of the single-device path that computes them in the forward."""
    d = _batch(seed=11)
    torch.save(d, tmp_path / "inputs.pt")
    loss_s, metrics_s, grads_s = _train_step(d, True, torch.float64)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _VOCAB_PARALLEL_RANK,
                str(tmp_path / "store"),
                str(rank),
                str(tmp_path / f"rank{rank}.pt"),
                str(tmp_path / "inputs.pt"),
            ],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for r in ranks:
        torch.testing.assert_close(r["loss"], loss_s, rtol=1e-12, atol=1e-14)
        for key in metrics_s:
            torch.testing.assert_close(r["metrics"][key], metrics_s[key], rtol=1e-12, atol=1e-14, msg=key)
        torch.testing.assert_close(r["hidden"], grads_s["hidden"], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(torch.cat([r["weight"] for r in ranks]), grads_s["weight"], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(torch.cat([r["bias"] for r in ranks]), grads_s["bias"], rtol=1e-10, atol=1e-13)

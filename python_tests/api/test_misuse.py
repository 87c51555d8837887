"""Misuse and non-finite input: every way to hold the API wrong gives a correct result or a clear error.

Covers, for every entry point that offers it (``dppo_ext.dppo_loss_per_row``, ``dppo_loss``, ``DPPOLoss``, the
fused-linear functions):
- non-finite logits (NaN / +inf entries or rows, all -inf rows, a temperature so small that z / T overflows, a NaN
  row of the LM-head weight): the row's outputs are NaN, so the loss and the metrics are NaN like the gradient
  (docs/contract.md), against the reference; ordinary -inf entries stay finite;
- ``inplace_backward``: autograd's saved-tensor check fires, leaves and saved-output producers are refused, a
  second backward is refused, and a valid use still gives the exact gradient;
- double backward and ``torch.func`` transforms: "not supported" errors (first-order gradients under
  ``create_graph=True`` stay exact);
- fractional float token ids, per-mode default thresholds (one table, the same in docs/contract.md), ``DPPOLoss``
  settings checked at construction, ``[B, 1]`` advantages, ``aggregate_loss`` mask shapes, the ratio metric of a
  token impossible under both policies.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from dppo_testing import DEVICES, DTYPES, sample_inputs

from dppo_ext import (
    DEFAULT_DELTAS,
    DPPOLoss,
    FusedLinearDPPOLoss,
    aggregate_loss,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
)
from dppo_ext.contract import MODES, accumulation_dtype
from dppo_ext.reference import OUTPUT_KEYS, dppo_loss_full_reference, dppo_loss_reference

REPO = Path(__file__).resolve().parents[2]
BAD_ROW = 5  # a valid row of sample_inputs' "v129" case (edge rows are 0-4, padding the last two)


def _dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _grad_of(fn, kw: dict, upstream: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    logits = kw["logits"].detach().clone().requires_grad_(True)
    out = fn(**dict(kw, logits=logits))
    out = out if isinstance(out, dict) else out._asdict()
    sum((out[key] * upstream[key]).sum() for key in ("loss", "logp", "entropy")).backward()
    return {key: value.detach() for key, value in out.items()}, logits.grad


# ---- non-finite logits ------------------------------------------------------------------------


def _poison(logits: torch.Tensor, token: int, kind: str) -> torch.Tensor:
    """Row BAD_ROW of ``logits`` made non-finite in one of the ways the contract names."""
    z = logits.clone()
    v = z.shape[1]
    other = (token + 1) % v
    if kind == "nan_target":
        z[BAD_ROW, token] = math.nan
    elif kind == "nan_entry":  # SIMD body
        z[BAD_ROW, other] = math.nan
    elif kind == "nan_tail":  # the scalar tail of a row (v = 129)
        z[BAD_ROW, v - 1 if token != v - 1 else v - 2] = math.nan
    elif kind == "nan_block":  # 16 consecutive NaN (a whole 16-byte vector on CUDA), target excluded
        start = 32 if not 32 <= token < 48 else 64
        z[BAD_ROW, start : start + 16] = math.nan
    elif kind == "posinf_entry":
        z[BAD_ROW, other] = math.inf
    elif kind == "posinf_target":
        z[BAD_ROW, token] = math.inf
    elif kind == "nan_row":
        z[BAD_ROW] = math.nan
    elif kind == "neginf_row":
        z[BAD_ROW] = -math.inf
    else:
        raise ValueError(kind)
    return z


NONFINITE_KINDS = (
    "nan_target",
    "nan_entry",
    "nan_tail",
    "nan_block",
    "posinf_entry",
    "posinf_target",
    "nan_row",
    "neginf_row",
)


def _upstream(n: int, acc: torch.dtype, device) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return {
        key: torch.randn(n, generator=gen, dtype=torch.float64).to(device=device, dtype=acc)
        for key in ("loss", "logp", "entropy")
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_nonfinite_logits_make_the_row_nan(device, mode, dtype, kind):
    """One non-finite row: all its outputs and its gradient row are NaN (the reference agrees); every other row
    is bit-for-bit what it is without the bad row."""
    clean = sample_inputs(device, dtype, mode, "v129", seed=20)
    assert clean["tokens"][BAD_ROW] != -100
    bad = dict(clean, logits=_poison(clean["logits"], int(clean["tokens"][BAD_ROW]), kind))
    g = _upstream(clean["tokens"].shape[0], accumulation_dtype(dtype), device)
    out_clean, grad_clean = _grad_of(dppo_loss_per_row, clean, g)
    out_bad, grad_bad = _grad_of(dppo_loss_per_row, bad, g)
    with torch.no_grad():
        ref = dppo_loss_reference(**bad)
    keep = torch.ones_like(clean["tokens"], dtype=torch.bool)
    keep[BAD_ROW] = False
    for key in OUTPUT_KEYS:
        assert torch.isnan(out_bad[key][BAD_ROW]), f"{key} of the non-finite row: {out_bad[key][BAD_ROW].item()}"
        assert torch.isnan(ref[key][BAD_ROW]), f"reference {key} of the non-finite row"
        torch.testing.assert_close(out_bad[key][keep], out_clean[key][keep], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(out_bad["loss"].sum()), "the summed loss must show the non-finite row"
    assert torch.isnan(grad_bad[BAD_ROW]).all(), "the non-finite row's gradient is NaN in every column"
    torch.testing.assert_close(grad_bad[keep], grad_clean[keep], rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_temperature_overflow_makes_the_loss_nan(device, mode, dtype):
    """A temperature so small that z / T overflows: no row has a distribution, the loss is NaN (not 0)."""
    kw = dict(sample_inputs(device, dtype, mode, "v129", seed=21), temperature=5e-324)
    valid = kw["tokens"] != -100
    out = dppo_loss_per_row(**kw)
    ref = dppo_loss_reference(**kw)
    for key in OUTPUT_KEYS:
        assert torch.isnan(out[OUTPUT_KEYS.index(key)][valid]).all(), key
        assert torch.isnan(ref[key][valid]).all(), key
    loss, metrics = dppo_loss(**{k: v for k, v in kw.items()})
    assert torch.isnan(loss)
    assert torch.isnan(metrics["entropy_mean"]) and torch.isnan(metrics["masked_frac"])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=_dtype_id)
def test_one_row_overflowing_under_the_temperature(dtype):
    """z / T overflows in one row only (a huge but finite logit): that row is NaN, the others are unchanged."""
    clean = dict(sample_inputs("cpu", dtype, "binary_tv", "v129", seed=22), temperature=1e-3)
    z = clean["logits"].clone()
    z[BAD_ROW, 3] = 1e307 if dtype == torch.float64 else 1e37
    assert torch.isfinite(z).all()
    out_bad = dppo_loss_per_row(**dict(clean, logits=z))
    out_clean = dppo_loss_per_row(**clean)
    assert torch.isnan(out_bad.loss[BAD_ROW]) and torch.isnan(out_bad.lse[BAD_ROW])
    keep = torch.arange(z.shape[0]) != BAD_ROW
    torch.testing.assert_close(out_bad.loss[keep], out_clean.loss[keep], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("mode", MODES)
def test_neginf_entries_are_ordinary(mode, dtype):
    """-inf entries in an otherwise finite row are probability 0, not an error: outputs finite (logp -inf where
    the token itself is -inf), the weight of a token impossible under both policies is 0, as the reference says."""
    kw = sample_inputs("cpu", dtype, mode, "v129", seed=23)
    z = kw["logits"].clone()
    tokens = kw["tokens"]
    z[5, 40:60] = -math.inf  # a banned range (tokens chosen outside it below)
    z[6, int(tokens[6])] = -math.inf  # the token itself impossible for the trainer, possible for the rollout
    z[7, int(tokens[7])] = -math.inf  # ... and for the rollout too
    rollout = kw["rollout_logprobs"].clone()
    rollout[7] = -math.inf
    kw = dict(kw, logits=z, rollout_logprobs=rollout)
    if 40 <= int(tokens[5]) < 60:
        kw["tokens"] = tokens.clone()
        kw["tokens"][5] = 0
    g = _upstream(tokens.shape[0], accumulation_dtype(dtype), "cpu")
    out, grad = _grad_of(dppo_loss_per_row, kw, g)
    with torch.no_grad():
        ref = dppo_loss_reference(**kw)
    for key in OUTPUT_KEYS:
        assert not torch.isnan(out[key]).any(), key
    assert out["logp"][6] == -math.inf and out["logp"][7] == -math.inf
    assert out["weight"][6] == 0 and out["weight"][7] == 0
    assert out["loss"][6] == 0 and out["loss"][7] == 0
    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for key in ("logp", "entropy", "lse", "weight"):  # no mask decision involved
        torch.testing.assert_close(out[key][5:8], ref[key][5:8], **tol, msg=key)
    assert torch.isfinite(grad).all()


def test_dppo_loss_and_metrics_show_a_nan_row_unless_it_is_padding():
    kw = sample_inputs("cpu", torch.float32, "binary_kl", "v129", seed=24)
    n = kw["tokens"].shape[0]
    z = _poison(kw["logits"], int(kw["tokens"][BAD_ROW]), "nan_entry")
    mask = kw["tokens"] != -100
    loss, metrics = dppo_loss(**dict(kw, logits=z), response_mask=mask)
    assert torch.isnan(loss)
    for key in ("masked_frac", "mismatch_mean", "mismatch_max", "divergence_mean", "entropy_mean", "ratio_max"):
        assert torch.isnan(metrics[key]), f"metric {key} hides the NaN row: {metrics[key].item()}"
    assert metrics["num_tokens"].item() == int(mask.sum())
    ref_loss, ref_metrics = dppo_loss_full_reference(**dict(kw, logits=z), response_mask=mask)
    assert torch.isnan(ref_loss) and torch.isnan(ref_metrics["entropy_mean"])
    # The same row as padding: ignored, like cross_entropy's ignore_index.
    pad = mask.clone()
    pad[BAD_ROW] = False
    leaf = z.clone().requires_grad_(True)
    loss_pad, metrics_pad = dppo_loss(**dict(kw, logits=leaf), response_mask=pad)
    loss_pad.backward()
    clean_loss, _ = dppo_loss(**kw, response_mask=pad)
    assert torch.isfinite(loss_pad) and all(torch.isfinite(v) for v in metrics_pad.values())
    torch.testing.assert_close(loss_pad, clean_loss, rtol=0, atol=0)
    assert (leaf.grad[BAD_ROW] == 0).all() and torch.isfinite(leaf.grad).all()
    assert n > BAD_ROW


def _fused_inputs(n: int = 9, v: int = 37, h: int = 8, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = 0.5 * torch.randn(v, h, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, v, (n,), generator=gen)
    logp = torch.log_softmax(hidden @ weight.t() + 0.3 * torch.randn(n, v, generator=gen, dtype=torch.float64), -1)
    return {
        "hidden": hidden,
        "weight": weight,
        "tokens": tokens,
        "rollout_logprobs": logp.gather(1, tokens[:, None]).squeeze(1),
        "advantages": torch.randn(n, generator=gen, dtype=torch.float64),
    }


@pytest.mark.parametrize("vocab_chunk_size", (None, 8), ids=("one_block", "vocab_blocks"))
def test_fused_linear_nan_weight_row_makes_the_loss_nan(vocab_chunk_size):
    kw = _fused_inputs()
    weight = kw["weight"].clone()
    weight[11] = math.nan  # one LM-head row: every logits row gets a NaN column
    weight.requires_grad_(True)
    hidden = kw["hidden"].clone().requires_grad_(True)
    loss, metrics = fused_linear_dppo_loss(**dict(kw, hidden=hidden, weight=weight), vocab_chunk_size=vocab_chunk_size)
    assert torch.isnan(loss)
    assert torch.isnan(metrics["entropy_mean"]) and torch.isnan(metrics["masked_frac"])
    loss.backward()
    assert not torch.isfinite(weight.grad).all() and not torch.isfinite(hidden.grad).all()
    # A NaN in one hidden state: only that row.
    hidden = kw["hidden"].clone()
    hidden[2, 0] = math.nan
    out = fused_linear_dppo_loss_per_row(**dict(kw, hidden=hidden))
    clean = fused_linear_dppo_loss_per_row(**kw)
    keep = torch.arange(hidden.shape[0]) != 2
    for key in OUTPUT_KEYS:
        value = getattr(out, key)
        assert torch.isnan(value[2]), key
        torch.testing.assert_close(value[keep], getattr(clean, key)[keep], rtol=0, atol=0)


# ---- inplace_backward -------------------------------------------------------------------------


def _op_entry(logits, kw, **extra):
    return dppo_loss_per_row(**dict(kw, logits=logits), **extra).loss.sum()


def _api_entry(logits, kw, **extra):
    return dppo_loss(**dict(kw, logits=logits), **extra)[0]


def _module_entry(logits, kw, inplace_backward=False):
    settings = {k: kw[k] for k in ("mode", "temperature", "delta_low", "delta_high", "ratio_cap")}
    crit = DPPOLoss(**settings, inplace_backward=inplace_backward)
    tensors = {k: kw[k] for k in ("tokens", "rollout_logprobs", "advantages")}
    return crit(logits, **tensors, topk_ids=kw["topk_ids"], topk_logprobs=kw["topk_logprobs"])[0]


ENTRIES = {"dppo_loss_per_row": _op_entry, "dppo_loss": _api_entry, "DPPOLoss": _module_entry}


def _inplace_inputs() -> dict:
    kw = sample_inputs("cpu", torch.float32, "binary_tv", "v129", seed=30)
    kw.pop("anchor_logprobs")
    return kw


@pytest.mark.parametrize("producer", ("exp", "softmax", "sigmoid"))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_refuses_logits_their_producer_saved(entry, producer):
    kw = _inplace_inputs()
    x = kw["logits"].detach().clone().requires_grad_(True)
    logits = {"exp": lambda t: t.exp(), "softmax": lambda t: t.softmax(-1), "sigmoid": torch.sigmoid}[producer](x)
    with pytest.raises(ValueError, match=r"inplace_backward=True cannot be used on logits produced by \w+Backward"):
        ENTRIES[entry](logits, kw, inplace_backward=True)
    # The same without inplace_backward: the correct gradient.
    ENTRIES[entry](logits, kw).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_trips_autograd_when_another_node_saved_the_logits(entry):
    """A later consumer saved the logits (here mul by a parameter, and exp through a view): its backward runs
    after the in-place one and autograd's saved-tensor check fires, instead of a wrong gradient."""
    kw = _inplace_inputs()
    x = kw["logits"].detach().clone().requires_grad_(True)
    scale = torch.tensor(2.0, requires_grad=True)
    logits = x * 1.5  # MulBackward with a Python number saves nothing
    extra = (logits * scale).sum()  # saves logits (for scale's gradient)
    loss = ENTRIES[entry](logits, kw, inplace_backward=True)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        (loss + extra).backward()

    base = kw["logits"].detach().clone().requires_grad_(True)
    wide = base.exp()  # ExpBackward saved its output; the logits are a view of it
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        ENTRIES[entry](wide[:, :], kw, inplace_backward=True).backward()


@pytest.mark.parametrize("view", (False, True), ids=("leaf", "view_of_leaf"))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_refuses_leaf_logits(entry, view):
    kw = _inplace_inputs()
    leaf = kw["logits"].detach().clone().requires_grad_(True)
    before = leaf.detach().clone()
    logits = leaf[:, :] if view else leaf
    with pytest.raises(ValueError, match=r"inplace_backward=True would overwrite logits, a leaf tensor"):
        ENTRIES[entry](logits, kw, inplace_backward=True)
    assert torch.equal(leaf.detach(), before)


@pytest.mark.parametrize("base", ("leaf", "non_leaf"))
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_refuses_overlapping_logits(entry, base):
    """Logits whose elements share memory (an expand()ed row: stride 0) cannot hold one gradient per element: the
    error says so (shape, strides, stride 0) and what to pass instead, whether the view's base is a leaf or not,
    and nothing is written."""
    kw = _inplace_inputs()
    n, v = kw["logits"].shape
    row = kw["logits"][:1].detach().clone().requires_grad_(True)
    before = row.detach().clone()

    def expanded():
        return (row if base == "leaf" else row * 1.0).expand(n, v)

    with pytest.raises(
        ValueError,
        match=rf"inplace_backward=True would write the gradient over logits, whose elements "
        rf"share memory \(shape \({n}, {v}\), strides \(0, 1\): a stride-0 "
        rf"dimension .*Pass logits.contiguous\(\)",
    ):
        ENTRIES[entry](expanded(), kw, inplace_backward=True)
    assert torch.equal(row.detach(), before)
    # the remedy the message names gives the gradient of the same expanded logits
    ENTRIES[entry](expanded().contiguous(), kw).backward()
    want, row.grad = row.grad.clone(), None
    ENTRIES[entry](expanded().contiguous(), kw, inplace_backward=True).backward()
    torch.testing.assert_close(row.grad, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "entry", ("dppo_loss", "DPPOLoss", "aggregate_loss", "fused_linear_dppo_loss", "FusedLinearDPPOLoss")
)
def test_loss_agg_mode_none_is_refused_everywhere(entry):
    """``loss_agg_mode=None`` is not a way to ask for the default: every aggregating entry point refuses it with
    the same message (it used to mean token-mean in dppo_loss and fused_linear_dppo_loss only)."""
    kw = _inplace_inputs()
    rows = {k: kw[k] for k in ("tokens", "rollout_logprobs", "advantages")}
    hidden = torch.randn(kw["logits"].shape[0], 8, requires_grad=True)
    weight = torch.randn(kw["logits"].shape[1], 8)
    calls = {
        "dppo_loss": lambda: dppo_loss(kw["logits"], **rows, loss_agg_mode=None),
        "DPPOLoss": lambda: DPPOLoss(loss_agg_mode=None),
        "aggregate_loss": lambda: aggregate_loss(kw["logits"][:, 0], torch.ones(kw["logits"].shape[0]), None),
        "fused_linear_dppo_loss": lambda: fused_linear_dppo_loss(hidden, weight, **rows, loss_agg_mode=None),
        "FusedLinearDPPOLoss": lambda: FusedLinearDPPOLoss(loss_agg_mode=None),
    }
    with pytest.raises(ValueError, match=r"loss_agg_mode must be one of \(.*'token-mean'.*\), got None"):
        calls[entry]()


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_refuses_a_second_backward(entry):
    kw = _inplace_inputs()
    x = kw["logits"].detach().clone().requires_grad_(True)
    loss = ENTRIES[entry](x.clone(), kw, inplace_backward=True)
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match=r"inplace_backward=True: the backward of this loss already ran"):
        loss.backward()
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)
    # Without inplace_backward two backward passes accumulate the same gradient twice.
    y = kw["logits"].detach().clone().requires_grad_(True)
    loss = ENTRIES[entry](y.clone(), kw)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(y.grad, 2 * first)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_inplace_backward_valid_use_is_exact_and_bumps_the_version(entry):
    kw = _inplace_inputs()
    x = kw["logits"].detach().clone().requires_grad_(True)
    ENTRIES[entry](x.clone(), kw).backward()
    want = x.grad.clone()
    x.grad = None
    logits = x.clone()
    version = logits._version
    ENTRIES[entry](logits, kw, inplace_backward=True).backward()
    assert logits._version > version, "autograd must be told that the logits were overwritten"
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)


# ---- double backward, torch.func ----------------------------------------------------------------


def test_double_backward_is_a_clear_error_and_first_order_stays_exact():
    kw = sample_inputs("cpu", torch.float64, "binary_kl", "v129", seed=31)
    logits = kw["logits"].detach().clone().requires_grad_(True)
    out = dppo_loss_per_row(**dict(kw, logits=logits))
    (g,) = torch.autograd.grad(out.loss.sum() + out.entropy.sum(), logits, create_graph=True)
    (want,) = torch.autograd.grad(
        (lambda o: o.loss.sum() + o.entropy.sum())(dppo_loss_per_row(**dict(kw, logits=logits))), logits
    )
    torch.testing.assert_close(g.detach(), want, rtol=0, atol=0)
    with pytest.raises(
        RuntimeError, match=r"DPPO loss op \(torch.ops.dppo.dppo_loss_forward\) does not support double backward"
    ):
        torch.autograd.grad(g.pow(2).sum(), logits)
    loss, _ = dppo_loss(**dict(kw, logits=logits))
    (g,) = torch.autograd.grad(loss, logits, create_graph=True)
    with pytest.raises(RuntimeError, match=r"does not support double backward"):
        g.pow(2).sum().backward()


def test_double_backward_inplace_and_fused_linear():
    kw = _inplace_inputs()
    x = kw["logits"].detach().clone().requires_grad_(True)
    loss = dppo_loss_per_row(**dict(kw, logits=x * 1.0), inplace_backward=True).loss.sum()
    with pytest.raises(RuntimeError, match=r"DPPO loss with inplace_backward=True does not support double"):
        torch.autograd.grad(loss, x, create_graph=True)
    fk = _fused_inputs()
    hidden = fk["hidden"].clone().requires_grad_(True)
    loss = fused_linear_dppo_loss_per_row(**dict(fk, hidden=hidden)).loss.sum()
    with pytest.raises(RuntimeError, match=r"fused_linear_dppo_loss does not support double backward"):
        torch.autograd.grad(loss, hidden, create_graph=True)


def test_torch_func_transforms_are_refused_plainly():
    kw = sample_inputs("cpu", torch.float64, "binary_tv", "v129", seed=32)
    z = kw["logits"].detach()
    rest = {k: v for k, v in kw.items() if k != "logits"}
    with pytest.raises(RuntimeError, match=r"dppo_loss_per_row does not support torch.func transforms"):
        torch.func.grad(lambda t: dppo_loss_per_row(t, **rest).loss.sum())(z)
    with pytest.raises(RuntimeError, match=r"does not support torch.func transforms"):
        torch.func.grad(lambda t: dppo_loss(t, **rest)[0])(z)
    with pytest.raises(RuntimeError, match=r"does not support torch.func transforms"):
        torch.vmap(
            lambda t: (
                dppo_loss_per_row(t, **{k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in rest.items()}).loss
            )
        )(z[:, None])
    fk = _fused_inputs()
    with pytest.raises(RuntimeError, match=r"fused_linear_dppo_loss does not support torch.func transforms"):
        torch.func.grad(lambda w: fused_linear_dppo_loss_per_row(**dict(fk, weight=w)).loss.sum())(fk["weight"])
    with pytest.raises(RuntimeError, match=r"fused_linear_dppo_loss does not support torch.func transforms"):
        torch.func.grad(lambda h: fused_linear_dppo_loss(**dict(fk, hidden=h))[0])(fk["hidden"])


# ---- token ids, defaults, settings, advantages --------------------------------------------------


def test_fractional_float_tokens_are_refused():
    kw = sample_inputs("cpu", torch.float32, "topk_tv", "v129", seed=33)
    tokens = kw["tokens"].float() + 0.5
    with pytest.raises(TypeError, match=r"tokens must hold integer token ids .*got dtype torch.float32"):
        dppo_loss(**dict(kw, tokens=tokens))
    with pytest.raises(TypeError, match=r"topk_ids must hold integer token ids .*got dtype torch.float64"):
        dppo_loss(**dict(kw, topk_ids=kw["topk_ids"].double()))
    with pytest.raises(TypeError, match=r"tokens must hold integer token ids"):
        dppo_loss(**dict(kw, tokens=kw["tokens"] > 3))
    with pytest.raises(TypeError, match=r"tokens must have dtype Long"):
        dppo_loss_per_row(**dict(kw, tokens=tokens))
    fk = _fused_inputs()
    with pytest.raises(TypeError, match=r"tokens must hold integer token ids"):
        fused_linear_dppo_loss(**dict(fk, tokens=fk["tokens"].double()))
    with pytest.raises(TypeError, match=r"tokens must have dtype Long"):
        fused_linear_dppo_loss_per_row(**dict(fk, tokens=fk["tokens"].double()))
    # Integer ids of another width are fine and give the same loss.
    loss32, _ = dppo_loss(**dict(kw, tokens=kw["tokens"].int(), topk_ids=kw["topk_ids"].int()))
    loss64, _ = dppo_loss(**kw)
    torch.testing.assert_close(loss32, loss64, rtol=0, atol=0)


def test_default_thresholds_table_matches_contract_doc():
    text = (REPO / "docs" / "contract.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([0-9.]+ \| [0-9.]+) \|$", text, flags=re.M))
    documented = {mode: tuple(float(x) for x in cell.split(" | ")) for mode, cell in rows.items()}
    assert documented == DEFAULT_DELTAS


@pytest.mark.parametrize("mode", MODES)
def test_every_entry_point_uses_the_mode_defaults(mode):
    """Thresholds left out = the mode's DEFAULT_DELTAS at every entry point (the old 0.2 / 0.2 of the op wrapper
    and the fused-linear function changed the masks of the KL and ratio modes)."""
    kw = sample_inputs("cpu", torch.float64, mode, "v129", seed=34)
    low, high = DEFAULT_DELTAS[mode]
    implicit = {k: v for k, v in kw.items() if k not in ("delta_low", "delta_high")}
    explicit = dict(implicit, delta_low=low, delta_high=high)
    for key, value in dppo_loss_per_row(**implicit)._asdict().items():
        torch.testing.assert_close(value, getattr(dppo_loss_per_row(**explicit), key), rtol=0, atol=0)
    ref = dppo_loss_reference(**implicit)
    torch.testing.assert_close(ref["mask"], dppo_loss_reference(**explicit)["mask"], rtol=0, atol=0)
    if mode == "binary_kl":  # the masks the old 0.2 / 0.2 default gave differ here
        old = dppo_loss_per_row(**dict(implicit, delta_low=0.2, delta_high=0.2))
        assert not torch.equal(old.mask, dppo_loss_per_row(**implicit).mask)
    gen = torch.Generator().manual_seed(35)
    n, v = kw["logits"].shape
    hidden = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, 6, generator=gen, dtype=torch.float64)
    fused = {
        k: implicit[k]
        for k in (
            "tokens",
            "rollout_logprobs",
            "advantages",
            "topk_ids",
            "topk_logprobs",
            "mode",
            "temperature",
            "ratio_cap",
        )
    }
    got = fused_linear_dppo_loss_per_row(hidden, weight, **fused)
    want = fused_linear_dppo_loss_per_row(hidden, weight, **fused, delta_low=low, delta_high=high)
    torch.testing.assert_close(got.mask, want.mask, rtol=0, atol=0)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)


@pytest.mark.parametrize(
    "settings, exc, match",
    [
        (dict(mode="binary_js"), ValueError, r"mode must be one of .*got 'binary_js'"),
        (dict(temperature=0.0), ValueError, r"temperature must be a finite number > 0, got 0.0"),
        (dict(temperature=math.nan), ValueError, r"temperature must be a finite number > 0, got nan"),
        (dict(temperature="1"), ValueError, r"temperature must be a finite number > 0, got '1'"),
        (dict(delta_low=-0.1), ValueError, r"delta_low must be a finite number >= 0 or None .*got -0.1"),
        (dict(delta_high=math.nan), ValueError, r"delta_high must be a finite number >= 0 or None .*got nan"),
        (dict(delta_high=math.inf), ValueError, r"delta_high must be a finite number >= 0 or None .*got inf"),
        (dict(ratio_cap=0.0), ValueError, r"ratio_cap must be a number > 0, got 0.0"),
        (dict(ratio_cap=math.nan), ValueError, r"ratio_cap must be a number > 0, got nan"),
        (dict(loss_agg_mode="sum"), ValueError, r"loss_agg_mode must be one of"),
        (dict(compute_entropy="no"), TypeError, r"compute_entropy must be a bool, got 'no'"),
        (dict(inplace_backward=1), TypeError, r"inplace_backward must be a bool, got 1"),
    ],
)
@pytest.mark.parametrize("module", (DPPOLoss, FusedLinearDPPOLoss), ids=lambda m: m.__name__)
def test_loss_modules_check_their_settings_at_construction(module, settings, exc, match):
    settings = dict(settings)
    mode = settings.pop("mode", "binary_tv")
    if module is FusedLinearDPPOLoss and "inplace_backward" in settings:
        settings, exc, match = {"chunk_size": 0}, ValueError, r"chunk_size must be a positive int or None, got 0"
    with pytest.raises(exc, match=match):
        module(mode, **settings)


def test_module_defaults_and_valid_settings_construct():
    crit = DPPOLoss("ratio", temperature=0.7, delta_low=None, delta_high=0.3, ratio_cap=math.inf)
    assert crit.mode == "ratio" and crit.delta_high == 0.3


def test_trl_layout_advantages_b1_broadcast_like_b():
    kw = sample_inputs("cpu", torch.float64, "binary_tv", "v129", seed=36)
    b, t = 6, 5
    flat = {k: (v[: b * t].reshape(b, t, *v.shape[1:]) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    flat.pop("anchor_logprobs")
    flat["tokens"] = flat["tokens"].clamp(min=0)
    adv = torch.randn(b, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    loss_b, metrics_b = dppo_loss(**dict(flat, advantages=adv), loss_agg_mode="seq-mean-token-mean")
    loss_b1, metrics_b1 = dppo_loss(**dict(flat, advantages=adv[:, None]), loss_agg_mode="seq-mean-token-mean")
    ref, _ = dppo_loss_full_reference(**dict(flat, advantages=adv), loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(loss_b1, loss_b, rtol=0, atol=0)
    torch.testing.assert_close(loss_b1, ref)
    for key in metrics_b:
        torch.testing.assert_close(metrics_b1[key], metrics_b[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"advantages must have shape \(6, 5\) \(per token\) or \(6,\) or \(6, 1\)"):
        dppo_loss(**dict(flat, advantages=adv[:, None].expand(b, 2)))
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(b, t, 4, generator=gen, dtype=torch.float64)
    weight = torch.randn(flat["logits"].shape[-1], 4, generator=gen, dtype=torch.float64)
    fused = {k: flat[k] for k in ("tokens", "rollout_logprobs")}
    got, _ = fused_linear_dppo_loss(hidden, weight, advantages=adv[:, None], **fused)
    want, _ = fused_linear_dppo_loss(hidden, weight, advantages=adv, **fused)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("factor", (math.inf, math.nan))
def test_aggregate_loss_refuses_a_nonfinite_scale_factor(factor):
    """loss_scale_factor=inf would give a loss of exactly 0 (and no gradient) without a word."""
    with pytest.raises(ValueError, match=r"loss_scale_factor must be > 0 or None, got (inf|nan)"):
        aggregate_loss(torch.ones(3, 4), torch.ones(3, 4), "seq-mean-token-sum-norm", factor)


def test_aggregate_loss_refuses_a_mask_that_would_broadcast():
    loss_mat = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"mask must have the loss's shape \(3, 4\), got \(4,\)"):
        aggregate_loss(loss_mat, torch.ones(4))
    with pytest.raises(ValueError, match=r"mask must have the loss's shape \(3, 4\), got \(3, 1\)"):
        aggregate_loss(loss_mat, torch.ones(3, 1), "seq-mean-token-sum")


def test_ratio_metric_of_a_token_impossible_under_both_policies():
    """Both log-probs -inf: weight 0 and ratio 0 (the reference's rule), not a NaN ratio_max."""
    kw = sample_inputs("cpu", torch.float64, "binary_tv", "v129", seed=37)
    z = kw["logits"].clone()
    z[5, int(kw["tokens"][5])] = -math.inf
    rollout = kw["rollout_logprobs"].clone()
    rollout[5] = -math.inf
    kw = dict(kw, logits=z, rollout_logprobs=rollout)
    _, metrics = dppo_loss(**kw)
    _, ref_metrics = dppo_loss_full_reference(**kw)
    assert torch.isfinite(metrics["ratio_max"])
    torch.testing.assert_close(metrics["ratio_max"], ref_metrics["ratio_max"])


# ---- padding holds anything: values at masked positions are never read -------------------------------------------

PADDING_GARBAGE = [
    ("rollout_logprobs", math.nan),
    ("rollout_logprobs", 0.5),
    ("advantages", math.nan),
    ("advantages", math.inf),
    ("anchor_logprobs", math.nan),
    ("anchor_logprobs", 0.5),
    ("topk_logprobs", math.nan),
    ("topk_logprobs", 0.5),
    ("topk_ids", -1),
]


def _padded_call(entry: str, kw: dict, mask: torch.Tensor):
    """(loss, metrics or None, gradient) of one entry point on ``kw`` with the rows outside ``mask`` as padding."""
    if entry.startswith("fused"):
        hidden = kw["hidden"].clone().requires_grad_(True)
        rows = {k: kw[k] for k in ("rollout_logprobs", "advantages", "topk_ids", "topk_logprobs", "anchor_logprobs")}
        settings = dict(mode="topk_kl")
        if entry == "fused_linear_dppo_loss_per_row":
            tokens = torch.where(mask, kw["tokens"], -100)
            out = fused_linear_dppo_loss_per_row(hidden, kw["weight"], tokens, **rows, **settings)
            loss, metrics = out.loss.sum(), None
        elif entry == "FusedLinearDPPOLoss":
            loss, metrics = FusedLinearDPPOLoss(**settings)(
                hidden, kw["weight"], kw["tokens"], **rows, response_mask=mask
            )
        else:
            loss, metrics = fused_linear_dppo_loss(
                hidden, kw["weight"], kw["tokens"], **rows, response_mask=mask, **settings
            )
        loss.backward()
        return loss, metrics, hidden.grad
    logits = kw["logits"].clone().requires_grad_(True)
    rows = {k: kw[k] for k in ("rollout_logprobs", "advantages", "topk_ids", "topk_logprobs", "anchor_logprobs")}
    if entry == "dppo_loss_per_row":
        out = dppo_loss_per_row(logits, torch.where(mask, kw["tokens"], -100), **rows, mode="topk_kl")
        loss, metrics = out.loss.sum(), None
    elif entry == "DPPOLoss":
        loss, metrics = DPPOLoss(mode="topk_kl")(logits, kw["tokens"], **rows, response_mask=mask)
    else:
        loss, metrics = dppo_loss(logits, kw["tokens"], **rows, response_mask=mask, mode="topk_kl")
    loss.backward()
    return loss, metrics, logits.grad


@pytest.mark.parametrize(
    "entry",
    [
        "dppo_loss_per_row",
        "dppo_loss",
        "DPPOLoss",
        "fused_linear_dppo_loss",
        "fused_linear_dppo_loss_per_row",
        "FusedLinearDPPOLoss",
    ],
)
@pytest.mark.parametrize(("field", "value"), PADDING_GARBAGE, ids=[f"{f}={v}" for f, v in PADDING_GARBAGE])
def test_values_at_padding_positions_are_ignored(entry, field, value):
    """A user's padding holds anything (NaN, +0.5, an id -1): the loss, the metrics and the gradient are exactly
    those of clean padding (docs/contract.md), and no check refuses it; the same value on a response token is
    refused, naming the input."""
    kw = (
        _fused_inputs(n=9, v=37)
        if entry.startswith("fused")
        else sample_inputs("cpu", torch.float64, "topk_kl", "v129", seed=3)
    )
    n = kw["tokens"].shape[0]
    gen = torch.Generator().manual_seed(1)
    if entry.startswith("fused"):
        logp = torch.log_softmax(kw["hidden"] @ kw["weight"].t(), -1)
        top = logp.topk(4, dim=-1)
        kw.update(topk_ids=top.indices, topk_logprobs=top.values)
    kw["tokens"] = torch.where(kw["tokens"] < 0, 0, kw["tokens"])  # the mask marks the padding here
    kw["anchor_logprobs"] = kw["rollout_logprobs"] - 0.1 * torch.rand(
        n, generator=gen, dtype=kw["rollout_logprobs"].dtype
    )
    mask = torch.ones(n, dtype=torch.bool)
    mask[[1, n - 1]] = False
    dirty = dict(kw)
    dirty[field] = kw[field].clone()
    dirty[field][~mask] = value
    clean_loss, clean_metrics, clean_grad = _padded_call(entry, kw, mask)
    loss, metrics, grad = _padded_call(entry, dirty, mask)
    assert torch.isfinite(clean_loss)
    torch.testing.assert_close(loss, clean_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0)
    assert (grad[~mask] == 0).all()
    if metrics is not None:
        for key, got in metrics.items():
            torch.testing.assert_close(got, clean_metrics[key], rtol=0, atol=0, equal_nan=True, msg=key)
    bad = dict(kw)
    bad[field] = kw[field].clone()
    bad[field][0] = value  # a response token: refused
    expected = {"topk_ids": r"topk_ids must hold ids in \[0, V=", "advantages": "advantages must be finite"}
    with pytest.raises((ValueError, IndexError), match=expected.get(field, f"{field} must be log-probabilities")):
        _padded_call(entry, bad, mask)

"""fused_linear_dppo_loss(logits_dtype=torch.float32) with bfloat16/float16 hidden and weight: an fp32 LM head.

Checks: (1) the loss, per-row outputs and gradients equal the logits path on the upcast operands (hidden, weight,
bias widened to float32, the product and the op in float32), each gradient within one rounding to its dtype, on
the training path (gradients in the forward), the recompute path (per-row API, split vocabulary) and float16's
recompute path; (2) the result is closer to the float64 truth than the default (16-bit logits) path; (3) the weight
is widened a block at a time (blocks smaller than a row chunk give the same result), never whole; (4) the module
form; (5) the dtypes refused.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dppo_ext import (
    FusedLinearDPPOLoss,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
)
from dppo_ext import _lm_head_tiles as tiles

N, V, H = 37, 301, 48
# One rounding of a float32 value to the dtype (half an ulp at 1.0, relative), times 2 for the float32 sums' own
# order-of-summation differences riding on top.
ROUNDING = {torch.bfloat16: 2 * 2.0**-8, torch.float16: 2 * 2.0**-11}
LOW = (torch.bfloat16, torch.float16)


def _id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_inputs(seed: int = 0) -> dict:
    """float64 hidden [N, H], weight [V, H], bias [V] with logits of a few units (a peaked softmax, where 16-bit
    logits lose digits), rollout log-probs of a perturbed softmax, mixed advantages, two padding rows."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * (3.0 / H**0.5)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    logits = hidden @ weight.t() + bias
    rollout = torch.log_softmax(logits + 0.1 * torch.randn(N, V, generator=g, dtype=torch.float64), -1)
    tokens = torch.multinomial(rollout.exp(), 1, generator=g).squeeze(1)
    rollout_logprobs = rollout.gather(1, tokens[:, None]).squeeze(1)
    tokens[-2:] = -100
    advantages = torch.randn(N, generator=g, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, bias=bias, tokens=tokens, rollout=rollout_logprobs, adv=advantages)


def leaves(inputs: dict, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(inputs[k].to(dtype).requires_grad_(True) for k in ("hidden", "weight", "bias"))


def fused(inputs: dict, dtype: torch.dtype, *, per_row: bool, **kwargs) -> tuple[torch.Tensor, list, list]:
    """(loss or per-row logp, [loss, logp, entropy] per-row outputs or metrics, [grad_h, grad_w, grad_b])."""
    h, w, b = leaves(inputs, dtype)
    rows = (inputs["tokens"], inputs["rollout"].float(), inputs["adv"].float())
    if per_row:
        out = fused_linear_dppo_loss_per_row(h, w, *rows, bias=b, **kwargs)
        (out.loss.sum() + 0.5 * out.logp.sum() + 0.25 * out.entropy.sum()).backward()
        values = [out.loss, out.logp, out.entropy]
    else:
        loss, _metrics = fused_linear_dppo_loss(h, w, *rows, bias=b, **kwargs)
        loss.backward()
        values = [loss]
    return values, [h.grad, w.grad, b.grad]


def logits_path(inputs: dict, dtype: torch.dtype, compute: torch.dtype, *, per_row: bool) -> tuple[list, list]:
    """The logits path on the ``dtype``-rounded operands, the LM head and the op computed in ``compute``; gradients
    in ``compute``."""
    h, w, b = (t.detach().to(compute).requires_grad_(True) for t in leaves(inputs, dtype))
    acc = torch.float64 if compute == torch.float64 else torch.float32
    rows = (inputs["tokens"], inputs["rollout"].to(acc), inputs["adv"].to(acc))
    logits = h @ w.t() + b
    if per_row:
        out = dppo_loss_per_row(logits, *rows)
        (out.loss.sum() + 0.5 * out.logp.sum() + 0.25 * out.entropy.sum()).backward()
        values = [out.loss, out.logp, out.entropy]
    else:
        loss, _metrics = dppo_loss(logits, *rows)
        loss.backward()
        values = [loss]
    return values, [h.grad, w.grad, b.grad]


PATHS = {
    "training": dict(per_row=False),  # gradients in the forward (float16: the recompute path)
    "training_chunk_8_accum_fp32": dict(per_row=False, chunk_size=8, accum_dtype=torch.float32),
    "per_row_chunk_8": dict(per_row=True, chunk_size=8),
    "per_row_tiles_8x50": dict(per_row=True, chunk_size=8, vocab_chunk_size=50),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", LOW, ids=_id)
def test_matches_logits_path_on_upcast_operands(dtype, path):
    kwargs = dict(PATHS[path])
    per_row = kwargs.pop("per_row")
    inputs = make_inputs()
    got, got_grads = fused(inputs, dtype, per_row=per_row, logits_dtype=torch.float32, **kwargs)
    want, want_grads = logits_path(inputs, dtype, torch.float32, per_row=per_row)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    # the bfloat16 accumulation of the weight gradient across row chunks (accum_dtype None) rounds once per chunk
    chunks = 1 if kwargs.get("accum_dtype") or per_row else -(-N // 256)
    for name, g, w in zip(("hidden", "weight", "bias"), got_grads, want_grads):
        assert g.dtype == dtype, name
        err = (g.double() - w.double()).abs()
        bound = chunks * ROUNDING[dtype] * w.double().abs() + 1e-6 * w.abs().max().item()
        assert (err <= bound).all(), f"{name}: max error {err.max():.3e} beyond one rounding of the float32 product"


@pytest.mark.parametrize("path", ("training", "per_row_chunk_8"))
def test_closer_to_float64_truth_than_bfloat16_logits(path):
    kwargs = dict(PATHS[path])
    per_row = kwargs.pop("per_row")
    inputs = make_inputs(seed=3)
    truth, truth_grads = logits_path(inputs, torch.bfloat16, torch.float64, per_row=per_row)
    errors = {}
    for name, logits_dtype in (("bf16", None), ("fp32", torch.float32)):
        values, grads = fused(inputs, torch.bfloat16, per_row=per_row, logits_dtype=logits_dtype, **kwargs)
        errors[name] = [(v.double() - t).abs().max().item() for v, t in zip(values, truth)] + [
            (g.double() - t).norm().item() / t.norm().item() for g, t in zip(grads, truth_grads)
        ]
    # every output and gradient at least as close; the values (no final 16-bit rounding) by a wide margin
    for i, (fp32, bf16) in enumerate(zip(errors["fp32"], errors["bf16"])):
        assert fp32 <= bf16, (i, errors)
    assert errors["fp32"][0] * 20 < errors["bf16"][0], errors


@pytest.mark.parametrize("path", PATHS)
def test_weight_widened_a_block_at_a_time(path, monkeypatch):
    """Blocks of 7 rows (crossing every chunk and tile boundary) give the one-block result, and no widening to float32
    returns more than a block of the weight (7 rows) or the hidden states: the weight is never widened whole."""
    kwargs = dict(PATHS[path])
    per_row = kwargs.pop("per_row")
    inputs = make_inputs(seed=1)
    whole, whole_grads = fused(inputs, torch.bfloat16, per_row=per_row, logits_dtype=torch.float32, **kwargs)
    monkeypatch.setattr(tiles, "UPCAST_BLOCK_BYTES", 7 * H * 4)
    with _LargestWidening() as seen:
        blocked, blocked_grads = fused(inputs, torch.bfloat16, per_row=per_row, logits_dtype=torch.float32, **kwargs)
    for a, b in zip(whole + whole_grads, blocked + blocked_grads):
        torch.testing.assert_close(a, b, rtol=2e-2 if a.dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    assert 0 < seen.largest <= max(7 * H, N * H), (seen.largest, V * H)  # weight blocks; hidden widened whole


class _LargestWidening(TorchDispatchMode):
    """Records the largest float32 tensor (in elements) a dtype conversion (``aten._to_copy``) returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.dtype == torch.float32:
            self.largest = max(self.largest, out.numel())
        return out


def test_float32_inputs_unchanged():
    inputs = make_inputs()
    a, a_grads = fused(inputs, torch.float32, per_row=False)
    b, b_grads = fused(inputs, torch.float32, per_row=False, logits_dtype=torch.float32)
    for x, y in zip(a + a_grads, b + b_grads):
        assert torch.equal(x, y)


def test_module_form():
    inputs = make_inputs()
    h, w, b = leaves(inputs, torch.bfloat16)
    crit = FusedLinearDPPOLoss(logits_dtype=torch.float32)
    assert "logits_dtype=torch.float32" in repr(crit)
    loss, _ = crit(h, w, inputs["tokens"], inputs["rollout"].float(), inputs["adv"].float(), bias=b)
    (want,), _ = fused(inputs, torch.bfloat16, per_row=False, logits_dtype=torch.float32)
    assert torch.equal(loss.detach(), want.detach())


@pytest.mark.parametrize(
    ("dtype", "logits_dtype", "error", "match"),
    [
        (torch.bfloat16, torch.float16, TypeError, r"logits_dtype must be None, torch.bfloat16 .* or torch.float32"),
        (torch.bfloat16, torch.float64, TypeError, r"for torch.bfloat16 hidden, got torch.float64"),
        (torch.float64, torch.float32, TypeError, r"logits_dtype must be None or torch.float64 for torch.float64"),
        (torch.bfloat16, "float32", TypeError, r"logits_dtype must be None or a floating-point torch.dtype"),
        (torch.bfloat16, torch.int32, TypeError, r"logits_dtype must be None or a floating-point torch.dtype"),
    ],
)
def test_refused(dtype, logits_dtype, error, match):
    inputs = make_inputs()
    with pytest.raises(error, match=match):
        fused(inputs, dtype, per_row=False, logits_dtype=logits_dtype)
    with pytest.raises(error, match=match):
        fused(inputs, dtype, per_row=True, logits_dtype=logits_dtype)
    if not isinstance(logits_dtype, torch.dtype) or not logits_dtype.is_floating_point:
        with pytest.raises(error, match=match):
            FusedLinearDPPOLoss(logits_dtype=logits_dtype)

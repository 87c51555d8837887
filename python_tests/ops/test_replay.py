"""Sampling replay (``kept_ids``): the op over the softmax renormalised on the rollout's kept set.

The five checks of every op test file for ``kept_ids`` (forward vs ``dppo_ext.reference``, gradients vs autograd
of the reference, float64 gradcheck, ``torch.library.opcheck``, the error messages), the entry points of the API
family with ``kept_ids`` against the reference, and the measurement that motivates replay: a rollout that samples
from a top-k / top-p / min-p truncated distribution has log-probs that the full softmax does not reproduce, and the
renormalised one does exactly.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dppo_testing import DEVICES

from dppo_ext import DPPOLoss, FusedLinearDPPOLoss, dppo_loss, dppo_loss_per_row, fused_linear_dppo_loss
from dppo_ext._autograd import grad_args
from dppo_ext.contract import MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import METRIC_KEYS, OUTPUT_KEYS, dppo_loss_full_reference, dppo_loss_reference
from dppo_ext.vocab_parallel import _local_kept, _local_tokens, _slice_backward

DIFFERENTIABLE = ("loss", "logp", "entropy")
TOL = {torch.float64: (1e-10, 1e-9), torch.float32: (2e-5, 2e-5)}


def _truncate(scaled: torch.Tensor, rule: str, value: float) -> torch.Tensor:
    """``[N, V]`` bool: the tokens a top-k / top-p / min-p rule keeps on ``scaled = logits / T`` (plain torch)."""
    probs = torch.softmax(scaled, dim=-1)
    if rule == "top_k":
        kth = torch.topk(scaled, int(value), dim=-1).values[:, -1:]
        return scaled >= kth
    if rule == "min_p":
        return probs >= value * probs.amax(dim=-1, keepdim=True)
    # top_p: the smallest prefix of the sorted distribution whose mass reaches p (the top token always kept)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    keep_sorted = before < value
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _kept_ids(keep: torch.Tensor, width: int, gen: torch.Generator) -> torch.Tensor:
    """``[N, width]`` int64: each row's kept ids in a shuffled order, -1 padding spread among them."""
    n = keep.shape[0]
    out = torch.full((n, width), -1, dtype=torch.long)
    for i in range(n):
        ids = keep[i].nonzero().squeeze(1)
        assert ids.numel() <= width, "the kept set must fit in S"
        slots = torch.randperm(width, generator=gen)[: ids.numel()]
        out[i, slots] = ids[torch.randperm(ids.numel(), generator=gen)]
    return out


def replay_inputs(dtype=torch.float64, mode="binary_tv", *, n=23, v=97, seed=0, rule="top_k", value=7.0):
    """Keyword arguments of ``dppo_loss_per_row`` / ``dppo_loss_reference`` with ``kept_ids``.

    The rollout's distribution is the trainer's logits plus noise, truncated by ``rule`` and renormalised (its
    kept sets vary per row); tokens are sampled from it; row 0's kept set is the single sampled token; the last two
    rows are padding (token -100) with a kept set that would be invalid elsewhere (out-of-range and repeated ids).
    """
    gen = torch.Generator().manual_seed(seed)
    t = 0.8
    z = (torch.randn(n, v, generator=gen, dtype=torch.float64) * 2.0).to(dtype)
    behaviour = z.double() / t + 0.3 * torch.randn(n, v, generator=gen, dtype=torch.float64)
    keep = _truncate(behaviour, rule, value)
    keep[0] = False
    keep[0, int(behaviour[0].argmax())] = True
    log_mu = torch.log_softmax(behaviour.masked_fill(~keep, -math.inf), dim=-1)
    tokens = torch.multinomial(log_mu.exp(), 1, generator=gen).squeeze(1)
    width = int(keep.sum(1).max()) + 3
    kept = _kept_ids(keep, width, gen)
    acc = accumulation_dtype(dtype)
    rollout = log_mu.gather(1, tokens[:, None]).squeeze(1)
    tokens[-2:] = -100
    kept[-2:, 0] = v + 5
    kept[-1, 1:3] = 4
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    adv[1] = 0.0
    out = dict(
        logits=z,
        tokens=tokens,
        rollout_logprobs=rollout.to(acc),
        advantages=adv.to(acc),
        kept_ids=kept,
        mode=mode,
        temperature=t,
        delta_low=0.05 if "kl" in mode else 0.15,
        delta_high=0.05 if "kl" in mode else 0.15,
    )
    if mode in TOPK_MODES:
        top = torch.topk(log_mu, 5, dim=-1)
        out["topk_ids"], out["topk_logprobs"] = top.indices, top.values.to(acc)
    return out


def _reference(inputs: dict) -> dict[str, torch.Tensor]:
    kw = dict(inputs)
    kw["logits"] = kw["logits"].double()
    for key in ("rollout_logprobs", "advantages", "topk_logprobs"):
        if kw.get(key) is not None:
            kw[key] = kw[key].double()
    return dppo_loss_reference(**kw)


# ---- 1. forward vs the reference -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rule,value", [("top_k", 7.0), ("top_p", 0.8), ("min_p", 0.1)])
def test_forward_matches_reference(dtype, mode, rule, value):
    inputs = replay_inputs(dtype, mode, rule=rule, value=value)
    with torch.no_grad():
        got = dppo_loss_per_row(**inputs)._asdict()
        want = _reference(inputs)
    atol, rtol = TOL[dtype]
    valid = inputs["tokens"] != -100
    for key in OUTPUT_KEYS:
        assert (got[key][~valid] == 0).all(), f"{key}: padding rows must be 0"
        torch.testing.assert_close(
            got[key].double(), want[key], atol=atol, rtol=rtol, msg=lambda m, key=key: f"{key}: {m}"
        )
    # the kept set of one token: pi_K(a) = 1, entropy 0
    assert got["logp"][0].item() == pytest.approx(0.0, abs=1e-6)
    assert got["entropy"][0].item() == pytest.approx(0.0, abs=1e-6)


def test_replay_differs_from_the_full_softmax():
    """The check above could not fail if the op ignored kept_ids: the full softmax's outputs differ."""
    inputs = replay_inputs(torch.float64)
    with torch.no_grad():
        replay = dppo_loss_per_row(**inputs)
        full = dppo_loss_per_row(**{**inputs, "kept_ids": None})
    valid = inputs["tokens"] != -100
    assert (replay.logp[valid] > full.logp[valid]).all()  # renormalising over a subset raises every kept log-prob
    assert (replay.lse[valid] < full.lse[valid]).all()
    assert (replay.entropy[valid] < full.entropy[valid]).all()


def test_nonfinite_logit_outside_the_kept_set_poisons_the_row():
    """Non-finite in, non-finite out: a NaN or +inf anywhere in the row makes every output NaN, as without replay;
    -inf outside the kept set is an ordinary logit."""
    inputs = replay_inputs(torch.float64)
    kept = inputs["kept_ids"]
    outside = [j for j in range(inputs["logits"].shape[1]) if j not in kept[2].tolist()]
    inputs["logits"][2, outside[0]] = math.nan
    inputs["logits"][3, [j for j in range(inputs["logits"].shape[1]) if j not in kept[3].tolist()][0]] = math.inf
    inputs["logits"][4, [j for j in range(inputs["logits"].shape[1]) if j not in kept[4].tolist()][0]] = -math.inf
    with torch.no_grad():
        out = dppo_loss_per_row(**inputs)
        ref = _reference(inputs)
    for key in OUTPUT_KEYS:
        value = getattr(out, key)
        assert value[2:4].isnan().all(), f"{key}: {value[2:4]}"
        assert value[4].isfinite(), key
        assert ref[key][2:4].isnan().all() and ref[key][4].isfinite(), key


# ---- 2. gradients vs autograd of the reference; in-place backward ---------------------------------------------


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", ["binary_tv", "binary_kl", "topk_kl", "ratio"])
def test_gradients_match_reference(dtype, mode, inplace):
    inputs = replay_inputs(dtype, mode, rule="top_p", value=0.85)
    gen = torch.Generator().manual_seed(3)
    n = inputs["tokens"].shape[0]
    upstream = {k: torch.randn(n, generator=gen, dtype=torch.float64) for k in DIFFERENTIABLE}

    base = inputs["logits"].clone().requires_grad_(True)
    logits = base * 1.0 if inplace else base
    out = dppo_loss_per_row(**{**inputs, "logits": logits}, inplace_backward=inplace)._asdict()
    sum(torch.sum(out[k].double() * upstream[k]) for k in DIFFERENTIABLE).backward()

    ref_logits = inputs["logits"].double().requires_grad_(True)
    ref = _reference({**inputs, "logits": ref_logits})
    sum(torch.sum(ref[k] * upstream[k]) for k in DIFFERENTIABLE).backward()

    atol, rtol = TOL[dtype]
    torch.testing.assert_close(base.grad.double(), ref_logits.grad, atol=atol * 10, rtol=rtol * 10)
    # the gradient is zero outside each row's kept set
    kept = inputs["kept_ids"]
    inside = torch.zeros_like(base.grad, dtype=torch.bool)
    for i in range(n):
        inside[i, kept[i][(kept[i] >= 0) & (kept[i] < base.shape[1])]] = True
    inside[inputs["tokens"] == -100] = False
    assert (base.grad[~inside] == 0).all()
    assert (base.grad[inside] != 0).any()


# ---- 3. gradcheck in float64 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["binary_tv", "topk_tv", "ratio"])
def test_gradcheck(mode):
    """float64 gradcheck of loss, logp and entropy. The weight and the mask are constants for autograd, so the inputs
    pin the weight at the cap (mu = pi / e, ratio_cap 0.5) and zero the advantage of rows within 1e-3 of a threshold
    (as the op tests' gradcheck does)."""
    inputs = replay_inputs(torch.float64, mode, n=9, v=31, rule="top_k", value=5.0)
    ref = _reference(inputs)
    valid = inputs["tokens"] != -100
    inputs["rollout_logprobs"] = torch.where(valid, ref["logp"] - 1.0, inputs["rollout_logprobs"])
    inputs["ratio_cap"] = 0.5
    ref = _reference(inputs)
    assert (ref["weight"][valid] == 0.5).all()
    edges = (1.0 - inputs["delta_low"], 1.0 + inputs["delta_high"]) if mode == "ratio" else (0.15,)
    tie = torch.zeros_like(valid)
    for edge in edges:
        tie |= (ref["divergence"] - edge).abs() < 1e-3
    inputs["advantages"] = torch.where(tie, torch.zeros_like(inputs["advantages"]), inputs["advantages"])
    logits = inputs.pop("logits").requires_grad_(True)

    def fn(z):
        out = dppo_loss_per_row(z, **inputs)
        return out.loss, out.logp, out.entropy

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---- 4. opcheck ------------------------------------------------------------------------------------------------


def test_opcheck():
    inputs = replay_inputs(torch.float32, "topk_kl", n=11, v=53)
    args = (
        inputs["logits"].requires_grad_(True),
        inputs["tokens"],
        inputs["rollout_logprobs"],
        inputs["advantages"],
        inputs["topk_ids"],
        inputs["topk_logprobs"],
        None,
        "topk_kl",
        inputs["temperature"],
        0.05,
        0.05,
        2.0,
        True,
        inputs["kept_ids"],
    )
    torch.library.opcheck(torch.ops.dppo.dppo_loss_forward.default, args)
    out = torch.ops.dppo.dppo_loss_forward(*args)
    n = inputs["tokens"].shape[0]
    gt, ge = torch.randn(n), torch.randn(n)
    logits = inputs["logits"].detach()
    bwd = (
        gt,
        ge,
        logits,
        inputs["tokens"],
        out[6].detach(),
        out[5].detach(),
        inputs["temperature"],
        inputs["kept_ids"],
    )
    torch.library.opcheck(torch.ops.dppo.dppo_loss_backward.default, bwd)
    torch.library.opcheck(torch.ops.dppo.dppo_loss_backward_.default, (*bwd[:2], logits.clone(), *bwd[3:]))


def test_compile_fullgraph():
    inputs = replay_inputs(torch.float32, "binary_tv", n=11, v=53)
    kw = {k: v for k, v in inputs.items() if k not in ("logits", "kept_ids")}
    fn = torch.compile(lambda z, kept: dppo_loss_per_row(z, **kw, kept_ids=kept).loss, fullgraph=True)
    want = dppo_loss_per_row(inputs["logits"], kept_ids=inputs["kept_ids"], **kw).loss
    torch.testing.assert_close(fn(inputs["logits"], inputs["kept_ids"]), want)


# ---- 5. errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda i: i["kept_ids"].float(), TypeError, r"kept_ids must have dtype Long \(token ids\), got Float"),
        (lambda i: i["kept_ids"][:-1], ValueError, r"kept_ids must be 2-D \[N, S\] with N=23"),
        (lambda i: i["kept_ids"][:, :, None], ValueError, r"kept_ids must be 2-D \[N, S\]"),
        (lambda i: i["kept_ids"][:, :0], ValueError, r"kept_ids must have 1 <= S <= V=97 columns"),
        (lambda i: torch.zeros(23, 98, dtype=torch.long), ValueError, r"1 <= S <= V=97"),
        (lambda i: i["kept_ids"].int(), TypeError, "kept_ids must have dtype Long"),
    ],
)
def test_kept_ids_shape_and_dtype_errors(make, exc, match):
    inputs = replay_inputs(torch.float32)
    inputs["kept_ids"] = make(inputs)
    with pytest.raises(exc, match=match):
        dppo_loss_per_row(**inputs)


def _set(kept: torch.Tensor, row: int, col: int, value: int) -> torch.Tensor:
    kept = kept.clone()
    kept[row, col] = value
    return kept


@pytest.mark.parametrize("device", DEVICES)
def test_kept_ids_value_errors(device):
    """The same rules and messages on the CPU (a loop per rule) and on a device (ATen reductions)."""
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in replay_inputs(torch.float32).items()}
    kept, tokens = inputs["kept_ids"], inputs["tokens"]
    pad = int((kept[5] == -1).nonzero()[0])
    with pytest.raises(
        IndexError, match=r"kept_ids must hold token ids in \[0, V=97\) or the padding -1, got 97 at row 5"
    ):
        dppo_loss_per_row(**{**inputs, "kept_ids": _set(kept, 5, pad, 97)})
    with pytest.raises(IndexError, match=r"got -2 at row 6"):
        dppo_loss_per_row(**{**inputs, "kept_ids": _set(kept, 6, int((kept[6] == -1).nonzero()[0]), -2)})
    dup = int(kept[7][kept[7] >= 0][0])
    with pytest.raises(
        ValueError, match=rf"kept_ids must hold each id at most once per row, got id {dup} twice in row 7"
    ):
        dppo_loss_per_row(**{**inputs, "kept_ids": _set(kept, 7, int((kept[7] == -1).nonzero()[0]), dup)})
    empty = kept.clone()
    empty[8] = -1
    with pytest.raises(ValueError, match=r"kept_ids row 8 is empty \(every entry -1\), but its token \d+ was sampled"):
        dppo_loss_per_row(**{**inputs, "kept_ids": empty})
    missing = kept.clone()
    missing[9][missing[9] == tokens[9]] = -1
    with pytest.raises(ValueError, match=rf"tokens\[9\] = {int(tokens[9])} is not in its kept set kept_ids\[9\]"):
        dppo_loss_per_row(**{**inputs, "kept_ids": missing})
    # a padding row's kept set is not read (the factory's last rows hold out-of-range and repeated ids)
    dppo_loss_per_row(**inputs)


def test_aggregating_entry_point_errors():
    inputs = replay_inputs(torch.float32)
    z = inputs["logits"].reshape(1, 23, 97)
    kw = dict(tokens=inputs["tokens"].reshape(1, 23), rollout_logprobs=inputs["rollout_logprobs"].reshape(1, 23))
    kw["advantages"] = inputs["advantages"].reshape(1, 23)
    with pytest.raises(ValueError, match=r"kept_ids must have shape \(1, 23\) \+ \(S,\)"):
        dppo_loss(z, **kw, kept_ids=inputs["kept_ids"])
    with pytest.raises(TypeError, match="kept_ids must hold integer token ids"):
        dppo_loss(z, **kw, kept_ids=inputs["kept_ids"].reshape(1, 23, -1).float())
    with pytest.raises(TypeError, match="kept_ids must be a torch.Tensor, got a list"):
        dppo_loss(z, **kw, kept_ids=inputs["kept_ids"].reshape(1, 23, -1).tolist())


# ---- the entry points of the API family -----------------------------------------------------------------------


def _batched(inputs: dict, b: int = 1):
    n = inputs["tokens"].shape[0]
    t = n // b
    valid = inputs["tokens"] != -100
    tokens = torch.where(valid, inputs["tokens"], torch.zeros_like(inputs["tokens"]))
    return dict(
        tokens=tokens.reshape(b, t),
        rollout_logprobs=inputs["rollout_logprobs"].reshape(b, t),
        advantages=inputs["advantages"].reshape(b, t),
        response_mask=valid.reshape(b, t),
        kept_ids=inputs["kept_ids"].reshape(b, t, -1),
    )


def _full_reference(inputs: dict, batched: dict):
    z = inputs["logits"].double()
    return dppo_loss_full_reference(
        z.reshape(*batched["tokens"].shape, -1),
        batched["tokens"],
        batched["rollout_logprobs"].double(),
        batched["advantages"].double(),
        response_mask=batched["response_mask"],
        kept_ids=batched["kept_ids"],
        temperature=inputs["temperature"],
    )


def test_dppo_loss_and_module_match_reference():
    inputs = replay_inputs(torch.float64, n=24, rule="min_p", value=0.05)
    batched = _batched(inputs, b=2)
    z = inputs["logits"].reshape(2, 12, -1)
    want_loss, want_metrics = _full_reference(inputs, batched)
    loss, metrics = dppo_loss(z, **batched, temperature=inputs["temperature"])
    loss_m, metrics_m = DPPOLoss(temperature=inputs["temperature"])(z, **batched)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(loss_m, want_loss)
    for key in METRIC_KEYS:
        torch.testing.assert_close(metrics[key], want_metrics[key], msg=lambda m, key=key: f"{key}: {m}")
        torch.testing.assert_close(metrics_m[key], want_metrics[key], msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("vocab_chunk_size", [None, 40])
def test_fused_linear_matches_logits_path(vocab_chunk_size):
    """fused_linear_dppo_loss(_per_row) and FusedLinearDPPOLoss with kept_ids: the logits path's loss and grads
    (vocab_chunk_size: the recompute backward over vocabulary blocks, each with the kept ids it holds)."""
    gen = torch.Generator().manual_seed(5)
    inputs = replay_inputs(torch.float64, n=24, rule="top_p", value=0.9)
    hidden = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(97, 16, generator=gen, dtype=torch.float64) * 0.5
    logits = hidden @ weight.T
    inputs = {**inputs, "logits": logits}
    # the kept sets and tokens must come from these logits' own truncation: rebuild them from the new logits
    inputs = _refit(inputs, gen)
    batched = _batched(inputs, b=2)
    t = inputs["temperature"]

    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = dppo_loss((h1 @ w1.T).reshape(2, 12, -1), **batched, temperature=t)
    loss.backward()
    chunks = dict(vocab_chunk_size=vocab_chunk_size)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss2, _ = fused_linear_dppo_loss(h2.reshape(2, 12, -1), w2, **batched, temperature=t, **chunks)
    loss2.backward()
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(h2.grad, h1.grad)
    torch.testing.assert_close(w2.grad, w1.grad)
    h3, w3 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss3, _ = FusedLinearDPPOLoss(temperature=t, **chunks)(h3.reshape(2, 12, -1), w3, **batched)
    loss3.backward()
    torch.testing.assert_close(loss3, loss)
    torch.testing.assert_close(w3.grad, w1.grad)


def _refit(inputs: dict, gen: torch.Generator) -> dict:
    """Tokens, rollout log-probs and kept sets resampled from ``inputs["logits"]`` by the top-k rule (k = 6)."""
    scaled = inputs["logits"].double() / inputs["temperature"]
    keep = _truncate(scaled, "top_k", 6)
    log_mu = torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    tokens = torch.multinomial(log_mu.exp(), 1, generator=gen).squeeze(1)
    rollout = log_mu.gather(1, tokens[:, None]).squeeze(1)
    tokens[-2:] = -100
    return {**inputs, "tokens": tokens, "rollout_logprobs": rollout, "kept_ids": _kept_ids(keep, 9, gen)}


# ---- vocabulary-parallel: W simulated ranks in one process ----------------------------------------------------


def _simulate_ranks(inputs: dict, offsets: list[int], upstream: dict, inplace: bool):
    """The vocabulary-parallel ops as W ranks would run them (each slice's statistics with its kept logits, stacked as
    the all-gather would, the epilogue, each slice's backward with its local kept ids), concatenated."""
    logits, tokens, t = inputs["logits"].detach(), inputs["tokens"], float(inputs["temperature"])
    mode, kept = inputs["mode"], inputs["kept_ids"]
    ids = inputs.get("topk_ids") if mode in TOPK_MODES else None
    slices = [logits[:, a:b].clone() for a, b in zip(offsets, offsets[1:])]
    stats = torch.stack(
        [torch.ops.dppo.dppo_vocab_parallel_stats(z, tokens, ids, a, t, True, kept) for z, a in zip(slices, offsets)]
    )
    k = 0 if ids is None else ids.shape[1]
    assert stats.shape[2] == 4 + k + kept.shape[1]
    out = torch.ops.dppo.dppo_vocab_parallel_epilogue(
        stats,
        offsets,
        tokens,
        inputs["rollout_logprobs"],
        inputs["advantages"],
        ids,
        inputs.get("topk_logprobs") if ids is not None else None,
        None,
        mode,
        inputs["delta_low"],
        inputs["delta_high"],
        2.0,
        True,
        kept,
    )
    out = dict(zip(OUTPUT_KEYS, out))
    gt, ge, ent = grad_args(
        True,
        inputs["advantages"],
        out["mask"],
        out["weight"],
        upstream["loss"],
        upstream["logp"],
        upstream["entropy"],
        out["entropy"],
    )
    grads = []
    for z, a in zip(slices, offsets):
        local, foreign = _local_tokens(tokens, a, z.shape[1], replay=True)
        local_kept = _local_kept(kept, a, z.shape[1])
        grads.append(_slice_backward(gt, ge, ent, z, local, foreign, out["lse"], t, inplace, local_kept))
    return out, torch.cat(grads, dim=1)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["binary_tv", "binary_kl", "topk_tv", "ratio"])
def test_simulated_vocab_parallel_ranks_match_single_device(mode, world, inplace):
    inputs = replay_inputs(torch.float64, mode, rule="top_p", value=0.9)
    n, v = inputs["logits"].shape
    offsets = [0, v // 3, v] if world == 2 else [0, 1, v // 2, v]  # W = 3: rank 1 holds a single column
    gen = torch.Generator().manual_seed(9)
    g = {key: torch.randn(n, generator=gen, dtype=torch.float64) for key in DIFFERENTIABLE}
    logits = inputs["logits"].clone().requires_grad_(True)
    want = dppo_loss_per_row(**{**inputs, "logits": logits, "ratio_cap": 2.0})._asdict()
    sum(torch.sum(want[key] * g[key]) for key in DIFFERENTIABLE).backward()
    got, grad = _simulate_ranks(inputs, offsets, g, inplace)
    for key in OUTPUT_KEYS:
        torch.testing.assert_close(got[key], want[key].detach(), msg=lambda m, key=key: f"{key}: {m}")
    torch.testing.assert_close(grad, logits.grad)


def test_vocab_parallel_opcheck():
    inputs = replay_inputs(torch.float32, "topk_tv", n=11, v=53)
    kept, ids, t = inputs["kept_ids"], inputs["topk_ids"], inputs["temperature"]
    z = inputs["logits"]
    stats_args = (z[:, 20:], inputs["tokens"], ids, 20, t, True, kept)
    torch.library.opcheck(torch.ops.dppo.dppo_vocab_parallel_stats.default, stats_args)
    stats = torch.stack(
        [
            torch.ops.dppo.dppo_vocab_parallel_stats(z[:, :20], inputs["tokens"], ids, 0, t, True, kept),
            torch.ops.dppo.dppo_vocab_parallel_stats(*stats_args),
        ]
    )
    epilogue_args = (
        stats,
        [0, 20, 53],
        inputs["tokens"],
        inputs["rollout_logprobs"],
        inputs["advantages"],
        ids,
        inputs["topk_logprobs"],
        None,
        "topk_tv",
        0.15,
        0.15,
        2.0,
        True,
        kept,
    )
    torch.library.opcheck(torch.ops.dppo.dppo_vocab_parallel_epilogue.default, epilogue_args)
    with pytest.raises(ValueError, match=r"stats must have 4 \+ K \+ S = "):
        torch.ops.dppo.dppo_vocab_parallel_epilogue(stats[:, :, :-1], *epilogue_args[1:])
    missing = kept.clone()
    missing[3][missing[3] == inputs["tokens"][3]] = -1
    with pytest.raises(ValueError, match=r"tokens\[3\] = \d+ is not in its kept set kept_ids\[3\]"):
        torch.ops.dppo.dppo_vocab_parallel_epilogue(*epilogue_args[:-1], missing)


# ---- replay reproduces the truncated distribution's log-probs -------------------------------------------------


@pytest.mark.parametrize("rule,value", [("top_p", 0.7), ("top_p", 0.9), ("top_k", 2.0), ("top_k", 5.0), ("min_p", 0.1)])
def test_replay_reproduces_truncated_rollout(rule, value):
    """mu from the same logits truncated by the rule and renormalised (what vLLM returns under truncated sampling):
    with kept_ids, |pi - mu| is float rounding and nothing is masked; without, pi is the full softmax's, whose
    mismatch is large and (at top_p 0.7 / top_k 2) masks tokens."""
    gen = torch.Generator().manual_seed(11)
    n, v, t = 512, 211, 0.7
    logits = torch.randn(n, v, generator=gen) * 3.0
    scaled = logits.double() / t
    keep = _truncate(scaled, rule, value)
    log_mu = torch.log_softmax(scaled.masked_fill(~keep, -math.inf), dim=-1)
    tokens = torch.multinomial(log_mu.exp(), 1, generator=gen).squeeze(1)
    rollout = log_mu.gather(1, tokens[:, None]).squeeze(1).float()
    kept = _kept_ids(keep, int(keep.sum(1).max()), gen)
    adv = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    kw = dict(temperature=t, mode="binary_tv")
    with torch.no_grad():
        replay = dppo_loss_per_row(logits, tokens, rollout, adv, kept_ids=kept, **kw)
        full = dppo_loss_per_row(logits, tokens, rollout, adv, **kw)
    gap_replay = (replay.logp.exp() - rollout.exp()).abs()
    gap_full = (full.logp.exp() - rollout.exp()).abs()
    assert gap_replay.max().item() < 1e-5, gap_replay.max()
    assert (replay.mask == 1).all()
    assert gap_full.mean().item() > 1e-2, gap_full.mean()
    if (rule, value) in (("top_p", 0.7), ("top_k", 2.0)):
        assert (full.mask == 0).float().mean().item() > 0.01


# ---- mismatch metrics ------------------------------------------------------------------------------------------


def test_mismatch_metrics_by_hand():
    """The metrics of docs/contract.md on four tokens computed by hand (one padding row)."""
    n, v = 5, 3
    logits = torch.zeros(n, v, dtype=torch.float64)  # pi = 1/3 everywhere
    tokens = torch.tensor([0, 1, 2, 0, 0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    mu = torch.tensor([1 / 3, 2 / 9, 5 / 6, 1 / 12, 0.5], dtype=torch.float64)  # pi / mu = 1, 1.5, 0.4, 4
    _, metrics = dppo_loss(logits, tokens, mu.log(), torch.ones(n, dtype=torch.float64), response_mask=mask)
    r = torch.tensor([1.0, 1.5, 0.4, 4.0], dtype=torch.float64)
    delta = r.log()
    assert metrics["mismatch_k3"].item() == pytest.approx(float((r - 1 - delta).mean()))
    assert metrics["log_ratio_min"].item() == pytest.approx(math.log(0.4))
    assert metrics["log_ratio_max"].item() == pytest.approx(math.log(4))
    assert metrics["log_ratio_outlier_frac"].item() == pytest.approx(0.5)  # 0.4 and 4 lie outside [1/2, 2]
    assert metrics["ess"].item() == pytest.approx(float(r.sum() ** 2 / (4 * (r**2).sum())))
    _, empty = dppo_loss(logits, tokens, mu.log(), torch.ones(n, dtype=torch.float64), response_mask=mask * 0)
    for key in ("mismatch_k3", "log_ratio_min", "log_ratio_max", "log_ratio_outlier_frac", "ess"):
        assert empty[key].item() == 0.0, key


# ---- vocabulary-parallel: 2 gloo processes through the real API ----------------------------------------------


@pytest.mark.slow
def test_gloo_ranks_replay_matches_single_device(tmp_path):
    """dppo_loss with vocab_parallel_group, dppo_loss_per_row on a DTensor sharded on V and fused_linear_dppo_loss
    with a sharded LM head, each with kept_ids, on 2 gloo processes (python_tests/dist_scripts/replay_worker.py)."""
    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(repo), str(repo / "python_tests"), str(repo / "python_tests/dist_scripts")]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
    )
    worker = repo / "python_tests/dist_scripts/replay_worker.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), "--out", str(tmp_path / f"rank{r}.json")],
            env=dict(env, RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    failures = [f"rank {r['rank']}: {c['name']}: {c['error']}" for r in results for c in r["checks"] if not c["ok"]]
    assert not failures, "\n".join(failures)
    assert all(len(r["checks"]) == 4 for r in results)

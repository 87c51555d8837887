"""Shared helpers of the vocabulary-parallel tests (in-process simulation and the gloo workers).

``split_offsets(v, world)`` gives uneven splits (one rank may hold a single column); ``compare_outputs`` and
``compare_grads`` check a vocab-parallel result against the single-device op on the gathered logits:
float64 to rounding (``TOL[float64]``), other dtypes by ``dppo_testing``'s rule (error against the float64
reference no worse than 2x the single-device op's own error, plus the dtype's tolerance), with mask ties
(rows within ``MASK_MARGIN`` of a threshold, where rounding may flip the decision) left out of the
loss/mask/weight comparison.
"""

from __future__ import annotations

import torch

from dppo_ext import dppo_loss_per_row
from dppo_ext.contract import accumulation_dtype
from dppo_ext.reference import OUTPUT_KEYS, dppo_loss_reference
from dppo_testing import TOL, ambiguous_rows, as_dtype, assert_no_worse, lse_rounding_allowance

DIFFERENTIABLE = ("loss", "logp", "entropy")
MASK_DEPENDENT = ("loss", "mask", "weight")


def split_offsets(v: int, world: int) -> list[int]:
    """Uneven contiguous slices of ``v >= world`` columns over ``world`` ranks: for ``world >= 3`` rank 1 holds a
    single column, rank 0 two thirds of the rest, ranks 2.. the remainder; for ``world == 2`` a 40/60 split."""
    if world == 2:
        sizes = [max(1, (v * 2) // 5), 0]
        sizes[1] = v - sizes[0]
    else:
        sizes = [1] * world
        extra = v - world
        sizes[0] += (extra * 2) // 3
        rest = extra - (extra * 2) // 3
        for r in range(2, world):
            sizes[r] += rest // (world - 2) + (1 if r - 2 < rest % (world - 2) else 0)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    assert offsets[-1] == v and all(s >= 1 for s in sizes), (v, world, sizes)
    return offsets


def place_tokens(inputs: dict, offsets: list[int]) -> dict:
    """Make row 5 + r sample the first column of rank r (and list it among its top-K ids), so every rank,
    including a one-column rank, owns a sampled token and a top-K id (rows 0-4 are sample_inputs' edge rows,
    the last two padding). Returns new inputs; unchanged when there are too few rows."""
    world = len(offsets) - 1
    n = inputs["tokens"].shape[0]
    if n < 7 + world:
        return inputs
    out = dict(inputs)
    out["tokens"] = inputs["tokens"].clone()
    for r in range(world):
        out["tokens"][5 + r] = offsets[r]
    if inputs["topk_ids"] is not None:
        out["topk_ids"] = inputs["topk_ids"].clone()
        for r in range(world):
            out["topk_ids"][5 + r, -1] = offsets[r]
    return out


def owners(ids: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The rank owning each global id."""
    bounds = torch.tensor(offsets[1:-1], dtype=torch.long)
    return torch.bucketize(ids.clamp(min=0), bounds, right=True)


def upstream(n: int, acc: torch.dtype, tie: torch.Tensor, seed: int = 11) -> dict[str, torch.Tensor]:
    """Random upstream gradients for loss, logp and entropy (0 on the loss of tied rows: a flipped mask
    changes the gradient)."""
    gen = torch.Generator().manual_seed(seed + n)
    g = {key: torch.randn(n, generator=gen, dtype=torch.float64).to(acc) for key in DIFFERENTIABLE}
    g["loss"] = torch.where(tie, torch.zeros_like(g["loss"]), g["loss"])
    return g


def weighted_sum(out: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum((out[key] * g[key].to(out[key].dtype)).sum() for key in DIFFERENTIABLE)


def single_device(inputs: dict, g: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The single-device op on the whole logits: per-row outputs and d(weighted_sum)/d logits."""
    logits = inputs["logits"].detach().clone().requires_grad_(True)
    out = dppo_loss_per_row(**dict(inputs, logits=logits))._asdict()
    weighted_sum(out, g).backward()
    return {k: v.detach() for k, v in out.items()}, logits.grad


def reference64(inputs: dict, g: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The float64 reference (reference.py) on the same, already rounded, logits."""
    kw = as_dtype(inputs, torch.float64)
    logits = kw["logits"].clone().requires_grad_(True)
    out = dppo_loss_reference(**dict(kw, logits=logits))
    weighted_sum(out, {k: v.double() for k, v in g.items()}).backward()
    return {k: v.detach() for k, v in out.items()}, logits.grad


def tie_rows(inputs: dict) -> torch.Tensor:
    kw = as_dtype(inputs, torch.float64)
    with torch.no_grad():
        return ambiguous_rows(kw, dppo_loss_reference(**kw))


def compare_outputs(name: str, inputs: dict, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Per-row outputs of the vocab-parallel op vs the single-device op (see the module docstring)."""
    dtype = inputs["logits"].dtype
    tol = TOL[dtype]
    keep = ~tie_rows(inputs)
    for key in OUTPUT_KEYS:
        a, b = got[key], want[key]
        assert a.dtype == accumulation_dtype(dtype), f"{name}: {key} dtype {a.dtype}"
        if key in MASK_DEPENDENT:
            a, b = a[keep], b[keep]
        torch.testing.assert_close(
            a,
            b,
            rtol=tol["fwd_rtol"],
            atol=tol["fwd_atol"],
            equal_nan=True,
            msg=lambda m, key=key: f"{name}: output {key}: {m}",
        )


def compare_grads(name: str, inputs: dict, g: dict[str, torch.Tensor], got: torch.Tensor, want: torch.Tensor) -> None:
    """The gathered vocab-parallel gradient vs the single-device op's (float64: to rounding; else no worse
    than 2x the single-device op's error against the float64 reference)."""
    dtype = inputs["logits"].dtype
    tol = TOL[dtype]
    assert got.shape == want.shape and got.dtype == dtype, f"{name}: grad {got.shape} {got.dtype}"
    valid = inputs["tokens"] != -100
    assert (got[~valid] == 0).all(), f"{name}: padding rows must get an exactly zero gradient"
    if dtype == torch.float64:
        torch.testing.assert_close(
            got, want, rtol=tol["grad_rtol"], atol=tol["grad_atol"], msg=lambda m: f"{name}: grad: {m}"
        )
        return
    _, grad64 = reference64(inputs, g)
    inputs64 = as_dtype(inputs, torch.float64)
    extra = lse_rounding_allowance(inputs64, g, dtype)
    assert_no_worse(f"{name}: grad", got, grad64, want, tol["grad_atol"], tol["grad_rtol"], extra=extra)

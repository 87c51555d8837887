"""Shared helpers of the dppo_ext tests: input factory, tolerance table, CUDA gating, child-process environment.

A package imported by name (pytest puts python_tests/ on the path, pyproject.toml's ``pythonpath``), so that the
test files and the scripts they start (dist_scripts/) share it; fixtures live in conftest.py.
``dppo_testing.vocab_parallel`` holds the vocabulary-parallel tests' own helpers.

``sample_inputs(device, dtype, mode, case)`` builds the op's keyword arguments for one named case
of ``CASES``: odd vocabularies and vocabularies that are not a multiple of 8, N = 0 and 1,
padding rows (token -100), tokens with pi -> 1 and pi -> 0, mu = 0 (rollout log-prob -inf),
A = 0, K = 1 and K = 64, non-contiguous logits and sizes that cross vector/block boundaries.

Tests that need a GPU carry the ``needs_cuda`` marker (registered in pyproject.toml); they skip
cleanly when torch has no CUDA device or dppo_ext was built without its CUDA kernels. Nothing here
touches ``torch.cuda`` at import time.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import pytest
import torch

from dppo_ext.contract import DEFAULT_DELTAS, MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.reference import dppo_loss_reference

# torch.distributed's launch variables: in-process trainers (TRL's vLLM colocate mode) set them in the pytest
# process, and a child process must not inherit them.
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def child_env(drop: tuple[str, ...] = (), **set_vars: str) -> dict[str, str]:
    """The environment for a subprocess that imports dppo_ext as this process does: ``os.environ`` without
    ``DIST_ENV`` and ``drop``, ``PYTHONPATH`` set to this process's ``sys.path``, then ``set_vars``."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV and k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    env.update(set_vars)
    return env


DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEVICES = ("cpu", pytest.param("cuda", marks=pytest.mark.needs_cuda))
# Thresholds per mode that give a mix of masked and kept rows on CASES (the tests would be blind
# to mask bugs if every row were kept).
DELTAS = {
    "binary_tv": (0.05, 0.08),
    "binary_kl": (0.05, 0.08),
    "topk_tv": (0.15, 0.2),
    "topk_kl": (0.2, 0.3),
    "ratio": (0.2, 0.28),
    "none": (0.2, 0.2),
}

# One tolerance table keyed by logits dtype. Forward outputs are float32 for every dtype but
# float64, so fwd tolerances only grow with the vocabulary's accumulation error; the gradient is
# in the logits dtype. For float16/bfloat16 the test also requires the op's error against the
# float64 reference to be at most 2x the error of the same-precision PyTorch path.
TOL = {
    torch.float64: {"fwd_atol": 1e-10, "fwd_rtol": 1e-9, "grad_atol": 1e-12, "grad_rtol": 1e-9},
    torch.float32: {"fwd_atol": 2e-5, "fwd_rtol": 2e-5, "grad_atol": 1e-6, "grad_rtol": 1e-4},
    torch.float16: {"fwd_atol": 2e-5, "fwd_rtol": 2e-5, "grad_atol": 1e-6, "grad_rtol": 1e-4},
    torch.bfloat16: {"fwd_atol": 2e-5, "fwd_rtol": 2e-5, "grad_atol": 1e-6, "grad_rtol": 1e-4},
}
# Relative margin within which a row's mask decision counts as a tie (rounding may flip it).
MASK_MARGIN = 1e-4


@dataclass(frozen=True)
class Case:
    """One input shape/regime. k is clamped to v."""

    n: int
    v: int
    k: int = 4
    temperature: float = 1.0
    noncontiguous: bool = False
    extreme: bool = False
    edge_rows: bool = True


CASES = {
    "n0": Case(n=0, v=7),
    "n1_v1": Case(n=1, v=1, k=1, edge_rows=False),
    "v7_k1": Case(n=9, v=7, k=1, temperature=0.7),
    "v129": Case(n=37, v=129, k=5),
    "v1000_k64": Case(n=9, v=1000, k=64, temperature=1.3),
    "v4099": Case(n=6, v=4099, k=20),
    "noncontig": Case(n=11, v=250, k=8, noncontiguous=True),
    "few_rows_big_v": Case(n=3, v=16411, k=20),
    "many_rows": Case(n=300, v=40, k=3),
    "extreme": Case(n=12, v=301, k=6, temperature=0.7, extreme=True),
}


def cuda_ready() -> tuple[bool, str]:
    """Whether the CUDA tests can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "no CUDA device visible to torch"
    from dppo_ext import _C

    if not getattr(_C, "cuda_compiled", False):
        return False, "dppo_ext was built without its CUDA kernels"
    return True, ""


def _make_logits(case: Case, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """[N, V] float64 logits: peaked random rows plus, for ``extreme``, huge/tiny/flat rows."""
    n, v = case.n, case.v
    z = torch.randn(n, v, generator=gen, dtype=torch.float64) * 3.0
    if case.extreme and n >= 6:
        huge = 1e4 if dtype == torch.float16 else 1e30
        z[0] = -huge
        z[0, 1] = huge  # one token holds all the mass
        z[1] = torch.linspace(-huge, huge, v, dtype=torch.float64)
        z[2] = 0.0  # uniform
        z[3] = 1e-30
        z[4, ::2] = 1e4
        z[5] = -1e4 if dtype == torch.float16 else -1e30  # all equal, hugely negative
    return z


def sample_inputs(
    device: str | torch.device,
    dtype: torch.dtype,
    mode: str,
    case: str = "v129",
    *,
    seed: int = 0,
    anchor: bool = False,
    requires_grad: bool = False,
) -> dict:
    """Keyword arguments of ``dppo_ext.dppo_loss_per_row`` / ``dppo_loss_reference``.

    The rollout distribution is the trainer's logits plus noise (so masks are mixed); the
    sampled tokens' rollout log-probs and the top-K come from it. Edge rows (when N >= 8): row 0
    argmax token with a dominant logit (pi -> 1), row 1 a token with pi -> 0, row 2 mu = 0
    (rollout log-prob -inf), row 3 on-policy (rollout log-prob = trainer's), row 4 A = 0, the
    last two rows padding (token -100).

    Returns a dict with logits [N, V] (``dtype``, on ``device``), tokens [N] int64,
    rollout_logprobs / advantages / anchor_logprobs [N] and topk_ids / topk_logprobs [N, K] (top-K
    modes only; None otherwise), plus mode, temperature, delta_low, delta_high, ratio_cap.
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    c = CASES[case]
    gen = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, case)))
    n, v, k, t = c.n, c.v, min(c.k, c.v), c.temperature
    acc = accumulation_dtype(dtype)

    z = _make_logits(c, dtype, gen)
    edge = c.edge_rows and n >= 8 and not c.extreme
    if edge:
        z[0, 0] = z[0].max() + 40.0 * t  # pi -> 1 for token 0
        z[1, 1] = z[1].min() - 40.0 * t  # pi -> 0 for token 1
    logits = z.to(dtype)
    z = logits.double()  # the values the op actually sees

    rollout = torch.log_softmax((z + 1.0 * torch.randn(n, v, generator=gen, dtype=torch.float64)) / t, dim=-1)
    on_policy = c.edge_rows and n >= 8
    if on_policy:
        # Row 3 is on-policy over the whole distribution, not only at its sampled token: its divergence is then
        # ~0 in every mode. (With mu(a) = pi(a) but the top-K from a noisy distribution, its top-K divergence was
        # above the thresholds while the direction test "pi below mu" stood exactly at its tie, which one ulp of
        # the op's log-prob decides differently on different hosts and paths.)
        rollout[3] = torch.log_softmax(z[3] / t, dim=-1)
    # Tokens are sampled from the rollout distribution, as a rollout engine would.
    tokens = torch.multinomial(rollout.exp(), 1, generator=gen).squeeze(1) if n else torch.zeros(0, dtype=torch.long)
    if edge:
        tokens[0], tokens[1] = 0, 1
    safe_tokens = tokens.clamp(min=0)
    rollout_logprobs = rollout.gather(1, safe_tokens[:, None]).squeeze(1)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    if on_policy:
        rollout_logprobs[2] = -math.inf
        advantages[4] = 0.0
        tokens[-2:] = -100
    if c.extreme and n >= 6:
        rollout_logprobs[:3] = -math.inf
        tokens[-1] = -100
    rollout_logprobs = rollout_logprobs.clamp(max=0.0)

    topk_ids = topk_logprobs = None
    if mode in TOPK_MODES:
        topk_logprobs, topk_ids = rollout.topk(k, dim=-1)
    anchor_logprobs = None
    if anchor:
        anchor_logprobs = (rollout_logprobs + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0.0)
        if n >= 3:
            anchor_logprobs[2] = -0.5  # anchor defined where the rollout log-prob is -inf
    delta_low, delta_high = DELTAS[mode]
    rows = dict(
        logits=z,
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        advantages=advantages,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        anchor_logprobs=anchor_logprobs,
        mode=mode,
        temperature=t,
        ratio_cap=10.0 if mode != "none" else 2.0,
    )
    designed = range(6) if c.extreme else range(4) if on_policy else range(0)
    _move_rows_off_ties(
        rows,
        rollout,
        keep=designed,
        anchor_noise=0.3,
        gen=torch.Generator().manual_seed(seed * 7919 + sum(map(ord, case)) + 1),
    )
    tokens, rollout_logprobs, topk_ids, topk_logprobs, anchor_logprobs = (
        rows[key] for key in ("tokens", "rollout_logprobs", "topk_ids", "topk_logprobs", "anchor_logprobs")
    )

    def to_dev(x: torch.Tensor | None, dt: torch.dtype | None = None) -> torch.Tensor | None:
        if x is None:
            return None
        return x.to(device=device, dtype=dt if dt is not None else x.dtype)

    logits = to_dev(logits)
    if c.noncontiguous:  # a column slice of a wider buffer: row stride V + 5, built on the device
        wide = torch.zeros(n, v + 5, dtype=dtype, device=device)
        wide[:, 2 : v + 2] = logits
        logits = wide[:, 2 : v + 2]
    if requires_grad:
        logits.requires_grad_(True)
    return {
        "logits": logits,
        "tokens": to_dev(tokens),
        "rollout_logprobs": to_dev(rollout_logprobs, acc),
        "advantages": to_dev(advantages, acc),
        "topk_ids": to_dev(topk_ids),
        "topk_logprobs": to_dev(topk_logprobs, acc),
        "anchor_logprobs": to_dev(anchor_logprobs, acc),
        "mode": mode,
        "temperature": t,
        "delta_low": delta_low,
        "delta_high": delta_high,
        "ratio_cap": 10.0 if mode != "none" else 2.0,
    }


def tie_rows_for(inputs: dict, thresholds=None, margin: float = MASK_MARGIN) -> torch.Tensor:
    """[N] bool: rows of ``inputs`` (any dtype) whose mask decision is within ``margin`` of a tie (see
    ``ambiguous_rows``) for any of ``thresholds`` (``(delta_low, delta_high)`` pairs; default: the inputs' own)."""
    kw = as_dtype(inputs, torch.float64)
    pairs = thresholds if thresholds is not None else [(inputs["delta_low"], inputs["delta_high"])]
    tie = torch.zeros(kw["tokens"].shape, dtype=torch.bool, device=kw["tokens"].device)
    for low, high in pairs:
        kw_pair = dict(kw, delta_low=low, delta_high=high)
        with torch.no_grad():
            tie |= ambiguous_rows(kw_pair, dppo_loss_reference(**kw_pair), margin)
    return tie


def assert_decisive(name: str, inputs: dict) -> None:
    """Refuse inputs of which a row's mask decision sits within rounding of a tie.

    A test that compares two paths (vocab-parallel vs single device, an aggregated loss) on such inputs would
    depend on one ulp of each path's log-prob, which differs by host (torch's kernels round differently under
    AVX2 and AVX-512): it must move the row off the tie, or state what both outcomes mean.
    """
    tie = tie_rows_for(inputs)
    if tie.any():
        raise AssertionError(
            f"{name}: rows {tie.nonzero().flatten().tolist()} decide their mask at a tie "
            f"(within {MASK_MARGIN} relative of a threshold or of pi = mu); move them off it"
        )


def _move_rows_off_ties(
    rows: dict, rollout: torch.Tensor, keep: range, anchor_noise: float, gen: torch.Generator
) -> None:
    """Redraw the rollout distribution (sampled token, log-probs, top-K, anchor) of every row whose mask decision
    sits at a tie for the mode's test thresholds (``DELTAS``) or its defaults (``DEFAULT_DELTAS``), until none
    does. Rows in ``keep`` are designed edge rows and are left as they are (``test_sample_inputs_are_decisive``
    checks that they are decisive anyway). ``rows`` is updated in place; ``rollout`` [N, V] float64."""
    mode, t = rows["mode"], rows["temperature"]
    z = rows["logits"]
    pairs = [DELTAS[mode], DEFAULT_DELTAS[mode]]
    designed = torch.zeros(z.shape[0], dtype=torch.bool)
    designed[list(keep)] = True
    for _ in range(20):
        redo = tie_rows_for(dict(rows, delta_low=0.0, delta_high=0.0), pairs) & ~designed
        if not redo.any():
            return
        for i in redo.nonzero().flatten().tolist():
            rollout[i] = torch.log_softmax((z[i] + torch.randn(z.shape[1], generator=gen, dtype=torch.float64)) / t, -1)
            token = int(torch.multinomial(rollout[i].exp(), 1, generator=gen))
            rows["tokens"][i] = token
            rows["rollout_logprobs"][i] = rollout[i, token].clamp(max=0.0)
            if rows["topk_ids"] is not None:
                rows["topk_logprobs"][i], rows["topk_ids"][i] = rollout[i].topk(rows["topk_ids"].shape[1])
            if rows["anchor_logprobs"] is not None:
                noise = anchor_noise * torch.randn((), generator=gen, dtype=torch.float64)
                rows["anchor_logprobs"][i] = (rows["rollout_logprobs"][i] + noise).clamp(max=0.0)
    raise AssertionError(f"sample_inputs: rows {redo.nonzero().flatten().tolist()} stay at a tie")


def as_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    """The same inputs with logits (detached) and per-row floats in another precision."""
    acc = accumulation_dtype(dtype)
    out = dict(inputs)
    out["logits"] = inputs["logits"].detach().to(dtype)
    for key in ("rollout_logprobs", "advantages", "topk_logprobs", "anchor_logprobs"):
        if inputs[key] is not None:
            out[key] = inputs[key].to(acc)
    return out


def ambiguous_rows(inputs: dict, ref: dict, margin: float = MASK_MARGIN) -> torch.Tensor:
    """[N] bool: rows whose mask decision is within ``margin`` of a tie in ``ref`` (float64).

    Rounding in another precision may legitimately flip such a row's mask, so tests leave their
    loss and mask out of exact comparisons (there are few of them; none in most cases).
    """
    mode = inputs["mode"]
    lp = ref["logp"].double()
    la = inputs["anchor_logprobs"] if inputs["anchor_logprobs"] is not None else inputs["rollout_logprobs"]
    la = la.double()
    d = ref["divergence"].double()
    dl, dh = inputs["delta_low"], inputs["delta_high"]
    valid = inputs["tokens"] != -100

    def near(x: torch.Tensor, y: float | torch.Tensor) -> torch.Tensor:
        y = torch.as_tensor(y, dtype=torch.float64, device=x.device)
        return (x - y).abs() <= margin * torch.maximum(x.abs(), y.abs()) + 1e-300

    if mode == "none":
        amb = torch.zeros_like(valid)
    elif mode == "ratio":
        amb = near(d, 1 + dh) | near(d, 1 - dl)
    else:
        pi, mu = lp.exp(), la.exp()
        tie_dir = ((pi - mu).abs() <= margin * torch.maximum(pi, mu)) & (torch.maximum(pi, mu) > 0)
        amb = near(d, dh) | near(d, dl) | (tie_dir & (d > min(dl, dh) * (1 - margin)))
    return amb & valid


def reference_outputs(inputs: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``dppo_loss_reference`` on ``inputs`` (optionally re-cast to ``dtype`` first), no grad."""
    kw = as_dtype(inputs, dtype) if dtype is not None else dict(inputs)
    with torch.no_grad():
        return dppo_loss_reference(**kw)


def assert_no_worse(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    base: torch.Tensor,
    atol: float,
    rtol: float,
    select: torch.Tensor | None = None,
    extra: torch.Tensor | None = None,
) -> None:
    """|got - want| <= 2 * max|base - want| + atol + rtol * |want| (+ extra) elementwise (on ``select``).

    ``want`` is the float64 reference, ``base`` the same-precision PyTorch path. Equal values
    (including equal infinities) count as exact.
    """
    got, want, base = got.double(), want.double(), base.double()
    extra = torch.zeros_like(want) if extra is None else extra.double().expand_as(want)
    if select is not None:
        got, want, base, extra = got[select], want[select], base[select], extra[select]
    if got.numel() == 0:
        return
    assert not torch.isnan(got).any(), (
        f"{name}: NaN in the op's output at rows {torch.isnan(got).nonzero().flatten().tolist()}"
    )
    err = torch.where(got == want, torch.zeros_like(got), (got - want).abs())
    base_err = torch.where(base == want, torch.zeros_like(base), (base - want).abs())
    finite = torch.isfinite(base_err)
    base_worst = base_err[finite].amax() if finite.any() else base_err.new_zeros(())
    bound = 2 * base_worst + atol + rtol * want.abs() + extra
    bad = ~(err <= bound)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off; first at flat {i}: op={got.flatten()[i].item()!r} "
            f"ref64={want.flatten()[i].item()!r} same-precision ref={base.flatten()[i].item()!r}; "
            f"max err {err.max().item():.3e}, same-precision max err {base_worst.item():.3e}"
        )


def lse_rounding_allowance(inputs64: dict, upstream: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[N, 1] extra gradient error that the contract itself implies for logits of ``dtype``.

    The backward recomputes p = exp(s - lse) from lse stored in the accumulation dtype, so every
    p (and log p) of row i carries an error up to eps * |lse_i| (relative; about 1e-3 at
    |logits| ~ 1e4 in float32). Row i's gradient is (g_t (1[j=a] - p) - g_h p (log p + H)) / T
    with g_t = g_loss * coef + g_logp, so that error is bounded by
    eps * |lse_i| * (|g_t| + |g_h| (2 + H)) / T; twice that is allowed.
    """
    with torch.no_grad():
        ref = dppo_loss_reference(**inputs64)
    coef = -inputs64["advantages"] * ref["weight"] * ref["mask"]
    g = {key: value.double().to(coef.device) for key, value in upstream.items()}
    g_t = g["loss"] * coef + g["logp"]
    g_h = g["entropy"] if inputs64.get("compute_entropy", True) else torch.zeros_like(g_t)
    scale = (g_t.abs() + g_h.abs() * (2 + ref["entropy"])) / inputs64["temperature"]
    eps = torch.finfo(accumulation_dtype(dtype)).eps
    return (2 * eps * ref["lse"].abs() * scale)[:, None]


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at ``|x|`` (8 significant bits): ``2^(floor(log2 |x|) - 7)``."""
    mag = x.abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def bf16_rounding_bound(exact: torch.Tensor) -> torch.Tensor:
    """How far a bf16 result may be from ``exact`` when it is computed in float32 and rounded once to bf16.

    Rounding to nearest bf16 is off by at most half the bf16 spacing at ``|exact|`` (:func:`bf16_ulp`). The float32
    work before that rounding (a softmax over V terms, the weight, the aggregation's scale) is off by a few hundred
    float32 units ``2^-24`` at most; that error may move a value to the other side of a rounding midpoint, so it is
    added, with room: ``2^-16 |exact|``. One bf16 step more (an extra rounding of an intermediate to bf16, as bf16
    log-probs cause) breaks the bound.
    """
    return bf16_ulp(exact) / 2 + 2.0**-16 * exact.abs()

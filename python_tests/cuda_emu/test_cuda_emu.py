"""The CUDA kernels, run on the CPU by the emulator, against the float64 reference.

The CUDA ops' bodies and kernels (csrc/cuda/entry_points.cuh and the headers it includes) are compiled
unchanged against python_tests/cuda_emu/cuda_emu.h (emu_build.py) and registered as
torch.ops.dppo_cuda_emu.*; every forward output, the backward and the in-place backward are compared with
dppo_ext.reference in float64 (the gradient with the contract's formula in float64 given the kernel's lse
and entropy), within bounds derived from the precision (forward_tol, grad_bound: the accumulation dtype's
roundoff times the terms a thread sums and the merge depth; half an ulp of the gradient's dtype), exactly
where both sides are exact (padding rows, zero gradients). The grid covers every pair of values of: dtype
(fp32, fp16, bf16, fp64), V (1, 3, 7, 41, 1000, 4099, 33000), layout (contiguous rows, or rows at a stride
that misaligns their starts, with NaN in the gaps, checked untouched), mode (all six), K (1, 5, 64, 300;
top-K modes), entropy on/off, anchor log-probs, logits near 1e30, and the blocks per row (the launch policy,
or the override DPPO_CUDA_SPLIT = 1, 2, 3, 7, 100, 150: empty splits, more splits than finishing threads).
Every case has padding rows, a token with pi -> 1 and one with pi -> 0, a row with mu = 0 and a row with
-inf logits mixed with finite ones inside 16-byte vectors. Beyond the pairs: the vector loops ending in
every quarter of their unrolled round (one-block and split rows, fp32 and bf16), and row offsets past 2^31
elements (a strided view of a 6.4 GB buffer that is never touched beyond its rows).

The vocabulary-parallel kernels (csrc/cuda/vocab_parallel_kernels.cuh) run as W simulated ranks: the
emulated stats kernel on each rank's column slice (uneven splits, W = 1, 2, 3; a slice wider than the
256-thread block), stacked, then the emulated epilogue; against the float64 reference and against the CPU
ops torch.ops.dppo.dppo_vocab_parallel_* (every rank's statistics and the merged outputs) for every mode x
dtype x entropy x W, with padding rows, tokens and top-K ids on every rank and on slice boundaries; plus
NaN / +inf / all -inf rows and slices, N = 0, more rows than one epilogue block, and the launch shape.

Selected by DPPO_CUDA_EMU (skipped when unset: the build takes a minute or more):
  fiber  the whole grid, fibers (plain -O1 build)
  asan   a subset under AddressSanitizer, fibers (run through run.py, which preloads libasan)
  tsan   a small subset under ThreadSanitizer, one OS thread per CUDA thread (run.py preloads libtsan)
  traffic  the global-memory traffic of every kernel (the test_traffic_* tests, a build that counts every
           load and store): each kernel moves the minimum, and benchmarks/results/cuda_traffic.json holds
           the bytes per logit the GPU benchmark predicts its times from
DPPO_CUDA_EMU_CSRC compiles another csrc tree (the mutation check's mutants; DPPO_CUDA_EMU_OUT: its
build folder), DPPO_CUDA_EMU_CASES keeps every n-th case, DPPO_CUDA_EMU_SEED seeds the block-order shuffle.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from dppo_testing.vocab_parallel import split_offsets  # uneven splits; at W = 3 rank 1 holds a single column

import dppo_ext.ops  # noqa: F401  (loads the native library: registers torch.ops.dppo, the CPU ops compared with)
from dppo_ext.contract import TOPK_MODES
from dppo_ext.reference import dppo_loss_reference, kept_set_mask

sys.path.insert(0, str(Path(__file__).resolve().parent))
import emu_build  # noqa: E402

VARIANT = os.environ.get("DPPO_CUDA_EMU", "")
pytestmark = pytest.mark.skipif(
    VARIANT not in ("fiber", "asan", "tsan", "traffic"),
    reason="the emulated CUDA kernels run with DPPO_CUDA_EMU=fiber|asan|tsan|traffic (python_tests/cuda_emu/run.py)",
)

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "ratio", "none")
NAMES = ("loss", "logp", "divergence", "mask", "weight", "entropy", "lse")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DELTA_LOW, DELTA_HIGH, RATIO_CAP, TEMPERATURE = 0.2, 0.3, 10.0, 0.7
N_ROWS = 7
THREADS = 256  # threads per row block of the forward and backward kernels (csrc/cuda/launch_policy.cuh)

# ---- tolerances, derived from the precision ----------------------------------------------------------------
# Unit roundoff (half an ulp, relative) of the accumulation dtype (float, or double for fp64 logits) and of the
# dtype a gradient is stored in, and half the smallest subnormal step of the latter (where rounding is absolute).
U_ACC = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}
U_OUT = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
TINY_OUT = {torch.float32: 2.0**-150, torch.float16: 2.0**-25, torch.bfloat16: 2.0**-134, torch.float64: 0.0}
# Shifted logits x = s - max further below 0 than this weigh less than float's roundoff in a row's sums.
X_SPAN = 20.0


def acc_of(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def forward_tol(logits: torch.Tensor, lanes: int) -> torch.Tensor:
    """[N] bound on |kernel - float64 reference| / (1 + |reference|) for every forward output of each row.

    Each CUDA thread sums exp(s - max) over its share of a row in the accumulation dtype, one rounding per
    term (at most ceil(V / lanes) terms, lanes = threads x blocks per row), then the thread states are merged
    along a tree of depth log2(lanes), about three roundings per merge. The kernel scales by fl(1 / T), not
    1 / T, and rounds s = z * fl(1 / T) and s - max, which moves each term's exponent by up to 2 u |s| and
    (the error of fl(1 / T)) |x| delta_T, |x| <= X_SPAN for the terms that count. The rows' huge constants
    (1e30, 3e4) are exact ties with their own max, so |s| is taken over the random part of a row only. The
    float64 reference's own sums add (log2 V + 10) double roundings. Every output is a few operations away
    from these sums: the bound is four times their sum."""
    acc = acc_of(logits.dtype)
    u = U_ACC[acc]
    n, v = logits.shape
    z = logits.double()
    random_part = z.isfinite() & (z.abs() < 1e3)
    s_max = torch.where(random_part, z.abs(), torch.zeros_like(z)).amax(dim=1) / TEMPERATURE
    delta_t = abs(float(torch.tensor(1.0 / TEMPERATURE, dtype=acc)) * TEMPERATURE - 1.0)
    terms = math.ceil(v / lanes) + 3 * math.ceil(math.log2(lanes))
    reference = 2.0**-53 * (math.log2(v) + 10)
    return 4.0 * (u * (terms + 2.0 * s_max) + X_SPAN * delta_t + reference)


def grad_bound(
    want: torch.Tensor,
    logits: torch.Tensor,
    tokens: torch.Tensor,
    gt: torch.Tensor,
    gh: torch.Tensor | None,
    lse: torch.Tensor,
    ent: torch.Tensor | None,
    kept_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[N, V] bound on |kernel - float64 formula| for each gradient element, given the kernel's own lse and
    entropy (the formula is evaluated from the same s = z * fl(1 / T) and lse, see reference_grad).

    With l = s - lse and p = exp(l): the kernel rounds l (u |l|), exp (u), the products and the sum (a few u),
    so a term g_t p carries 4 u (2 + |l|) of relative error, the entropy term g_h p (l + H) as much plus
    2 u (1 + |l| + |H|) |g_h| p from the rounding of l + H, and the target's g_t (1 - p) (expm1 form) 2 u.
    The result is then rounded to the logits dtype: half an ulp of it, or half a subnormal step."""
    acc = lse.dtype
    u = U_ACC[acc]
    s = (logits.to(acc) * torch.tensor(1.0 / TEMPERATURE, dtype=torch.float64).to(acc)).double()
    lg = s - lse.double()[:, None]
    p = kept_probs(torch.exp(lg), kept_ids)
    live = p > 0
    labs = torch.where(live, lg.abs(), torch.zeros_like(lg))
    p = torch.where(live, p, torch.zeros_like(p))
    valid = tokens >= 0
    onehot = torch.zeros_like(s)
    onehot[valid, tokens[valid]] = 1.0
    term = gt.double().abs()[:, None] * (p * (2.0 + labs) + 2.0 * onehot)
    if gh is not None:
        h = ent.double()[:, None]
        lh = torch.where(live, (lg + h).abs(), torch.zeros_like(lg))
        term = term + gh.double().abs()[:, None] * p * ((2.0 + labs) * lh + 2.0 * (1.0 + labs + h.abs()))
    term = torch.where(valid[:, None], term, torch.zeros_like(term))
    return U_OUT[logits.dtype] * want.abs() + TINY_OUT[logits.dtype] + 4.0 * u * term / TEMPERATURE


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    v: int
    strided: bool
    mode: str
    k: int
    entropy: bool
    anchor: bool
    split: int | None  # None: the launch policy
    extreme: bool
    n: int = N_ROWS
    kept: bool = False  # sampling replay: a kept set per row (kept_ids)
    direction: str = "advantage"  # the mask direction (docs/contract.md, "Mask")

    @property
    def id(self) -> str:
        topk = f"-k{self.k}" if self.mode in TOPK_MODES else ""
        return (
            f"{str(self.dtype)[6:]}-v{self.v}-{'strided' if self.strided else 'contig'}-{self.mode}{topk}"
            f"-ent{int(self.entropy)}-anc{int(self.anchor)}-split{self.split or 'auto'}"
            f"{'-huge' if self.extreme else ''}{f'-n{self.n}' if self.n != N_ROWS else ''}"
            f"{'-kept' if self.kept else ''}{'-sym' if self.direction == 'symmetric' else ''}"
        )


DIMS = {
    "dtype": DTYPES,
    "v": (1, 3, 7, 41, 1000, 4099, 33000),
    "strided": (False, True),
    "mode": MODES,
    "k": (1, 5, 64, 300),
    "entropy": (True, False),
    "anchor": (False, True),
    "split": (None, 1, 2, 3, 7, 100, 150),
    "extreme": (False, True),
    "kept": (False, True),
    "direction": ("advantage", "symmetric"),
}


def _valid(row: dict) -> bool:
    """Top-K needs K <= V and V >= 2 (at K = V = 1 the rest mass cancels in float, nothing to compare)."""
    if "mode" in row and row["mode"] in TOPK_MODES and "v" in row:
        if row["v"] < 2 or ("k" in row and row["k"] > row["v"]):
            return False
    return True


def _counts(a: str, b: str, row: dict) -> bool:
    """Whether a row's values of dimensions a and b count as a covered pair (K only in top-K rows)."""
    return "k" not in (a, b) or row["mode"] in TOPK_MODES


def pairwise_grid(seed: int = 0) -> list[Case]:
    """A greedy all-pairs covering of DIMS under _valid: every pair of values of two dimensions
    that some valid case can hold is held by at least one case. Deterministic."""
    rng = random.Random(seed)
    names = list(DIMS)
    triples = [dict(mode=m, k=k, v=v) for m, k, v in itertools.product(DIMS["mode"], DIMS["k"], DIMS["v"])]
    triples = [t for t in triples if _valid(t)]
    needed = set()
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(DIMS[a], DIMS[b]):
            if any(t.get(a, va) == va and t.get(b, vb) == vb and _counts(a, b, {**t, a: va, b: vb}) for t in triples):
                needed.add(((a, va), (b, vb)))

    def gain(row: dict) -> int:
        keys = [d for d in names if d in row]
        return sum(
            ((a, row[a]), (b, row[b])) in needed
            for a, b in itertools.combinations(keys, 2)
            if "mode" not in row or _counts(a, b, row)
        )

    rows = []
    while needed:
        pool = sorted(needed, key=repr)
        best, best_gain = None, 0
        for _ in range(12):
            (a, va), (b, vb) = rng.choice(pool)
            row = {a: va, b: vb}
            for d in rng.sample(names, len(names)):
                if d not in row:
                    options = [v for v in DIMS[d] if _valid({**row, d: v})]
                    row[d] = max(options, key=lambda v: (gain({**row, d: v}), rng.random()))
            if _valid(row) and gain(row) > best_gain:
                best, best_gain = row, gain(row)
        needed -= {((a, best[a]), (b, best[b])) for a, b in itertools.combinations(names, 2) if _counts(a, b, best)}
        rows.append(best)
    return [Case(**r) for r in rows]


# Targeted cases beyond the pairs: the top-K epilogue's precision (K = 300, pi -> 1), the largest
# vocabulary with the most splits in every dtype, and a row split 10 ways (shares of 825 fp32 vectors,
# in the last quarter of the unrolled loop's 1024: one vector read twice there is a 9e-5 error).
EXTRA = [
    Case(torch.float32, 33000, False, "binary_tv", 1, True, False, 10, False),
    Case(torch.float32, 4099, False, "topk_kl", 300, True, False, None, False),
    Case(torch.float32, 33000, True, "topk_tv", 300, True, True, 150, True),
    Case(torch.bfloat16, 33000, True, "binary_kl", 64, True, False, 150, False),
    Case(torch.float16, 33000, False, "ratio", 5, False, True, 100, True),
    Case(torch.float64, 33000, True, "none", 5, True, False, 7, True),
    # sampling replay with a kept set wider than a block's threads (S = 300 > 256) and the top-K's rest over it
    Case(torch.float32, 4099, True, "topk_kl", 64, True, False, 3, False, kept=True),
]
# Batches of 2 and 3 rows (make_inputs' first rows: mu = 0, pi -> 1, padding), where a bug tied to the row count
# or to a row's neighbours is not diluted among seven rows: every dtype, contiguous and strided, one block per
# row, the policy's split and a forced one.
EXTRA += [
    Case(dtype, v, strided, mode, 5, True, anchor, split, extreme, n)
    for n in (2, 3)
    for dtype, v, strided, mode, anchor, split, extreme in (
        (torch.float32, 4099, False, "binary_tv", False, None, True),
        (torch.bfloat16, 1000, True, "topk_kl", True, 1, False),
        (torch.float16, 33000, True, "binary_kl", False, None, False),
        (torch.float64, 41, False, "topk_tv", True, 3, True),
        (torch.float32, 33000, True, "ratio", False, 2, False),
    )
]

# Built only when the emulator runs (the greedy covering costs ~0.5 s of collection time).
GRID = pairwise_grid() + EXTRA if VARIANT else []
ASAN_CASES = [c for c in GRID if c.v in (3, 41, 1000, 4099) and c.split != 100]
# ThreadSanitizer sees the shared-memory reductions of the forward kernels (block_reduce_state,
# block_sum_topk) in the one-block-per-row, split and finishing kernels; an OS thread per CUDA
# thread under TSan is slow, so few blocks.
TSAN_CASES = [
    Case(torch.float32, 1000, True, "topk_kl", 64, True, False, 2, False),
    Case(torch.bfloat16, 41, False, "binary_kl", 5, False, True, 1, False),
    # the replay backward's barrier between the row's zeros and the kept values
    Case(torch.float32, 1000, False, "binary_tv", 5, True, False, 1, False, kept=True),
]
# The other tests check host-side logic and the CUDA epilogue: the fiber and ASan runs cover them.
not_tsan = pytest.mark.skipif(VARIANT == "tsan", reason="covered by the fiber and ASan runs")
# Large inputs (long rows, a 6 GB address range, hundreds of blocks): the fiber run only.
fiber_only = pytest.mark.skipif(VARIANT != "fiber", reason="large inputs: the fiber run only")


def selected_cases() -> list[Case]:
    cases = {"asan": ASAN_CASES, "tsan": TSAN_CASES, "traffic": []}.get(VARIANT, GRID)
    every = int(os.environ.get("DPPO_CUDA_EMU_CASES", "1"))
    return cases[::every]


@pytest.fixture(scope="module")
def emu():
    variant = {"fiber": "plain", "asan": "asan", "tsan": "tsan", "traffic": "traffic"}[VARIANT]
    csrc, out = os.environ.get("DPPO_CUDA_EMU_CSRC"), os.environ.get("DPPO_CUDA_EMU_OUT")
    ops = emu_build.load(variant, Path(csrc) if csrc else None, Path(out) if out else None)
    ops.configure("thread" if VARIANT == "tsan" else "fiber", 132, int(os.environ.get("DPPO_CUDA_EMU_SEED", "0")), 60.0)
    return ops


@pytest.fixture
def split_env(monkeypatch):
    def set_split(split: int | None) -> None:
        if split is None:
            monkeypatch.delenv("DPPO_CUDA_SPLIT", raising=False)
        else:
            monkeypatch.setenv("DPPO_CUDA_SPLIT", str(split))

    return set_split


def make_inputs(c: Case, seed: int) -> dict:
    """CPU inputs for one case. The logits are an [N, V] view of a NaN-filled buffer: at column 0
    of [N, V] (contiguous), or at an odd column of [N, V + 5] rows (each row's start misaligned
    for 16-byte vectors, NaN gaps between rows). Rows: 0 mu = 0, 1 pi -> 1, 2 padding, 3 pi -> 0,
    6 -inf logits inside vectors; with `extreme`, 0, 4 and 5 hold logits of 1e30 (3e4 in fp16). A batch of
    fewer rows (c.n) keeps the roles of the rows it has."""
    g = torch.Generator().manual_seed(seed)
    n, v = c.n, c.v
    acc = torch.float64 if c.dtype == torch.float64 else torch.float32
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * 3.0
    tokens = torch.randint(0, v, (n,), generator=g)
    if n > 2:
        tokens[2] = -100  # padding row
    z[1, tokens[1]] = z[1].max() + 30.0  # pi -> 1
    if v > 1 and n > 3:
        z[3, tokens[3]] = z[3].min() - 30.0  # pi -> 0
    if v > 1 and n > 6:
        # -inf mixed with finite logits inside the same 16-byte vectors: every third column (a padded or
        # top-p filtered vocabulary), then most of the second half (top-k filtered), never the target.
        cols = torch.arange(v)
        neg = (cols % 3 == 1) | ((cols >= v // 2) & (cols % 7 != 0))
        neg[tokens[6]] = False
        z[6, neg] = -math.inf
    if c.extreme:
        huge = 3e4 if c.dtype == torch.float16 else 1e30
        if n > 5:
            z[4, tokens[4]] = huge  # all the mass on the target
            z[5] = -huge  # a flat, hugely negative row
            z[5, (int(tokens[5]) + 1) % v] = huge
        z[0, ::2] = huge / 2  # half the row tied at a huge value
    col_off, width = (3, v + 5) if c.strided else (0, v)
    buf = torch.full((n, width), math.nan, dtype=c.dtype)
    buf[:, col_off : col_off + v] = z.to(c.dtype)
    k = min(c.k, v)
    noisy = z + torch.randn(n, v, generator=g, dtype=torch.float64)
    kept_ids = None
    if c.kept:
        # Each row's kept set: its token and up to S - 1 random others (S = 300 when the top-K is that wide, to
        # cross a block's 256 threads; else 9), in random columns among -1 padding; the padding row's set holds
        # ids out of range and repeated (never read). The rollout's distribution is renormalised over the set.
        width = min(v, 300 if c.k == 300 else 9)
        kept_ids = torch.full((n, width), -1, dtype=torch.long)
        keep = torch.zeros(n, v, dtype=torch.bool)
        for i in range(n):
            a = int(tokens[i]) if tokens[i] >= 0 else 0
            others = [j for j in torch.randperm(v, generator=g).tolist() if j != a]
            size = int(torch.randint(1, width + 1, (1,), generator=g))
            ids = torch.tensor([a, *others[: size - 1]], dtype=torch.long)
            slots = torch.randperm(width, generator=g)[:size]
            kept_ids[i, slots] = ids
            keep[i, ids] = True
        if n > 2:
            kept_ids[2, 0] = v + 3
            kept_ids[2, -1] = kept_ids[2, 0]
        noisy = noisy.masked_fill(~keep, -math.inf)
    rollout = torch.log_softmax(noisy, dim=-1)
    topk_lp, topk_ids = rollout.topk(k, dim=-1)
    roll_lp = rollout.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    roll_lp[0] = -math.inf  # mu = 0
    anchor = (roll_lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    anchor[0] = -0.5
    return dict(
        buf=buf,
        col_off=col_off,
        v=v,
        tokens=tokens,
        rollout=roll_lp.to(acc),
        adv=torch.randn(n, generator=g, dtype=torch.float64).to(acc),
        topk_ids=topk_ids,
        topk_lp=topk_lp.to(acc),
        anchor=anchor.to(acc),
        kept_ids=kept_ids,
    )


def logits_of(x: dict, buf: torch.Tensor | None = None) -> torch.Tensor:
    buf = x["buf"] if buf is None else buf
    return buf[:, x["col_off"] : x["col_off"] + x["v"]]


def op_args(x: dict, c: Case) -> tuple:
    topk = c.mode in TOPK_MODES
    return (
        logits_of(x),
        x["tokens"],
        x["rollout"],
        x["adv"],
        x["topk_ids"] if topk else None,
        x["topk_lp"] if topk else None,
        x["anchor"] if c.anchor else None,
        c.mode,
        TEMPERATURE,
        DELTA_LOW,
        DELTA_HIGH,
        RATIO_CAP,
        c.entropy,
        x["kept_ids"],
        c.direction,
    )


def reference_forward(x: dict, c: Case) -> tuple:
    topk = c.mode in TOPK_MODES
    out = dppo_loss_reference(
        logits_of(x).double(),
        x["tokens"],
        x["rollout"].double(),
        x["adv"].double(),
        topk_ids=x["topk_ids"] if topk else None,
        topk_logprobs=x["topk_lp"].double() if topk else None,
        anchor_logprobs=x["anchor"].double() if c.anchor else None,
        mode=c.mode,
        temperature=TEMPERATURE,
        delta_low=DELTA_LOW,
        delta_high=DELTA_HIGH,
        ratio_cap=RATIO_CAP,
        compute_entropy=c.entropy,
        kept_ids=x["kept_ids"],
        mask_direction=c.direction,
    )
    return tuple(out[name].detach() for name in NAMES)


def kept_probs(p: torch.Tensor, kept_ids: torch.Tensor | None) -> torch.Tensor:
    """p with every column outside its row's kept set zeroed (sampling replay; unchanged without kept_ids)."""
    if kept_ids is None:
        return p
    return torch.where(kept_set_mask(kept_ids, p.shape[1]), p, torch.zeros_like(p))


def reference_grad(logits, tokens, gt, gh, lse, ent, kept_ids=None) -> torch.Tensor:
    """[N, V] float64: (g_t (1[j = a] - p) - g_h p (log p + H)) / T from the lse and entropy the
    kernel was given, with s = z * (1 / T) rounded to the accumulation dtype as the kernel forms it
    (so s - lse is exactly 0 where the kernel's is, even for logits of 1e30); with kept_ids, p is 0 outside
    each row's kept set (lse is then the kept set's)."""
    acc = lse.dtype
    s = (logits.to(acc) * torch.tensor(1.0 / TEMPERATURE, dtype=torch.float64).to(acc)).double()
    logp = s - lse.double()[:, None]
    p = kept_probs(torch.exp(logp), kept_ids)
    valid = tokens >= 0
    onehot = torch.zeros_like(s)
    onehot[valid, tokens[valid]] = 1.0
    g = gt.double()[:, None] * (onehot - p)
    if gh is not None:
        g = g - gh.double()[:, None] * torch.where(p > 0, p * (logp + ent.double()[:, None]), torch.zeros_like(p))
    return torch.where(valid[:, None], g / TEMPERATURE, torch.zeros_like(g))


def check_close(tag: str, got: torch.Tensor, want: torch.Tensor, tol, skip: torch.Tensor | None = None) -> None:
    """|got - want| <= tol * (1 + |want|) elementwise (tol a number or one per row), equal infinities
    allowed; where want is exactly 0 (padding rows) that is a bound of tol."""
    got, want = got.double(), want.double()
    tol = torch.as_tensor(tol, dtype=torch.float64)
    if tol.dim() == 1 and got.dim() > 1:
        tol = tol.view(-1, *([1] * (got.dim() - 1)))
    bad = ~((got - want).abs() <= tol * (1.0 + want.abs()))
    bad &= ~(got.isinf() & want.isinf() & (got.sign() == want.sign()))
    if skip is not None:
        bad &= ~skip
    assert not bad.any(), (
        f"{tag}: {int(bad.sum())}/{bad.numel()} off, rows {bad.nonzero().flatten().tolist()[:8]}: "
        f"kernel {got[bad][:4].tolist()} exact {want[bad][:4].tolist()}"
    )


def check_forward(
    tag: str, out: tuple, want: tuple, mu_lp: torch.Tensor, tol, tokens: torch.Tensor | None = None
) -> None:
    """The seven forward outputs against `want` (the reference's, or another kernel's): each within `tol`
    (forward_tol), except the loss and mask of rows whose mask flipped, and a mask may flip only where the
    divergence (or pi - mu) sits on a threshold. Padding rows (tokens -100) must be exactly 0."""
    div, pi = want[2].double(), want[1].double().exp()
    mu = mu_lp.double().exp()
    flipped = out[3].double() != want[3].double()
    near = (pi - mu).abs() < 1e-5
    for t in (DELTA_LOW, DELTA_HIGH, 1 - DELTA_LOW, 1 + DELTA_HIGH):
        near |= (div - t).abs() < 1e-3
    assert not (flipped & ~near).any(), (
        f"{tag}: mask differs away from a threshold at rows {flipped.nonzero().flatten().tolist()}"
    )
    if tokens is not None:
        pad = tokens == -100
        for name, got in zip(NAMES, out):
            assert (got[pad] == 0).all(), f"{tag} {name}: padding rows are not exactly 0: {got[pad].tolist()}"
    for name, got, exact in zip(NAMES, out, want):
        check_close(f"{tag} {name}", got, exact, tol, flipped if name in ("loss", "mask") else None)


def check_grad(tag: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element within its grad_bound (exactly 0 where the formula is: padding rows, p = 0)."""
    got = got.double()
    err = (got - want).abs()
    bad = ~(err <= bound)
    assert not bad.any(), (
        f"{tag}: {int(bad.sum())} off, first at {bad.nonzero()[0].tolist()}: "
        f"kernel {got[bad][:4].tolist()} exact {want[bad][:4].tolist()} "
        f"bound {bound[bad][:4].tolist()}"
    )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def forward_lanes(emu, n: int) -> int:
    """Threads per row of the forward the emulator just ran (its launch counters, reset before the call):
    one launch of N blocks, or the split forward's N x S partial blocks plus N finishing blocks."""
    launches, blocks = emu.stats(True)[:2]
    return THREADS if launches == 1 else THREADS * ((blocks - n) // n)


def check_case(emu, x: dict, case: Case, fresh=None) -> None:
    """Forward, backward and in-place backward (with and, when the entropy is on, without the entropy
    gradient) of one case's inputs against the float64 reference and formula. `fresh()` writes the original
    logits back into x["buf"] itself and returns it, for an in-place run on that very buffer (default: the
    in-place runs get a clone of x["buf"])."""
    n = x["tokens"].shape[0]
    untouched = x["buf"].clone()
    emu.stats(True)
    out = emu.dppo_loss_forward(*op_args(x, case))
    lanes = forward_lanes(emu, n)
    assert same_bits(x["buf"], untouched), "the forward wrote into its logits"
    want = reference_forward(x, case)
    tol = forward_tol(logits_of(x), lanes)
    check_forward("forward", out, want, x["anchor"] if case.anchor else x["rollout"], tol, x["tokens"])

    acc = out[0].dtype
    g = torch.Generator().manual_seed(7)
    gt = torch.randn(n, generator=g, dtype=torch.float64).to(acc)
    gh = (torch.randn(n, generator=g, dtype=torch.float64) * 0.3).to(acc)
    lse, ent = out[6], out[5]
    for with_ent in (False, True) if case.entropy else (False,):
        if fresh is not None:
            fresh()  # the previous in-place run overwrote x["buf"]
        ghg, eg = (gh, ent) if with_ent else (None, None)
        kept = x["kept_ids"]
        want_g = reference_grad(logits_of(x), x["tokens"], gt, ghg, lse, eg, kept)
        bound = grad_bound(want_g, logits_of(x), x["tokens"], gt, ghg, lse, eg, kept)
        grad = emu.dppo_loss_backward(gt, ghg, logits_of(x), x["tokens"], lse, eg, TEMPERATURE, kept)
        assert same_bits(x["buf"], untouched), "the backward wrote into its logits"
        check_grad(f"backward entropy_grad={with_ent}", grad, want_g, bound)
        buf2 = fresh() if fresh is not None else x["buf"].clone()
        emu.dppo_loss_backward_(gt, ghg, logits_of(x, buf2), x["tokens"], lse, eg, TEMPERATURE, kept)
        check_grad(f"in-place backward entropy_grad={with_ent}", logits_of(x, buf2), want_g, bound)
        outside = torch.ones(buf2.shape, dtype=torch.bool)
        outside[:, x["col_off"] : x["col_off"] + x["v"]] = False
        assert same_bits(buf2[outside], untouched[outside]), "the in-place backward wrote into the gaps between rows"


@pytest.mark.parametrize("case", selected_cases(), ids=lambda c: c.id)
def test_emulated_kernels_match_reference(emu, split_env, case: Case):
    split_env(case.split)
    check_case(emu, make_inputs(case, seed=zlib.crc32(case.id.encode())), case)


# ---- coverage beyond the pairwise grid: loop residues, row offsets past 2^31 -------------------------------

# A block's share of a row in 16-byte vectors, modulo the 4 x 256 vectors one round of the unrolled loop
# (kUnroll x kThreads) takes: the first and the last thread of each quarter, where the main loop hands over to
# the one-vector loop after 0, 1, 2 or 3 more vectors per thread.
RESIDUES = (0, 255, 256, 511, 512, 767, 768, 1023)


# Under AddressSanitizer, the residues where the last block of the last row ends its unrolled loop exactly at the
# row's body end (0) or one vector before it (1023): a vector read past the loop's share there lies past the
# tensor, in ASan's redzone (the grid's ASan cases never run a round of the unrolled loop).
ASAN_RESIDUES = (0, 1023)


@pytest.mark.skipif(VARIANT not in ("fiber", "asan"), reason="the fiber run, and two residues under ASan")
@pytest.mark.parametrize("residue", ASAN_RESIDUES if VARIANT == "asan" else RESIDUES)
@pytest.mark.parametrize("split", (1, 2))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_vector_loop_residues(emu, split_env, dtype, split, residue):
    """Rows whose blocks get 1024 + r vectors (split 2: the first block 1024 + r, the second one fewer), plus a
    scalar tail, so the forward's and the backward's vector loops end in every quarter of a round, in one-block
    and split rows, every row misaligned differently (contiguous rows of V = nvec x vec + vec - 1 elements).
    The last row is a valid one (not padding), so its last block's loads end at the tensor's end."""
    split_env(split)
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    share = 1024 + residue
    nvec = share if split == 1 else 2 * share - 1
    case = Case(dtype, nvec * vec + vec - 1, False, "binary_kl", 1, True, False, split, False)
    x = make_inputs(case, seed=zlib.crc32(case.id.encode()))
    assert int(x["tokens"][-1]) >= 0 and x["buf"].is_contiguous()
    check_case(emu, x, case)


@fiber_only
@pytest.mark.parametrize("split", (None, 7))
def test_row_offsets_beyond_2_31_and_2_32_elements(emu, split_env, split):
    """Rows 2^30 + 5 bf16 elements apart (odd, so every row starts misaligned): rows 2 and 3 start past 2^31
    elements, where an int32 row offset wraps, rows 4 to 6 past 2^32 (8 GiB), where a uint32 one does. The
    buffer is torch.empty of 12.9 GB whose untouched pages cost no memory: only the seven rows are written. The
    vocabulary-parallel statistics first (row 6's -inf logits still there), then forward, backward and in-place
    backward (split and not), on the strided view."""
    split_env(split)
    case = Case(torch.bfloat16, 4099, True, "topk_kl", 5, True, True, split, False)
    x = make_inputs(case, seed=11)
    small = x["buf"]
    stride = 2**30 + 5
    big = torch.empty((N_ROWS - 1) * stride + small.shape[1], dtype=small.dtype)
    view = big.as_strided(small.shape, (stride, 1))
    assert 2 * stride >= 2**31 and 4 * stride >= 2**32

    def fresh() -> torch.Tensor:
        view.copy_(small)
        return view

    x["buf"] = fresh()
    logits = logits_of(x)
    assert int(logits.isneginf().sum()) > 2000, "row 6's -inf logits must be in the buffer the statistics read"
    for start, (a, b) in ((0, (0, 2000)), (2000, (2000, 4099))):
        got = emu.dppo_vocab_parallel_stats(logits[:, a:b], x["tokens"], x["topk_ids"], start, TEMPERATURE, True)
        want = torch.ops.dppo.dppo_vocab_parallel_stats(
            logits[:, a:b].contiguous(), x["tokens"], x["topk_ids"], start, TEMPERATURE, True
        )
        tol = forward_tol(logits[:, a:b], THREADS) + forward_tol(logits[:, a:b], 8)
        check_close("vocab-parallel stats at a row stride past 2^32", got, want, tol)
    check_case(emu, x, case, fresh)


@not_tsan
def test_grid_covers_every_pair():
    """The grid holds every value of every dimension (pairs are covered by construction) and stays
    small enough for every CI run."""
    for dim, values in DIMS.items():
        held = {getattr(c, dim) for c in GRID}
        assert held >= set(values), f"{dim}: grid holds {held}, wants every one of {set(values)}"
    assert len(GRID) < 120, f"{len(GRID)} cases: the pairwise grid should stay small"


@not_tsan
def test_split_override_sets_the_grid(emu, split_env):
    """DPPO_CUDA_SPLIT decides the blocks per row of the forward and the backward; without it the
    launch policy splits a short batch with a long vocabulary. And the emulator found the kernels'
    shared memory to poison (a harness that poisons nothing would hide unsynchronized reads)."""
    c = Case(torch.float32, 33000, False, "binary_tv", 1, False, False, None, False)
    x = make_inputs(c, seed=1)

    def blocks(split: int | None, fn) -> list[int]:
        split_env(split)
        emu.stats(True)
        fn()
        s = emu.stats(True)
        return s[:2]

    fwd = lambda: emu.dppo_loss_forward(*op_args(x, c))  # noqa: E731
    assert blocks(1, fwd) == [1, N_ROWS]  # one block per row, no workspace
    assert blocks(7, fwd) == [2, N_ROWS * 7 + N_ROWS]  # partial (N, 7) + finishing (N)
    # The policy: 4 x 132 SMs target blocks, at most V / (4 * 256 * 2) = 16 splits of work.
    assert blocks(None, fwd) == [2, N_ROWS * 16 + N_ROWS]
    out = emu.dppo_loss_forward(*op_args(x, c))
    bwd = lambda: emu.dppo_loss_backward(out[0], None, logits_of(x), x["tokens"], out[6], None, TEMPERATURE)  # noqa: E731
    assert blocks(150, bwd) == [1, N_ROWS * 150]
    assert blocks(None, bwd) == [1, N_ROWS * 16]
    split_env(None)
    emu.stats(True)
    emu.dppo_loss_forward(*op_args(x, c))
    stats = emu.stats(True)
    assert stats[3] >= 2 and stats[4] > 0, f"no __shared__ variables found to poison: {stats}"


def documented_split(n: int, v: int, vec: int, blocks_per_sm: int, sms: int) -> int:
    """csrc/cuda/launch_policy.cuh's rule, written out again: one block per row once N rows reach the target of
    `blocks_per_sm` x SMs blocks, else enough blocks per row to reach it (ceil(target / N)), but no more than
    leave every thread two 16-byte vectors (V / (vec x 256 x 2)), at least 1, at most 65535."""
    target = blocks_per_sm * sms
    if n >= target:
        return 1
    return max(1, min(-(-target // n), v // (vec * THREADS * 2), 65535))


# N around the targets (4 and 8 blocks per SM), V around the two-vectors-per-thread steps and long enough that
# ceil(target / N), not the work, sets the split, at a few SM counts: every case where a rounding, an off-by-one
# or a swapped target changes the choice. All rows are padding, so the kernels only launch (N x V stays small).
POLICY_SMS = (1, 7, 132)
POLICY_NV = [
    (n, v)
    for n in (1, 2, 3, 5, 7, 27, 28, 29, 55, 56, 57, 527, 528, 529, 1055, 1056, 1057)
    for v in (1, 2047, 2048, 4095, 4096, 30000, 300001)
    if n * v <= 2_000_000
]


@fiber_only
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_launch_policy_follows_its_rule(emu, split_env, dtype):
    """The blocks the forward (one launch of N blocks, or the split's N x S plus N finishing blocks) and the
    backward (N x S) launch, over N, V and the SM count, against documented_split."""
    split_env(None)
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    try:
        for sms in POLICY_SMS:
            emu.configure("fiber", sms, 0, 60.0)
            for n, v in POLICY_NV:
                logits = torch.zeros(n, v, dtype=dtype)
                tokens = torch.full((n,), -100, dtype=torch.long)
                acc = acc_of(dtype)
                rows = torch.zeros(n, dtype=acc)
                emu.stats(True)
                out = emu.dppo_loss_forward(
                    logits,
                    tokens,
                    rows,
                    rows,
                    None,
                    None,
                    None,
                    "binary_tv",
                    TEMPERATURE,
                    DELTA_LOW,
                    DELTA_HIGH,
                    RATIO_CAP,
                    False,
                )
                fwd = documented_split(n, v, vec, 4, sms)
                want = [1, n] if fwd == 1 else [2, n * fwd + n]
                assert emu.stats(True)[:2] == want, f"forward N={n} V={v} SMs={sms}: want split {fwd}"
                emu.dppo_loss_backward(rows, None, logits, tokens, out[6], None, TEMPERATURE)
                bwd = documented_split(n, v, vec, 8, sms)
                assert emu.stats(True)[:2] == [1, n * bwd], f"backward N={n} V={v} SMs={sms}: want split {bwd}"
    finally:
        emu.configure("fiber", 132, int(os.environ.get("DPPO_CUDA_EMU_SEED", "0")), 60.0)


@not_tsan
@pytest.mark.parametrize("value", ["0", "-3", "65536", "two", "7x"])
def test_split_override_rejects_bad_values(emu, split_env, monkeypatch, value):
    c = Case(torch.float32, 41, False, "binary_tv", 1, False, False, None, False)
    x = make_inputs(c, seed=2)
    monkeypatch.setenv("DPPO_CUDA_SPLIT", value)
    with pytest.raises(ValueError, match=r"DPPO_CUDA_SPLIT must be an integer in \[1, 65535\].*got '" + value):
        emu.dppo_loss_forward(*op_args(x, c))


def csrc_under_test() -> Path:
    """The csrc tree the emulator was built from (a mutant's, or the repository's)."""
    return Path(os.environ.get("DPPO_CUDA_EMU_CSRC") or Path(__file__).resolve().parents[2] / "csrc")


def documented_launch_bounds(policy: str) -> dict[str, str]:
    """launch_policy.cuh's table of each kernel's __launch_bounds__ arguments, whitespace-normalized."""
    lines = policy.splitlines()
    start = next(i for i, line in enumerate(lines) if "__launch_bounds__ (threads, blocks per SM)" in line)
    table = {}
    for line in lines[start + 1 :]:
        m = re.match(r"^//   (\w+)\s{2,}(\S.*)$", line)
        if m is None:
            break
        table[m.group(1)] = " ".join(m.group(2).split())
    return table


def kernels_launch_bounds(csrc: Path) -> dict[str, str]:
    """Each kernel's __launch_bounds__ arguments as its header writes them (parentheses balanced), by kernel name."""
    found = {}
    for header in sorted((csrc / "cuda").glob("*.cuh")):
        text = header.read_text()
        for m in re.finditer(r"__launch_bounds__\(", text):
            if text[text.rfind("\n", 0, m.start()) + 1 : m.start()].lstrip().startswith("//"):
                continue  # a comment naming it
            depth, j = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            name = re.match(r"\s*(\w+)\s*\(", text[j:])
            assert name is not None, f"{header.name}: no kernel after __launch_bounds__ at offset {m.start()}"
            found[name.group(1)] = " ".join(text[m.end() : j - 1].split())
    return found


# The blocks per SM of launch_policy.cuh's list (its register caps), in emu.min_blocks()' order: the one-block forward
# in fp32, bf16, fp16, fp64, each without and with the entropy (4 blocks, 3 with it; fp64 1), then the streaming
# kernels (the split forward's partial kernel and the backward) in fp32, bf16, fp16, fp64 (4; fp64 1).
DOCUMENTED_MIN_BLOCKS = [4, 3, 4, 3, 4, 3, 1, 1, 4, 4, 4, 1]


@not_tsan
def test_launch_bounds_follow_the_policy(emu):
    """The register cap: every kernel's __launch_bounds__ (threads, blocks per SM) is the one launch_policy.cuh's
    table gives it, its threads are the block the policy launches it with, and the blocks per SM the policy's
    constants evaluate to are the documented ones. A source check, since the emulator defines __launch_bounds__
    away (mutation_check.py: forward-launch-bounds-swapped, policy-min-blocks-swapped)."""
    csrc = csrc_under_test()
    policy = (csrc / "cuda" / "launch_policy.cuh").read_text()
    documented = documented_launch_bounds(policy)
    assert len(documented) == 7, f"launch_policy.cuh's __launch_bounds__ table: {documented}"
    actual = kernels_launch_bounds(csrc)
    assert actual == documented, (
        f"the kernels' __launch_bounds__ differ from launch_policy.cuh's table: kernels {actual}, table {documented}"
    )
    for kernel, bounds in documented.items():
        launched = re.search(rf"^//   {kernel}\s+(\w+)\s", policy, re.MULTILINE)
        assert launched is not None and bounds.split(",")[0] == launched.group(1), (
            f"{kernel}: __launch_bounds__({bounds}) but the policy launches it with blocks of "
            f"{launched and launched.group(1)}"
        )
    got = list(emu.min_blocks())
    assert got == DOCUMENTED_MIN_BLOCKS, (
        f"blocks per SM of the register caps: {got}, documented {DOCUMENTED_MIN_BLOCKS}"
    )


@not_tsan
def test_shared_memory_is_told_from_other_statics(emu):
    """The emulator poisons exactly the kernels' __shared__ variables (every one the headers declare, in each
    instantiation it found), and a function-local static of the kernels' namespace that is not __shared__ stops it
    at load (mutation_check.py: vp-smem-static-not-shared)."""
    names = list(emu.shared_vars())
    declared = set()
    for header in (csrc_under_test() / "cuda").glob("*.cuh"):
        declared |= set(re.findall(r"__shared__\s+[\w:<>, ]+?\s+(\w+)\s*[\[;]", header.read_text()))
    assert declared and {n.rsplit("::", 1)[1] for n in names} == declared, (names, declared)
    functions = {n.removeprefix("dppo::(anonymous namespace)::").split("<")[0].split("(")[0] for n in names}
    assert {"block_reduce_state", "block_sum_topk", "vp_stats_kernel"} <= functions, functions


@not_tsan
def test_schemas_match_the_real_ops(emu):
    """The emulator's ops keep the schemas of torch.ops.dppo (ops.cpp), so the tests call the
    kernels exactly as users do."""
    for name in (
        "dppo_loss_forward",
        "dppo_loss_backward",
        "dppo_loss_backward_",
        "dppo_vocab_parallel_stats",
        "dppo_vocab_parallel_epilogue",
    ):
        real = str(getattr(torch.ops.dppo, name).default._schema).split("(", 1)[1]
        emulated = str(getattr(emu, name).default._schema).split("(", 1)[1]
        assert emulated == real, f"{name}: emulator schema ({emulated}) differs from ops.cpp ({real})"


@not_tsan
@pytest.mark.parametrize("split", [None, 1, 7])
def test_topk_kl_rest_mass_precision(emu, split_env, split):
    """K = 300, pi -> 1, trainer top-K mass 1 - 1e-10 (python_tests/ops/test_dppo_op.py has the same
    case for the CPU kernel): the CUDA epilogue forms the top-K log-probs from the row's partial
    sums in double, so q_rest ~ 1e-10 survives and topk_kl matches the float64 reference."""
    split_env(split)
    v, k = 1000, 300
    z = torch.zeros(2, v, dtype=torch.float64)
    z[:, 0] = 30.0
    z[:, k:] = 30.0 + math.log(1e-10 / (v - k))
    ids = torch.arange(k).repeat(2, 1)
    p = torch.full((2, k), 0.49 / (k - 1), dtype=torch.float64)
    p[:, 0] = 0.5
    p[1] *= 0.9
    tokens = torch.tensor([0, 0])
    roll, adv = torch.log(p[:, 0]), torch.tensor([1.0, -1.0])
    got = emu.dppo_loss_forward(
        z.float(),
        tokens,
        roll.float(),
        adv.float(),
        ids,
        torch.log(p).float(),
        None,
        "topk_kl",
        1.0,
        0.2,
        0.2,
        10.0,
        False,
    )[2]
    want = dppo_loss_reference(
        z.float().double(), tokens, roll, adv, topk_ids=ids, topk_logprobs=torch.log(p), mode="topk_kl"
    )["divergence"]
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0), f"topk_kl {got.tolist()} vs float64 {want.tolist()}"


# ---- vocabulary-parallel kernels (csrc/cuda/vocab_parallel_kernels.cuh) -------------------------------------
# W simulated ranks: the emulated stats kernel on each rank's column slice, stacked as the all-gather would,
# then the emulated epilogue; against the float64 reference on the whole logits and against the CPU ops
# (torch.ops.dppo.dppo_vocab_parallel_*: the per-rank statistics and the merged outputs) on the same inputs.


@dataclass(frozen=True)
class VpCase:
    dtype: torch.dtype
    mode: str
    entropy: bool
    world: int
    v: int
    k: int = 5
    extreme: bool = False
    kept: bool = False  # sampling replay: kept_ids, S kept logits per row in every rank's statistics
    direction: str = "advantage"

    @property
    def anchor(self) -> bool:
        return self.world == 2

    @property
    def id(self) -> str:
        return (
            f"{str(self.dtype)[6:]}-{self.mode}-ent{int(self.entropy)}-w{self.world}-v{self.v}"
            f"{f'-k{self.k}' if self.mode in TOPK_MODES else ''}{'-huge' if self.extreme else ''}"
            f"{'-kept' if self.kept else ''}{'-sym' if self.direction == 'symmetric' else ''}"
        )


VP_ROWS = 10
# Every mode x dtype x entropy x W; the entropy cases take V = 700, so a rank's slice is wider than the
# 256-thread block (the strided loops and the block reduction over all 8 warps), and the others V = 37 (most
# threads of the block own no column). One case with K = 300 > 256 top-K ids per row.
VP_GRID = [
    VpCase(d, m, e, w, 700 if e else 37) for d in DTYPES for m in MODES for e in (True, False) for w in (1, 2, 3)
]
VP_GRID.append(VpCase(torch.float32, "topk_kl", True, 3, 700, 300))
# Logits of 1e30 (3e4 in fp16: vp_inputs' rows 0 and 8) in every dtype, with and without the entropy, at W = 2 and 3.
VP_GRID += [
    VpCase(d, m, e, w, 700 if e else 37, extreme=True)
    for d in DTYPES
    for m, e, w in (("binary_tv", True, 3), ("topk_kl", True, 2), ("ratio", False, 3))
]
# Sampling replay: every mode, fp32 and bf16, W = 2 and 3, kept sets spread over the ranks.
VP_GRID += [
    VpCase(d, m, True, w, 700, kept=True) for d in (torch.float32, torch.bfloat16) for m in MODES for w in (2, 3)
]
# The symmetric mask direction: every mode, fp32 and bf16, W = 2 (with the anchor) and 3.
VP_GRID += [
    VpCase(d, m, True, w, 700, direction="symmetric")
    for d in (torch.float32, torch.bfloat16)
    for m in MODES
    for w in (2, 3)
]
VP_ASAN = [c for c in VP_GRID if c.world == 3 and c.dtype in (torch.float32, torch.bfloat16)]
VP_TSAN = [VpCase(torch.float32, "topk_tv", True, 2, 700)]


def vp_offsets(v: int, world: int) -> list[int]:
    """[W + 1] offsets of uneven slices (dppo_testing.vocab_parallel's; at W = 3 rank 1 holds a single column)."""
    return [0, v] if world == 1 else split_offsets(v, world)


def vp_inputs(c: VpCase, seed: int, n: int = VP_ROWS) -> dict:
    """[N, V] logits with padding rows (2 and the last), pi -> 1 (row 1), pi -> 0 (row 3), mu = 0 (row 0),
    row 4 sampling the last column of rank 0 and holding -inf logits mixed with finite ones in every rank's
    slice (every third column, then most of the second half: a padded or top-k filtered vocabulary), and row
    5 + r the first column of rank r (also the last of its top-K ids), so every rank owns sampled tokens and
    top-K ids, and a token sits on every boundary. With `extreme`, row 8 puts a logit of 1e30 (3e4 in fp16) on
    its token (all the mass there) and row 0 ties every other column, its token's among them, at half that."""
    g = torch.Generator().manual_seed(seed)
    v = c.v
    offsets = vp_offsets(v, c.world)
    acc = torch.float64 if c.dtype == torch.float64 else torch.float32
    z = torch.randn(n, v, generator=g, dtype=torch.float64) * 3.0
    tokens = torch.randint(0, v, (n,), generator=g)
    tokens[4] = offsets[1] - 1
    for r in range(c.world):
        tokens[5 + r] = offsets[r]
    z[1, tokens[1]] = z[1].max() + 30.0
    z[3, tokens[3]] = z[3].min() - 30.0
    tokens[2] = tokens[n - 1] = -100
    cols = torch.arange(v)
    neg = (cols % 3 == 1) | ((cols >= v // 2) & (cols % 7 != 0))
    neg[tokens[4]] = False
    z[4, neg] = -math.inf
    if c.extreme:
        huge = 3e4 if c.dtype == torch.float16 else 1e30
        z[8, tokens[8]] = huge
        tokens[0] -= tokens[0] % 2  # among the tied columns: log p = -log(ties) beside an lse of 1e30
        z[0, ::2] = huge / 2
    k = min(c.k, v)
    noisy = z + torch.randn(n, v, generator=g, dtype=torch.float64)
    kept_ids = None
    if c.kept:
        # Each row keeps its token and 11 random others (on every rank, with -1 padding among them; the rollout's
        # distribution renormalised over them); padding rows hold an out-of-range and a repeated id (never read).
        width = 16
        kept_ids = torch.full((n, width), -1, dtype=torch.long)
        keep = torch.zeros(n, v, dtype=torch.bool)
        for i in range(n):
            a = int(tokens[i]) if tokens[i] >= 0 else 0
            others = [j for j in torch.randperm(v, generator=g).tolist() if j != a][:11]
            ids = torch.tensor([a, *others], dtype=torch.long)
            kept_ids[i, torch.randperm(width, generator=g)[: ids.numel()]] = ids
            keep[i, ids] = True
        for i in (2, n - 1):
            kept_ids[i, 0], kept_ids[i, 1], kept_ids[i, 2] = v + 7, 5 % v, 5 % v
        noisy = noisy.masked_fill(~keep, -math.inf)
    rollout = torch.log_softmax(noisy, dim=-1)
    topk_ids = rollout.topk(k, dim=-1).indices
    for r in range(c.world):
        if not (topk_ids[5 + r] == offsets[r]).any():
            topk_ids[5 + r, -1] = offsets[r]
    topk_lp = rollout.gather(1, topk_ids)
    roll_lp = rollout.gather(1, tokens.clamp(min=0)[:, None]).squeeze(1)
    roll_lp[0] = -math.inf
    anchor = (roll_lp + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).clamp(max=0.0)
    anchor[0] = -0.5
    return dict(
        logits=z.to(c.dtype),
        offsets=offsets,
        tokens=tokens,
        rollout=roll_lp.to(acc),
        adv=torch.randn(n, generator=g, dtype=torch.float64).to(acc),
        topk_ids=topk_ids,
        topk_lp=topk_lp.to(acc),
        anchor=anchor.to(acc),
        kept_ids=kept_ids,
    )


def vp_slices(logits: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
    """Each rank's [N, V_r] columns: even ranks a view at the full row stride (the kernel's ld), odd ranks a
    contiguous copy (so AddressSanitizer sees a read past a slice's end)."""
    return [
        logits[:, a:b] if r % 2 == 0 else logits[:, a:b].contiguous()
        for r, (a, b) in enumerate(zip(offsets, offsets[1:]))
    ]


def vp_run(ops, x: dict, c: VpCase) -> tuple[torch.Tensor, tuple]:
    """Stats of every rank through `ops` (the emulator's or torch.ops.dppo), stacked [W, N, 4 + K], then the
    epilogue: (stats, the seven outputs)."""
    topk = c.mode in TOPK_MODES
    ids = x["topk_ids"] if topk else None
    offsets = x["offsets"]
    stats = torch.stack(
        [
            ops.dppo_vocab_parallel_stats(s, x["tokens"], ids, a, TEMPERATURE, c.entropy, x["kept_ids"])
            for s, a in zip(vp_slices(x["logits"], offsets), offsets)
        ]
    )
    out = ops.dppo_vocab_parallel_epilogue(
        stats,
        offsets,
        x["tokens"],
        x["rollout"],
        x["adv"],
        ids,
        x["topk_lp"] if topk else None,
        x["anchor"] if c.anchor else None,
        c.mode,
        DELTA_LOW,
        DELTA_HIGH,
        RATIO_CAP,
        c.entropy,
        x["kept_ids"],
        c.direction,
    )
    return stats, tuple(out)


def vp_reference(x: dict, c: VpCase) -> tuple:
    topk = c.mode in TOPK_MODES
    out = dppo_loss_reference(
        x["logits"].double(),
        x["tokens"],
        x["rollout"].double(),
        x["adv"].double(),
        topk_ids=x["topk_ids"] if topk else None,
        topk_logprobs=x["topk_lp"].double() if topk else None,
        anchor_logprobs=x["anchor"].double() if c.anchor else None,
        mode=c.mode,
        temperature=TEMPERATURE,
        delta_low=DELTA_LOW,
        delta_high=DELTA_HIGH,
        ratio_cap=RATIO_CAP,
        compute_entropy=c.entropy,
        kept_ids=x["kept_ids"],
        mask_direction=c.direction,
    )
    return tuple(out[name].detach() for name in NAMES)


def vp_selected() -> list[VpCase]:
    return {"asan": VP_ASAN, "tsan": VP_TSAN, "traffic": []}.get(VARIANT, VP_GRID)


def vp_tol(x: dict) -> torch.Tensor:
    """[N] forward_tol of the vocabulary-parallel path: each rank's statistics summed by one 256-thread block
    (kVpThreads) over its slice, merged in double."""
    return forward_tol(x["logits"], THREADS)


def cpu_tol(x: dict) -> torch.Tensor:
    """[N] forward_tol of the CPU kernels: row passes of 2 x 16 float lanes at AVX-512 (fewer lanes, more terms
    each, at lower levels: 8 lanes is the bound for all of them), at::vec's exp within the same 4x slack."""
    return forward_tol(x["logits"], 8)


def check_vp(emu, x: dict, case: VpCase) -> None:
    """The emulated stats and epilogue of every rank against the float64 reference, then against the CPU ops
    on the same slices: every rank's statistics (padding rows all zero, a rank's target and top-K columns 0
    where it does not own the id) and the merged outputs."""
    n = x["tokens"].shape[0]
    untouched = x["logits"].clone()
    stats, out = vp_run(emu, x, case)
    assert same_bits(x["logits"], untouched), "the stats kernel wrote into its logits"
    acc = acc_of(case.dtype)
    s = 0 if x["kept_ids"] is None else x["kept_ids"].shape[1]
    assert stats.shape == (case.world, n, 4 + (case.k if case.mode in TOPK_MODES else 0) + s)
    assert stats.dtype == acc and all(o.dtype == acc and o.shape == (n,) for o in out)
    mu = x["anchor"] if case.anchor else x["rollout"]
    check_forward("vocab-parallel forward vs reference", out, vp_reference(x, case), mu, vp_tol(x), x["tokens"])
    cpu_stats, cpu_out = vp_run(torch.ops.dppo, x, case)
    pad = x["tokens"] == -100
    assert (stats[:, pad] == 0).all(), "padding rows must get all-zero statistics"
    both = vp_tol(x) + cpu_tol(x)
    check_close("vocab-parallel stats vs CPU op", stats, cpu_stats, both.view(1, -1, 1))
    check_forward("vocab-parallel forward vs CPU op", out, cpu_out, mu, both, x["tokens"])


@pytest.mark.parametrize("case", vp_selected(), ids=lambda c: c.id)
def test_vocab_parallel_emulated_kernels_match_reference(emu, case: VpCase):
    check_vp(emu, vp_inputs(case, seed=zlib.crc32(case.id.encode())), case)


@not_tsan
@pytest.mark.parametrize("world", (1, 2, 3))
def test_vocab_parallel_topk_kl_rest_mass_precision(emu, world):
    """test_topk_kl_rest_mass_precision's rows (K = 300, pi -> 1, trainer top-K mass 1 - 1e-10) through the
    vocabulary-parallel kernels on W ranks: the epilogue merges the ranks' statistics in double, so q_rest ~ 1e-10
    survives and topk_kl matches the float64 reference (in float it comes out 11.441 for 11.395)."""
    v, k = 1000, 300
    z = torch.zeros(2, v, dtype=torch.float64)
    z[:, 0] = 30.0
    z[:, k:] = 30.0 + math.log(1e-10 / (v - k))
    ids = torch.arange(k).repeat(2, 1)
    p = torch.full((2, k), 0.49 / (k - 1), dtype=torch.float64)
    p[:, 0] = 0.5
    p[1] *= 0.9
    tokens = torch.tensor([0, 0])
    roll, adv = torch.log(p[:, 0]), torch.tensor([1.0, -1.0])
    offsets = vp_offsets(v, world)
    stats = torch.stack(
        [
            emu.dppo_vocab_parallel_stats(z[:, a:b].float(), tokens, ids, a, 1.0, False)
            for a, b in zip(offsets, offsets[1:])
        ]
    )
    got = emu.dppo_vocab_parallel_epilogue(
        stats,
        offsets,
        tokens,
        roll.float(),
        adv.float(),
        ids,
        torch.log(p).float(),
        None,
        "topk_kl",
        0.2,
        0.2,
        10.0,
        False,
    )[2]
    want = dppo_loss_reference(
        z.float().double(), tokens, roll, adv, topk_ids=ids, topk_logprobs=torch.log(p), mode="topk_kl"
    )["divergence"]
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=0), (
        f"vocab-parallel topk_kl W={world}: {got.tolist()} vs float64 {want.tolist()}"
    )


@fiber_only
def test_more_than_65536_rows(emu):
    """65,536 + 37 rows of V = 3, most of them padding (cheap): past the 65,535 blocks a grid's y dimension
    holds, so a kernel that puts rows on grid.y fails to launch (mutation_check.py: vp-rows-on-grid-y). Every
    kernel with a block per row, or a row per thread: the vocabulary-parallel statistics and epilogue, the
    one-block forward and the backward, against the CPU ops on the same inputs, the last rows included."""
    n, v = 65536 + 37, 3
    g = torch.Generator().manual_seed(23)
    z = torch.randn(n, v, generator=g) * 3.0
    tokens = torch.randint(0, v, (n,), generator=g)
    # Padding but every 97th row and the last 40 (a padding block is a few microseconds, a valid one ~0.6 ms here):
    # a row indexed wrongly still lands on another row's outputs, and the rows past 65,535 are real ones.
    keep = torch.zeros(n, dtype=torch.bool)
    keep[::97] = True
    keep[-40:] = True
    tokens[~keep] = -100
    roll = -torch.rand(n, generator=g) * 3.0
    adv = torch.randn(n, generator=g)
    rows = (tokens, roll, adv, None, None, None, "binary_kl", DELTA_LOW, DELTA_HIGH, RATIO_CAP, True)
    emu.stats(True)
    stats = emu.dppo_vocab_parallel_stats(z, tokens, None, 0, TEMPERATURE, True)
    want_stats = torch.ops.dppo.dppo_vocab_parallel_stats(z, tokens, None, 0, TEMPERATURE, True)
    tol = forward_tol(z, THREADS) + forward_tol(z, 8)
    check_close("vocab-parallel stats, 65,573 rows", stats, want_stats, tol.view(-1, 1))
    out = emu.dppo_vocab_parallel_epilogue(stats[None], [0, v], *rows)
    want = torch.ops.dppo.dppo_vocab_parallel_epilogue(want_stats[None], [0, v], *rows)
    check_forward("vocab-parallel forward, 65,573 rows", tuple(out), tuple(want), roll, tol, tokens)
    fwd = emu.dppo_loss_forward(
        z, tokens, roll, adv, None, None, None, "binary_kl", TEMPERATURE, DELTA_LOW, DELTA_HIGH, RATIO_CAP, True
    )
    want_fwd = torch.ops.dppo.dppo_loss_forward(
        z, tokens, roll, adv, None, None, None, "binary_kl", TEMPERATURE, DELTA_LOW, DELTA_HIGH, RATIO_CAP, True
    )
    check_forward("forward, 65,573 rows", tuple(fwd), tuple(want_fwd), roll, tol, tokens)
    gt = torch.randn(n, generator=g)
    grad = emu.dppo_loss_backward(gt, None, z, tokens, fwd[6], None, TEMPERATURE)
    want_g = reference_grad(z, tokens, gt, None, fwd[6], None)
    check_grad("backward, 65,573 rows", grad, want_g, grad_bound(want_g, z, tokens, gt, None, fwd[6], None))
    launches, blocks = emu.stats(True)[:2]
    assert launches == 4 and blocks == n + (n + 127) // 128 + n + n, (launches, blocks)


@fiber_only
@pytest.mark.parametrize("mode", ("binary_kl", "topk_tv"))
def test_vocab_parallel_more_rows_than_one_block(emu, mode):
    """2 x 128 + 37 rows: the epilogue's blocks of 128 rows (one per thread) are two full ones and a partial
    one, and the statistics kernel runs one block per row well past the grid's usual 10."""
    case = VpCase(torch.float32, mode, False, 2, 37)
    x = vp_inputs(case, seed=13, n=2 * 128 + 37)
    check_vp(emu, x, case)
    stats = torch.stack(
        [
            emu.dppo_vocab_parallel_stats(z, x["tokens"], None, a, TEMPERATURE, False)
            for z, a in zip(vp_slices(x["logits"], x["offsets"]), x["offsets"])
        ]
    )
    emu.stats(True)
    emu.dppo_vocab_parallel_epilogue(
        stats,
        x["offsets"],
        x["tokens"],
        x["rollout"],
        x["adv"],
        None,
        None,
        None,
        "binary_kl",
        DELTA_LOW,
        DELTA_HIGH,
        RATIO_CAP,
        False,
    )
    assert emu.stats(True)[:2] == [1, 3], "the epilogue of 293 rows should run as 3 blocks of 128 rows"


@not_tsan
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl"))
def test_vocab_parallel_emulated_non_finite_rows(emu, dtype, mode):
    """A NaN or +inf logit in one rank's slice, or a row all -inf, gives NaN outputs for that row (never a
    finite loss), as the reference and the CPU ops do; a rank whose whole slice is -inf is an empty state and
    the row stays finite."""
    c = VpCase(dtype, mode, True, 3, 700)
    x = vp_inputs(c, seed=5)
    offsets, logits = x["offsets"], x["logits"].clone()
    logits[0, offsets[2] + 7] = math.nan  # rank 2 only
    logits[6, offsets[0] + 300] = math.inf  # rank 0 only, past the first 256 columns
    logits[7] = -math.inf  # every rank
    logits[8, offsets[0] : offsets[1]] = -math.inf  # rank 0's slice empty, the row finite (its token elsewhere)
    x["logits"] = logits
    x["tokens"][8] = offsets[2] + 1
    _, out = vp_run(emu, x, c)
    want = vp_reference(x, c)
    _, cpu_out = vp_run(torch.ops.dppo, x, c)
    for name, got, exact, cpu in zip(NAMES, out, want, cpu_out):
        nan_rows = exact.isnan()
        assert nan_rows[[0, 6, 7]].all() and not nan_rows[8], f"{name}: reference NaN rows {nan_rows.tolist()}"
        assert torch.equal(got.isnan(), nan_rows), f"{name}: emulated NaN rows {got.isnan().tolist()}"
        assert torch.equal(cpu.isnan(), nan_rows), f"{name}: CPU op NaN rows {cpu.isnan().tolist()}"
    keep = ~want[0].isnan()
    mu = x["rollout"][keep]
    check_forward(
        "non-finite rows: the others vs reference",
        tuple(o[keep] for o in out),
        tuple(w[keep] for w in want),
        mu,
        vp_tol(x)[keep],
    )


@not_tsan
@pytest.mark.parametrize("world", (1, 3))
def test_vocab_parallel_emulated_empty_batch(emu, world):
    """N = 0: [N, 4 + K] statistics per rank and seven [0] outputs, no launch."""
    offsets = vp_offsets(7, world)
    ids = torch.zeros(0, 2, dtype=torch.long)
    emu.stats(True)
    stats = torch.stack(
        [
            emu.dppo_vocab_parallel_stats(
                torch.zeros(0, b - a, dtype=torch.bfloat16), torch.zeros(0, dtype=torch.long), ids, a, 1.0, True
            )
            for a, b in zip(offsets, offsets[1:])
        ]
    )
    assert stats.shape == (world, 0, 6) and stats.dtype == torch.float32
    empty = torch.zeros(0)
    out = emu.dppo_vocab_parallel_epilogue(
        stats,
        offsets,
        torch.zeros(0, dtype=torch.long),
        empty,
        empty,
        ids,
        torch.zeros(0, 2),
        None,
        "topk_tv",
        0.2,
        0.2,
        10.0,
        True,
    )
    assert len(out) == 7 and all(o.shape == (0,) and o.dtype == torch.float32 for o in out)
    assert emu.stats(True)[0] == 0, "an empty batch launched a kernel"


@not_tsan
def test_vocab_parallel_emulated_launch_shape(emu):
    """One 256-thread block per row for the statistics, 128-thread blocks (a row per thread) for the epilogue,
    and shared memory poisoned before the stats blocks (mutation_check.py's vp-no-syncthreads shows that the
    stats kernel's own reduction array is among it: its unsynchronized read sees the poison)."""
    c = VpCase(torch.float32, "binary_tv", True, 1, 700)
    x = vp_inputs(c, seed=3)
    emu.stats(True)
    stats = emu.dppo_vocab_parallel_stats(x["logits"], x["tokens"], None, 0, TEMPERATURE, True)
    s = emu.stats(True)
    assert s[:3] == [1, VP_ROWS, VP_ROWS * 256], s
    assert s[4] > 0, f"no __shared__ bytes poisoned: {s}"
    emu.dppo_vocab_parallel_epilogue(
        stats[None],
        [0, c.v],
        x["tokens"],
        x["rollout"],
        x["adv"],
        None,
        None,
        None,
        "binary_tv",
        DELTA_LOW,
        DELTA_HIGH,
        RATIO_CAP,
        True,
    )
    assert emu.stats(True)[:3] == [1, 1, 128]


# ---- global-memory traffic (the traffic build) --------------------------------------------------------------
# Each launch's loads and stores per buffer, counted by the emulator: `load` / `store` every byte accessed,
# `*_unique` the distinct bytes (what a GPU with perfect caching moves to and from DRAM). The minimum: the
# forward reads every logit of a row once (plus the target's, by every thread: a broadcast, and the K top-K
# logits again, single cached elements), the backward reads each once and writes each gradient once, in place
# the same, padding rows read no logits; every per-row input is read and every output written once per row.

traffic_only = pytest.mark.skipif(VARIANT != "traffic", reason="the traffic build of the emulator counts accesses")
TRAFFIC_JSON = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cuda_traffic.json"
TRAFFIC_V, TRAFFIC_K, TRAFFIC_SPLIT = 1000, 5, 3
# The report's V = 1000 leaves every row 16-byte aligned in every dtype (no scalar head or tail) and every
# block's share under one round of the unrolled loop (kUnroll x 256 vectors). The edges' V = 26403 (3 mod 8):
# contiguous rows misaligned differently in every dtype (heads and tails), and shares of at least one unrolled
# round plus a remainder at split 1 and 3 in every dtype (bf16 / fp16: 3300 vectors a row, 1100 a block).
TRAFFIC_V_EDGES = 26403
traffic_rows: list[dict] = []  # what the tests measured at V = TRAFFIC_V, for test_traffic_report


def traffic_launches(
    emu, tensors: dict[str, torch.Tensor], grids: list | None = None
) -> list[tuple[str, dict[str, dict]]]:
    """The launches since the last reset: (kernel, {buffer name: counts}); buffers not in `tensors` (the ops'
    contiguous copies and the split forward's workspace) are named "other:<base>". `grids` collects each
    launch's grid [x, y]."""
    import json

    names = {t.untyped_storage().data_ptr(): name for name, t in tensors.items() if t is not None}
    out = []
    for launch in json.loads(emu.traffic(True)):
        bufs = {names.get(b["base"], f"other:{b['base']}"): b for b in launch["buffers"]}
        out.append((launch["kernel"], bufs))
        if grids is not None:
            grids.append(launch["grid"])
    return out


def spanned_sectors(base: int, element: int, first: int, end: int) -> int:
    """The 32-byte sectors elements [first, end) of `element` bytes from address `base` span."""
    return (base + end * element - 1) // 32 - (base + first * element) // 32 + 1


def unique(bufs: dict, name: str, kind: str = "load") -> int:
    return bufs[name][f"{kind}_unique"] if name in bufs else 0


def traffic_inputs(dtype: torch.dtype, mode: str, v: int = TRAFFIC_V) -> dict:
    case = Case(dtype, v, False, mode, TRAFFIC_K, True, True, None, False)
    x = make_inputs(case, seed=17)
    x["case"] = case
    return x


def row_heads_and_tails(buf: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's scalar head (elements before its first 16-byte boundary) and tail (after its last vector)."""
    e = buf.element_size()
    vec = 16 // e
    heads, tails = [], []
    for i in range(buf.shape[0]):
        head = min((-(buf[i].data_ptr() // e)) % vec, buf.shape[1])
        heads.append(head)
        tails.append((buf.shape[1] - head) % vec)
    return heads, tails


def check_traffic_shape(x: dict, splits: tuple[int, ...]) -> None:
    """The edges' shape does what it is for: rows with a head and rows with a tail, and every block's share of
    a row at least one round of the unrolled loop (kUnroll x THREADS vectors) at each split."""
    if x["v"] == TRAFFIC_V:
        return
    heads, tails = row_heads_and_tails(x["buf"])
    assert any(heads) and any(tails), (heads, tails)
    vec = 16 // x["buf"].element_size()
    for split in splits:
        share = min((x["v"] - h) // vec for h in heads) // split
        assert share >= 4 * THREADS, f"split {split}: {share} vectors a block never reach the unrolled loop"


@traffic_only
@pytest.mark.parametrize("v", (TRAFFIC_V, TRAFFIC_V_EDGES), ids=lambda v: f"v{v}")
@pytest.mark.parametrize("split", (1, TRAFFIC_SPLIT))
@pytest.mark.parametrize("mode", ("binary_tv", "topk_kl"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_traffic_forward_reads_each_logit_once(emu, split_env, dtype, mode, split, v):
    split_env(split)
    x = traffic_inputs(dtype, mode, v)
    check_traffic_shape(x, (split,))
    case = x["case"]
    n, e = N_ROWS, torch.empty((), dtype=dtype).element_size()
    a = torch.empty((), dtype=acc_of(dtype)).element_size()
    valid = int((x["tokens"] != -100).sum())
    k = TRAFFIC_K if mode in TOPK_MODES else 0
    emu.traffic(True)
    out = emu.dppo_loss_forward(*op_args(x, case))
    named = dict(
        logits=x["buf"],
        tokens=x["tokens"],
        rollout=x["rollout"],
        adv=x["adv"],
        anchor=x["anchor"],
        topk_ids=x["topk_ids"] if k else None,
        topk_lp=x["topk_lp"] if k else None,
        **{f"out:{name}": o for name, o in zip(NAMES, out)},
    )
    launches = traffic_launches(emu, named)
    kernels = [kname for kname, _ in launches]
    if split == 1:
        assert len(launches) == 1 and kernels[0].startswith("dppo_loss_forward_kernel<"), kernels
        stream, finish = launches[0][1], launches[0][1]
    else:
        assert len(launches) == 2 and kernels[0].startswith("dppo_loss_forward_partial_kernel<"), kernels
        stream, finish = launches[0][1], launches[1][1]
        ws = [name for name, b in stream.items() if name.startswith("other:") and b["store"]]
        assert len(ws) == 1, f"the partial kernel should write one workspace: {stream}"
        assert stream[ws[0]]["store"] == stream[ws[0]]["store_unique"] == valid * split * 3 * a, stream[ws[0]]
        assert finish[ws[0]]["load"] == finish[ws[0]]["load_unique"] == valid * split * 3 * a, finish[ws[0]]
    # Every logit of a valid row read exactly once by the streaming pass; padding rows not at all.
    logits_once = valid * v * e
    assert stream["logits"]["load_unique"] == logits_once, stream["logits"]
    # Again: the target's logit by every thread of the row's block (a broadcast, one request per warp on a GPU),
    # and each of the K top-K logits by one thread.
    threads = THREADS if split == 1 else 128  # the finishing kernel's kFinishThreads
    extra = valid * (threads + k) * e
    if split == 1:
        assert stream["logits"]["load"] == logits_once + extra, stream["logits"]
    else:
        assert stream["logits"]["load"] == logits_once and finish["logits"]["load"] == extra, finish["logits"]
    assert unique(stream, "tokens") == n * 8
    for name in ("rollout", "adv", "anchor"):
        assert unique(finish, name) == valid * a, (name, finish.get(name))
    if k:
        assert finish["topk_ids"]["load"] == finish["topk_ids"]["load_unique"] == valid * k * 8
        assert finish["topk_lp"]["load"] == finish["topk_lp"]["load_unique"] == valid * k * a
    for name in NAMES:
        b = finish[f"out:{name}"]
        assert b["store"] == b["store_unique"] == n * a and b["load"] == 0, (name, b)
    for name, b in finish.items():
        assert b["store"] == 0 or name.startswith("out:"), f"the finishing kernel wrote into {name}: {b}"
    if v != TRAFFIC_V:
        return
    total = sum(b["load_unique"] + b["store_unique"] for _, bufs in launches for b in bufs.values())
    logit_bytes = sum(bufs["logits"]["load_unique"] for _, bufs in launches[:1])
    traffic_rows.append(
        dict(
            kernel="forward" + ("" if split == 1 else f" split {split}"),
            mode=mode,
            dtype=str(dtype)[6:],
            logit_bytes=logit_bytes / (valid * v),
            row_bytes=(total - logit_bytes - valid * k * (8 + a)) / n,
            topk_bytes=(8 + a) if k else 0,
        )
    )


@traffic_only
@pytest.mark.parametrize(
    "v, split",
    ((TRAFFIC_V, None), (TRAFFIC_V_EDGES, 1), (TRAFFIC_V_EDGES, TRAFFIC_SPLIT)),
    ids=("v1000", "edges-split1", "edges-split3"),
)
@pytest.mark.parametrize("inplace", (False, True))
@pytest.mark.parametrize("entropy_grad", (False, True))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_traffic_backward_reads_and_writes_each_once(emu, split_env, dtype, entropy_grad, inplace, v, split):
    split_env(split)
    x = traffic_inputs(dtype, "binary_tv", v)
    check_traffic_shape(x, (split,) if split else ())
    n, e = N_ROWS, torch.empty((), dtype=dtype).element_size()
    acc = acc_of(dtype)
    a = torch.empty((), dtype=acc).element_size()
    valid = int((x["tokens"] != -100).sum())
    out = emu.dppo_loss_forward(*op_args(x, x["case"]))
    lse, ent = out[6].clone(), out[5].clone()
    gt = torch.randn(n, dtype=torch.float64).to(acc)
    gh = (torch.randn(n, dtype=torch.float64) * 0.3).to(acc) if entropy_grad else None
    eg = ent if entropy_grad else None
    logits = x["buf"].clone() if inplace else x["buf"]
    emu.traffic(True)
    if inplace:
        emu.dppo_loss_backward_(gt, gh, logits, x["tokens"], lse, eg, TEMPERATURE)
        grad = logits
    else:
        grad = emu.dppo_loss_backward(gt, gh, logits, x["tokens"], lse, eg, TEMPERATURE)
    grids: list = []
    launches = traffic_launches(
        emu,
        dict(logits=logits, grad=None if inplace else grad, tokens=x["tokens"], lse=lse, gt=gt, gh=gh, ent=eg),
        grids,
    )
    assert len(launches) == 1 and launches[0][0].startswith("dppo_loss_backward_kernel<"), launches
    assert grids[0] == [n, split or 1], f"the backward launched grid {grids[0]}, wants [{n}, {split or 1}]"
    bufs = launches[0][1]
    src, dst = bufs["logits"], bufs["logits" if inplace else "grad"]
    assert src["load"] == src["load_unique"] == valid * v * e, src  # each logit read once
    assert dst["store"] == dst["store_unique"] == n * v * e, dst  # each gradient written once
    if not inplace:
        assert src["store"] == 0 and dst["load"] == 0
    assert unique(bufs, "tokens") == n * 8
    for name in ("lse", "gt") + (("gh", "ent") if entropy_grad else ()):
        assert unique(bufs, name) == valid * a, (name, bufs.get(name))
    others = [nm for nm in bufs if nm.startswith("other:")]
    assert not others, f"the backward touched buffers it was not given: {others}"
    if v != TRAFFIC_V:
        return
    total = sum(b["load_unique"] + b["store_unique"] for b in bufs.values())
    logit_bytes = src["load_unique"] + dst["store_unique"]
    traffic_rows.append(
        dict(
            kernel="backward" + (" in-place" if inplace else "") + (" + entropy grad" if entropy_grad else ""),
            mode="any",
            dtype=str(dtype)[6:],
            logit_bytes=src["load_unique"] / (valid * v) + dst["store_unique"] / (n * v),
            row_bytes=(total - logit_bytes) / n,
            topk_bytes=0,
        )
    )


@traffic_only
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_traffic_vocab_parallel(emu, dtype):
    """The statistics kernel reads its slice twice (a max pass, then the sums: its design, each logit once in
    distinct bytes) plus the owned target and top-K logits, and writes each statistic once; the epilogue
    writes each output once and reads no logits."""
    case = VpCase(dtype, "topk_kl", True, 2, 700)
    x = vp_inputs(case, seed=19)
    e, a = torch.empty((), dtype=dtype).element_size(), 4
    valid = x["tokens"] != -100
    nv = int(valid.sum())
    n, k = VP_ROWS, case.k
    stats = []
    for lo, hi in zip(x["offsets"], x["offsets"][1:]):
        z = x["logits"][:, lo:hi].contiguous()
        emu.traffic(True)
        st = emu.dppo_vocab_parallel_stats(z, x["tokens"], x["topk_ids"], lo, TEMPERATURE, True)
        ((kernel, bufs),) = traffic_launches(emu, dict(logits=z, tokens=x["tokens"], ids=x["topk_ids"], stats=st))
        assert kernel.startswith("vp_stats_kernel<"), kernel
        owned = ((x["tokens"] >= lo) & (x["tokens"] < hi)).sum() + (
            (x["topk_ids"] >= lo) & (x["topk_ids"] < hi) & valid[:, None]
        ).sum()
        assert bufs["logits"]["load_unique"] == nv * (hi - lo) * e, bufs["logits"]
        assert bufs["logits"]["load"] == 2 * nv * (hi - lo) * e + int(owned) * e, bufs["logits"]
        # Coalesced: each pass's warp requests cover 32 consecutive columns (the sectors those span), and each
        # owned target or top-K logit gathered by index is at most one sector more.
        coalesced = sum(
            spanned_sectors(z[i].data_ptr(), e, c, min(c + 32, hi - lo))
            for i in valid.nonzero().flatten().tolist()
            for c in range(0, hi - lo, 32)
        )
        sectors = bufs["logits"]["load_sectors"]
        assert coalesced <= sectors <= 2 * coalesced + int(owned), (
            f"the statistics kernel's logit loads take {sectors} 32-byte sectors, coalesced loads "
            f"{2 * coalesced} (+ {int(owned)} gathered): uncoalesced warp requests {bufs['logits']}"
        )
        assert bufs["stats"]["store"] == bufs["stats"]["store_unique"] == n * (4 + k) * a, bufs["stats"]
        stats.append(st)
    stats = torch.stack(stats)
    emu.traffic(True)
    out = emu.dppo_vocab_parallel_epilogue(
        stats,
        x["offsets"],
        x["tokens"],
        x["rollout"],
        x["adv"],
        x["topk_ids"],
        x["topk_lp"],
        None,
        case.mode,
        DELTA_LOW,
        DELTA_HIGH,
        RATIO_CAP,
        True,
    )
    ((kernel, bufs),) = traffic_launches(emu, dict(stats=stats, **{f"out:{nm}": o for nm, o in zip(NAMES, out)}))
    assert kernel.startswith("vp_epilogue_kernel<"), kernel
    for name in NAMES:
        assert bufs[f"out:{name}"]["store"] == bufs[f"out:{name}"]["store_unique"] == n * a
    assert bufs["stats"]["store"] == 0 and bufs["stats"]["load_unique"] <= stats.numel() * a


@traffic_only
def test_traffic_report(emu):
    """bytes per logit of every kernel path and dtype, checked against benchmarks/results/cuda_traffic.json
    (what benchmarks/gpu_bandwidth.py predicts GPU times from); DPPO_CUDA_EMU_WRITE_TRAFFIC=1 rewrites it.
    Runs after the traffic tests above (file order)."""
    import json

    if len(traffic_rows) != 2 * 2 * len(DTYPES) + 2 * 2 * len(DTYPES):
        pytest.skip("the report needs every test_traffic_forward / _backward case (run.py traffic runs them all)")
    rows = sorted(traffic_rows, key=lambda r: (r["kernel"], r["mode"], r["dtype"]))
    print(f"\n{'kernel':34s} {'mode':10s} {'dtype':9s} {'B/logit':>8s} {'B/row':>7s} {'B/top-K id':>10s}")
    for r in rows:
        print(
            f"{r['kernel']:34s} {r['mode']:10s} {r['dtype']:9s} {r['logit_bytes']:8.3f} {r['row_bytes']:7.1f} "
            f"{r['topk_bytes']:10d}"
        )
    doc = {
        "about": "Global-memory bytes of each CUDA kernel path, counted by the CPU emulator's traffic build "
        "(python_tests/cuda_emu/run.py traffic), distinct bytes per launch: logit_bytes per logit (the "
        "logits read, per logit of a valid row, plus the gradient written, per logit of any row), "
        "row_bytes per row (every other buffer: per-row inputs, outputs, workspace; one row in seven "
        "is padding), topk_bytes per top-K id and its log-prob.",
        "shape": {"n": N_ROWS, "v": TRAFFIC_V, "k": TRAFFIC_K, "split": TRAFFIC_SPLIT},
        "rows": rows,
    }
    if os.environ.get("DPPO_CUDA_EMU_WRITE_TRAFFIC") == "1":
        TRAFFIC_JSON.write_text(json.dumps(doc, indent=1) + "\n")
    committed = json.loads(TRAFFIC_JSON.read_text())
    assert committed == doc, (
        f"{TRAFFIC_JSON} differs from what the emulator measured: rerun "
        "DPPO_CUDA_EMU_WRITE_TRAFFIC=1 python python_tests/cuda_emu/run.py traffic"
    )

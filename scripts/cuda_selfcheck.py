"""CUDA kernels of torch.ops.dppo.* vs float64 PyTorch, on a GPU (scripts/gpu_check.sh runs it).

Forward outputs are compared with dppo_ext.reference.dppo_loss_reference run in float64 on the same
(exactly upcast) logits; gradients with the contract's formula evaluated in float64 from the same
lse / entropy the kernel was given: grad = (g_t (1[j = a] - p) - g_h p (log p + H)) / T.

Default: every case below x fp32/bf16/fp16/fp64 x every mode x entropy on/off, then fp32/bf16 x
binary_kl/topk_tv with the blocks per row forced by DPPO_CUDA_SPLIT = 1, 2, 7, 150 (split and
non-split paths whatever N and the SM count), and the vocabulary-parallel ops (check_vocab_parallel: W = 1, 2, 3
simulated ranks, the statistics of each rank's slice then the epilogue). --quick: the small
fp32/bf16 cases (for compute-sanitizer memcheck); --tiny: two bf16 cases (racecheck); --large: also
one N * V > 2^31 case (int64 offsets), compared with the CPU kernel on its last rows. --dry-run: on any
machine, everything up to the first GPU call (the first case's inputs and float64 reference), then stop.
"""

import argparse
import json
import math
import os
import sys

import torch

import dppo_ext.ops  # noqa: F401  (loads the native library: registers torch.ops.dppo.*)
from dppo_ext.contract import TOPK_MODES
from dppo_ext.reference import dppo_loss_reference

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "ratio", "none")
NAMES = ("loss", "logp", "divergence", "mask", "weight", "entropy", "lse")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-4, torch.float16: 1e-4, torch.float64: 1e-9}
GRAD_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float64: 1e-9}
DELTA_LOW, DELTA_HIGH = 0.2, 0.3
failures = []


def make_case(n, v, dtype, k, col_off, row_pad, seed, extreme):
    """CPU inputs. The logits are the [n, v] view at column col_off of a [n, v + col_off + row_pad]
    buffer (rows not contiguous with each other, and not 16-byte aligned when col_off is odd)."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    full = torch.randn(n, v + col_off + row_pad, generator=g, dtype=torch.float64) * 3.0
    tokens = torch.randint(0, v, (n,), generator=g)
    if n >= 4:
        tokens[2] = -100  # padding row
        full[1, col_off + int(tokens[1])] += 40.0  # pi -> 1
        full[3, col_off + int(tokens[3])] -= 40.0  # pi -> 0
    if extreme and n >= 6:
        full[4, col_off + int(tokens[4])] = 1e4 if dtype == torch.float16 else 1e30  # huge logit
        full[5, col_off : col_off + v // 2] = -math.inf  # -inf logits (entropy and its gradient)
        tokens[5] = v - 1
    rollout = (-torch.rand(n, generator=g, dtype=torch.float64) * 4.0).to(acc)
    if n >= 2:
        rollout[0] = -math.inf  # mu = 0
    return dict(
        buf=full.to(dtype),
        col_off=col_off,
        v=v,
        tokens=tokens,
        rollout=rollout,
        adv=torch.randn(n, generator=g, dtype=torch.float64).to(acc),
        topk_ids=torch.randint(0, v, (n, k), generator=g),
        topk_lp=(torch.log_softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1) - 0.1).to(acc),
        anchor=(-torch.rand(n, generator=g, dtype=torch.float64) * 4.0).to(acc),
    )


def logits_of(c, buf=None):
    buf = c["buf"] if buf is None else buf
    return buf[:, c["col_off"] : c["col_off"] + c["v"]]


def on(c, dev):
    return {key: (val.to(dev) if torch.is_tensor(val) else val) for key, val in c.items()}


def forward(c, mode, entropy, anchor, temperature):
    topk = mode in TOPK_MODES
    return torch.ops.dppo.dppo_loss_forward(
        logits_of(c),
        c["tokens"],
        c["rollout"],
        c["adv"],
        c["topk_ids"] if topk else None,
        c["topk_lp"] if topk else None,
        c["anchor"] if anchor else None,
        mode,
        temperature,
        DELTA_LOW,
        DELTA_HIGH,
        10.0,
        entropy,
    )


def reference(c, mode, entropy, anchor, temperature):
    """The forward outputs in float64 (tuple in the op's order), from the readable reference."""
    topk = mode in TOPK_MODES
    out = dppo_loss_reference(
        logits_of(c).double().cpu(),
        c["tokens"].cpu(),
        c["rollout"].double().cpu(),
        c["adv"].double().cpu(),
        topk_ids=c["topk_ids"].cpu() if topk else None,
        topk_logprobs=c["topk_lp"].double().cpu() if topk else None,
        anchor_logprobs=c["anchor"].double().cpu() if anchor else None,
        mode=mode,
        temperature=temperature,
        delta_low=DELTA_LOW,
        delta_high=DELTA_HIGH,
        ratio_cap=10.0,
        compute_entropy=entropy,
    )
    return tuple(out[name].detach() for name in NAMES)


def reference_grad(logits, tokens, gt, gh, lse, ent, temperature):
    """[N, V] float64 gradient from the contract, given the lse and entropy fed to the kernel. s = z / T
    is formed as the kernel forms it, z * (1 / T) rounded to the accumulation dtype (the dtype of
    lse), so that s - lse is exactly 0 where the kernel's is (a float64 z / T minus a float lse would
    leave a rounding residual of ~1e22 for logits of 1e30); everything after it is float64."""
    acc = lse.dtype
    z = (logits.cpu().to(acc) * torch.tensor(1.0 / temperature, dtype=torch.float64).to(acc)).double()
    logp = z - lse.double().cpu()[:, None]
    p = torch.exp(logp)
    tokens = tokens.cpu()
    valid = (tokens >= 0) & (tokens < z.shape[1])
    onehot = torch.zeros_like(z)
    onehot[valid, tokens[valid]] = 1.0
    g = gt.double().cpu()[:, None] * (onehot - p)
    if gh is not None:
        ent_term = torch.where(p > 0, p * (logp + ent.double().cpu()[:, None]), torch.zeros_like(p))
        g = g - gh.double().cpu()[:, None] * ent_term
    return torch.where(valid[:, None], g / temperature, torch.zeros_like(g))


def close(tag, got, want, tol, skip=None):
    got, want = got.double().cpu(), want.double().cpu()
    bad = ~((got - want).abs() <= tol * (1.0 + want.abs()))
    bad &= ~(got.isnan() & want.isnan()) & ~(got.isinf() & want.isinf() & (got.sign() == want.sign()))
    if skip is not None:
        bad &= ~skip
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        failures.append(
            f"{tag}: {int(bad.sum())}/{bad.numel()} off, first at {i}: kernel={got.flatten()[i].item()!r} "
            f"exact={want.flatten()[i].item()!r}"
        )


def close_grad(tag, got, want, tol, atol):
    """Error relative to each row's largest |grad|, plus atol [N] (zero rows must be exactly zero)."""
    got, want = got.double().cpu(), want.double()
    scale = want.abs().amax(dim=1, keepdim=True)
    err = (got - want).abs()
    bad = ~(err <= tol * scale + atol.double().cpu()[:, None]) & ~(got.isnan() & want.isnan())
    bad &= ~(got.isinf() & want.isinf() & (got.sign() == want.sign()))
    if bad.any():
        i, j = bad.nonzero()[0].tolist()
        failures.append(
            f"{tag}: {int(bad.sum())} off, first at [{i}, {j}]: kernel={got[i, j].item()!r} exact={want[i, j].item()!r}"
        )


def grad_atol(acc, gt, gh, lse, ent, temperature):
    """[N] absolute slack for the gradient: the kernel forms log p = z / T - lse in the accumulation
    dtype, whose rounding (a few eps * |lse|) shows as an absolute error ~ |g| * eps * |lse| / T; it
    matters only where every |grad| of a row is tiny (pi -> 1)."""
    eps = 1e-15 if acc == torch.float64 else 1e-6
    g = gt.abs() if gh is None else gt.abs() + gh.abs() * (1 + ent.abs() + lse.abs())
    return eps * (1 + lse.abs()) * g / temperature


class DryRunStop(Exception):
    """Raised at the first GPU call of a --dry-run."""


DRY_RUN = False


def check(c, mode, entropy, dev, label, anchor, temperature=0.7):
    dtype = c["buf"].dtype
    tag = f"{label} {mode} {str(dtype)[6:]} entropy={entropy} anchor={anchor}"
    out_r = reference(c, mode, entropy, anchor, temperature)
    if DRY_RUN:
        raise DryRunStop(f"{tag}: inputs and float64 reference built")
    g = on(c, dev)
    out_g = forward(g, mode, entropy, anchor, temperature)
    # A mask may flip only where the divergence (or pi - mu) sits on a threshold.
    div, pi = out_r[2], out_r[1].exp()
    mu = (c["anchor"] if anchor else c["rollout"]).double().exp()
    flipped = out_g[3].cpu().double() != out_r[3]
    near = (pi - mu).abs() < 1e-5
    for t in (DELTA_LOW, DELTA_HIGH, 1 - DELTA_LOW, 1 + DELTA_HIGH):
        near |= (div - t).abs() < 1e-3
    if (flipped & ~near).any():
        failures.append(f"{tag}: mask differs away from a threshold at rows {flipped.nonzero().flatten().tolist()[:8]}")
    for name, a, b in zip(NAMES, out_g, out_r):
        close(f"{tag} {name}", a, b, TOL[dtype], flipped if name in ("loss", "mask") else None)
    gen = torch.Generator().manual_seed(7)
    n = c["tokens"].shape[0]
    acc = out_g[0].dtype
    gt = torch.randn(n, generator=gen, dtype=torch.float64).to(acc).to(dev)
    gh = (torch.randn(n, generator=gen, dtype=torch.float64) * 0.3).to(acc).to(dev)
    for with_ent in (False, True) if entropy else (False,):
        ghg, eg = (gh, out_g[5]) if with_ent else (None, None)
        want = reference_grad(logits_of(c), c["tokens"], gt, ghg, out_g[6], eg, temperature)
        grad_g = torch.ops.dppo.dppo_loss_backward(gt, ghg, logits_of(g), g["tokens"], out_g[6], eg, temperature)
        atol = grad_atol(acc, gt, ghg, out_g[6], eg, temperature)
        close_grad(f"{tag} grad entropy_grad={with_ent}", grad_g, want, GRAD_TOL[dtype], atol)
        buf2 = g["buf"].clone()
        torch.ops.dppo.dppo_loss_backward_(gt, ghg, logits_of(g, buf2), g["tokens"], out_g[6], eg, temperature)
        close_grad(f"{tag} in-place grad entropy_grad={with_ent}", logits_of(g, buf2), want, GRAD_TOL[dtype], atol)
        outside = torch.ones(buf2.shape, dtype=torch.bool, device=dev)
        outside[:, c["col_off"] : c["col_off"] + c["v"]] = False
        if not torch.equal(buf2[outside], g["buf"][outside]):
            failures.append(f"{tag} in-place backward wrote outside the logits view")


def check_large(dev):
    """N * V > 2^31 elements (bf16, 4.3 GB): forward + backward on the GPU, the last 3 rows (element
    offsets beyond 2^31) compared with float64 PyTorch on those rows alone."""
    n, v = 14200, 151936
    gen = torch.Generator().manual_seed(5)
    buf = torch.empty(n, v, dtype=torch.bfloat16, device=dev)
    for i in range(0, n, 2048):
        buf[i : i + 2048].normal_(0.0, 3.0)
    c = dict(
        buf=buf,
        col_off=0,
        v=v,
        tokens=torch.randint(0, v, (n,), generator=gen),
        rollout=-torch.rand(n, generator=gen) * 4.0,
        adv=torch.randn(n, generator=gen),
        topk_ids=torch.randint(0, v, (n, 20), generator=gen),
        topk_lp=torch.log_softmax(torch.randn(n, 20, generator=gen), -1) - 0.1,
        anchor=-torch.rand(n, generator=gen) * 4.0,
    )
    c["tokens"][-1] = v - 1
    rows = slice(n - 3, n)
    last = {key: (val[rows] if torch.is_tensor(val) else val) for key, val in c.items()}
    g = on(c, dev)
    gt = torch.randn(n, generator=gen).to(dev)
    for mode in ("binary_tv", "topk_kl"):
        out_g = forward(g, mode, True, False, 1.0)
        out_r = reference(last, mode, True, False, 1.0)
        for name, a, b in zip(NAMES, out_g, out_r):
            close(f"large N*V>2^31 {mode} {name}", a[rows], b, TOL[torch.bfloat16])
        grad_g = torch.ops.dppo.dppo_loss_backward(gt, None, buf, g["tokens"], out_g[6], None, 1.0)
        want = reference_grad(last["buf"], last["tokens"], gt[rows], None, out_g[6][rows], None, 1.0)
        atol = grad_atol(torch.float32, gt[rows], None, out_g[6][rows], None, 1.0)
        close_grad(f"large N*V>2^31 {mode} grad", grad_g[rows], want, GRAD_TOL[torch.bfloat16], atol)
        del grad_g


def vp_offsets(v, world):
    """[W + 1] uneven column offsets: rank 0 about half, rank 1 a single column (W = 3), the rest the remainder."""
    if world == 1:
        return [0, v]
    if world == 2:
        return [0, (2 * v) // 5, v]
    return [0, v // 2, v // 2 + 1, v]


def check_vocab_parallel(dev, dtypes, modes, worlds=(1, 2, 3)):
    """torch.ops.dppo.dppo_vocab_parallel_stats / _epilogue on the GPU, as W simulated ranks in one process: each
    rank's statistics from its column slice of the logits (even ranks a view at the full row stride, odd ranks a
    contiguous copy), stacked [W, N, 4 + K] as the all-gather would, then the epilogue; the seven outputs against
    the float64 reference on the whole logits. The emulator runs these kernels on the CPU; only here does their
    host side (the offsets handed to the epilogue, the statistics' layout on the device) meet a GPU. Returns the
    number of checks."""
    checks = 0
    for dtype in dtypes:
        c = make_case(7, 1003, dtype, 5, 1, 3, seed=1003, extreme=True)
        ref_rows = dict(c)
        for world in worlds:
            offsets = vp_offsets(c["v"], world)
            # Every rank owns a sampled token: row 5 + r samples the first column of rank r (rows 0-4 keep their roles).
            tokens = c["tokens"].clone()
            for r in range(world):
                if 5 + r < tokens.shape[0]:
                    tokens[5 + r] = offsets[r]
            ref_rows["tokens"] = tokens
            for mode in modes:
                tag = f"vocab-parallel W={world} {mode} {str(dtype)[6:]}"
                out_r = reference(ref_rows, mode, True, False, 0.7)
                if DRY_RUN:
                    raise DryRunStop(f"{tag}: inputs and float64 reference built")
                g = on(ref_rows, dev)
                logits = logits_of(g)
                topk = mode in TOPK_MODES
                ids = g["topk_ids"] if topk else None
                slices = [
                    logits[:, a:b] if r % 2 == 0 else logits[:, a:b].contiguous()
                    for r, (a, b) in enumerate(zip(offsets, offsets[1:]))
                ]
                stats = torch.stack(
                    [
                        torch.ops.dppo.dppo_vocab_parallel_stats(z, g["tokens"], ids, a, 0.7, True)
                        for z, a in zip(slices, offsets)
                    ]
                )
                out_g = torch.ops.dppo.dppo_vocab_parallel_epilogue(
                    stats,
                    offsets,
                    g["tokens"],
                    g["rollout"],
                    g["adv"],
                    ids,
                    g["topk_lp"] if topk else None,
                    None,
                    mode,
                    DELTA_LOW,
                    DELTA_HIGH,
                    10.0,
                    True,
                )
                div, pi = out_r[2], out_r[1].exp()
                flipped = out_g[3].cpu().double() != out_r[3]
                near = (pi - ref_rows["rollout"].double().exp()).abs() < 1e-5
                for t in (DELTA_LOW, DELTA_HIGH, 1 - DELTA_LOW, 1 + DELTA_HIGH):
                    near |= (div - t).abs() < 1e-3
                if (flipped & ~near).any():
                    failures.append(
                        f"{tag}: mask differs away from a threshold at rows {flipped.nonzero().flatten().tolist()}"
                    )
                for name, a, b in zip(NAMES, out_g, out_r):
                    close(f"{tag} {name}", a, b, TOL[dtype], flipped if name in ("loss", "mask") else None)
                checks += 1
    return checks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--large", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="stop before the first GPU call")
    args = ap.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run
    dev = torch.device(args.device)
    try:
        run(args, dev)
    except DryRunStop as stop:
        print(f"dry run: stopped before the first GPU call ({stop})")


def run(args, dev):
    # (label, n, v, k, col_off, row_pad, extreme)
    cases = [
        ("small-misaligned", 7, 1003, 5, 1, 3, True),
        ("split-vocab", 3, 20011, 64, 3, 0, False),
        ("aligned", 9, 4096, 1, 0, 0, False),
        ("v=1", 2, 1, 1, 0, 0, False),
    ]
    dtypes = [torch.float32, torch.bfloat16]
    modes, entropies = MODES, (True, False)
    if args.tiny:
        cases, dtypes, modes, entropies = cases[:2], [torch.bfloat16], ("binary_kl", "topk_tv"), (True,)
    elif args.quick:
        cases = [cases[0], cases[1], cases[3]]
    else:
        cases += [("many-rows", 1500, 3001, 20, 0, 5, True), ("n=1-split", 1, 65543, 20, 1, 0, False)]
        dtypes += [torch.float16, torch.float64]
    checks = 0
    try:
        checks += check_vocab_parallel(dev, dtypes[:2], ("binary_tv", "topk_kl") if args.tiny else MODES)
    except DryRunStop as stop:  # the dry run goes on to the loss's first case, which stops it
        print(f"dry run: the vocabulary-parallel check stopped before its first GPU call ({stop})")
    for label, n, v, k, col_off, row_pad, extreme in cases:
        for dtype in dtypes:
            c = make_case(n, v, dtype, min(k, v), col_off, row_pad, seed=n * 31 + v, extreme=extreme)
            for mode in modes:
                if v == 1 and mode in TOPK_MODES:
                    # K = V = 1: q_rest = 1 - q_1 cancels in the accumulation dtype (the contract's
                    # 1e-12 floor sits far below fp32's ~1e-7 resolution), so there is nothing to compare.
                    continue
                for entropy in entropies:
                    check(c, mode, entropy, dev, label, anchor=(mode == "binary_tv" and entropy))
                    checks += 1
    # The blocks per row, forced through DPPO_CUDA_SPLIT (read by the launcher at every call): without
    # it a GPU never takes the split path once N >= 4 x SMs (many-rows), and never the one-block-per-
    # row path for a short batch with a long vocabulary (split-vocab). 150 > 128 finishing threads.
    splits = ("3",) if args.tiny else ("1", "7") if args.quick else ("1", "2", "7", "150")
    split_modes = ("binary_kl", "topk_tv")
    for split in splits:
        os.environ["DPPO_CUDA_SPLIT"] = split
        for label, n, v, k, col_off, row_pad, extreme in cases:
            if v == 1 or label == "aligned":
                continue
            for dtype in dtypes[:2]:
                c = make_case(n, v, dtype, min(k, v), col_off, row_pad, seed=n * 31 + v, extreme=extreme)
                for mode in split_modes:
                    check(c, mode, True, dev, f"{label} DPPO_CUDA_SPLIT={split}", anchor=False)
                    checks += 1
    os.environ.pop("DPPO_CUDA_SPLIT", None)
    empty = on(make_case(0, 17, torch.float32, 3, 0, 0, 0, False), dev)
    if any(o.numel() for o in forward(empty, "binary_tv", True, False, 1.0)):
        failures.append("N=0: non-empty outputs")
    if args.large:
        check_large(dev)
        checks += 2
    print(f"{checks} checks, {len(failures)} failures")
    for f in failures[:40]:
        print("FAIL", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"checks": checks, "failures": failures}, fh, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()

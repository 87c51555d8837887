"""How far the fused-linear gradients are from exact, against the logits path's own error, per accumulation dtype.

For 16-bit inputs, a training step of ``fused_linear_dppo_loss`` sums the weight gradient over row chunks either in
the input dtype itself (the default: one rounding per chunk, no float32 accumulator) or in float32
(``accum_dtype=torch.float32``). This script measures both, and the logits path (``hidden @ weight.T`` then
``dppo_loss``), against the same step in float64 on the same rounded inputs:

    relative error = ||grad - grad_float64|| / ||grad_float64||   (Frobenius norm; also the largest element error
                                                                   over the largest element)

    python benchmarks/fused_linear_accuracy.py                        # N=2048, H=512, V=32768, bf16
    python benchmarks/fused_linear_accuracy.py --n 8192 --chunk-sizes 256,512

Prints a table and writes ``<out-dir>/fused_linear_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from dppo_ext import dppo_loss, fused_linear_dppo_loss  # noqa: E402
from dppo_ext._lm_head_tiles import plan_chunks  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MODE = "binary_tv"


def _inputs(n: int, h: int, v: int, seed: int, weight_scale: float) -> dict:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64) * weight_scale
    tokens = torch.randint(0, v, (n,), generator=gen)
    rollout = -3.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    advantages = torch.randn(n, generator=gen, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, tokens=tokens, rollout=rollout, advantages=advantages)


def _grads(x: dict, dtype: torch.dtype, path: str, chunk: int | None = None, accum=None) -> dict:
    hidden = x["hidden"].to(dtype).requires_grad_(True)
    weight = x["weight"].to(dtype).requires_grad_(True)
    args = (
        x["tokens"],
        x["rollout"].float() if dtype != torch.float64 else x["rollout"],
        x["advantages"].float() if dtype != torch.float64 else x["advantages"],
    )
    if path == "logits":
        loss = dppo_loss(hidden @ weight.t(), *args, mode=MODE)[0]
    else:
        loss = fused_linear_dppo_loss(hidden, weight, *args, mode=MODE, chunk_size=chunk, accum_dtype=accum)[0]
    loss.backward()
    return {"hidden": hidden.grad, "weight": weight.grad}


def _errors(got: dict, ref: dict) -> dict:
    out = {}
    for key, want in ref.items():
        diff = got[key].double() - want
        out[f"{key}_rel_fro"] = (diff.norm() / want.norm()).item()
        out[f"{key}_rel_max"] = (diff.abs().max() / want.abs().max()).item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--chunk-sizes", default="", help="comma list of rows per chunk (default: the automatic plan)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--weight-scale",
        type=float,
        default=0.05,
        help="std of the weight entries (logits' std = this * sqrt(H) for unit hidden states)",
    )
    parser.add_argument("--out-dir", default="artifacts/fused_linear_accuracy")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    x = _inputs(args.n, args.hidden, args.vocab, args.seed, args.weight_scale)
    rounded = {k: (t.to(dtype).double() if k in ("hidden", "weight") else t) for k, t in x.items()}
    ref = _grads(rounded, torch.float64, "logits")
    chunks = [int(c) for c in args.chunk_sizes.split(",") if c] or [None]
    rows = []
    rows.append({"path": "logits path", "chunk_rows": None, **_errors(_grads(x, dtype, "logits"), ref)})
    for chunk in chunks:
        for accum, label in ((None, f"fused, {args.dtype} sums (default)"), (torch.float32, "fused, float32 sums")):
            plan = plan_chunks(args.n, args.vocab, args.hidden, dtype, chunk_size=chunk, grads_in_forward=True)
            errs = _errors(_grads(x, dtype, "fused", chunk, accum), ref)
            rows.append({"path": label, "chunk_rows": plan.chunk_rows, "chunks": -(-args.n // plan.chunk_rows), **errs})
    print(
        f"N={args.n} H={args.hidden} V={args.vocab} {args.dtype} weight std {args.weight_scale} mode={MODE}: "
        f"relative error against float64 "
        f"on the same rounded inputs (Frobenius; largest element / largest value)"
    )
    print(f"{'path':34s} {'rows':>6s} {'chunks':>6s} {'grad_weight':>12s} {'(max)':>10s} {'grad_hidden':>12s}")
    for r in rows:
        print(
            f"{r['path']:34s} {r['chunk_rows'] or '-':>6} {r.get('chunks', '-'):>6} {r['weight_rel_fro']:12.2e} "
            f"{r['weight_rel_max']:10.2e} {r['hidden_rel_fro']:12.2e}"
        )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("n", "hidden", "vocab", "dtype", "seed", "weight_scale")}
    (out_dir / "fused_linear_accuracy.json").write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    print(f"wrote {out_dir / 'fused_linear_accuracy.json'}")


if __name__ == "__main__":
    main()

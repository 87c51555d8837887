"""pytest-benchmark suite of the fused LM-head + DPPO loss against the logits path it replaces.

One step is forward + backward of the token-mean loss from ``hidden [N, H]`` and ``weight [V, H]`` (both require
grad), the LM-head matmul included:

- ``fused``: ``dppo_ext.fused_linear_dppo_loss`` as a trainer calls it (no ``[N, V]`` logits tensor).
- ``fused_f32sums`` (bfloat16 only): the same with ``accum_dtype=torch.float32`` (the weight gradient summed in a
  float32 accumulator across chunks, not in the bf16 gradient itself).
- ``fused_per_row``: ``fused_linear_dppo_loss_per_row`` with the caller's own token mean (the path whose
  per-row outputs take any upstream gradient).
- ``logits``: ``logits = hidden @ weight.T`` then ``dppo_ext.dppo_loss``; ``logits_inplace`` the same with
  ``inplace_backward=True``.

Phases: ``fwd+bwd`` (a training step) and ``forward`` under ``torch.no_grad`` (evaluation). Sizes from
``DPPO_BENCH_FL_N``, ``DPPO_BENCH_FL_H``, ``DPPO_BENCH_FL_V`` (default 512 x 256, V = 8192: seconds per case);
peak memory is measured by bench_fused_linear.py in fresh processes, not here.

    pytest benchmarks/test_bench_fused_linear.py --benchmark-only
    DPPO_BENCH_FL_N=2048 DPPO_BENCH_FL_H=512 DPPO_BENCH_FL_V=32768 pytest benchmarks/test_bench_fused_linear.py \\
        --benchmark-only                                   # the size docs/results.md states
"""

from __future__ import annotations

import os

import pytest
import torch

from dppo_ext import dppo_loss, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row

N = int(os.environ.get("DPPO_BENCH_FL_N", "512"))
H = int(os.environ.get("DPPO_BENCH_FL_H", "256"))
V = int(os.environ.get("DPPO_BENCH_FL_V", "8192"))
ROUNDS = int(os.environ.get("DPPO_BENCH_ROUNDS", "5"))
PATHS = ("fused", "fused_f32sums", "fused_per_row", "logits", "logits_inplace")
PHASES = ("fwd+bwd", "forward")
CASES = [
    (dtype, path, phase)
    for dtype in ("float32", "bfloat16")
    for path in PATHS
    for phase in PHASES
    if not (path == "fused_f32sums" and dtype == "float32")
]  # float32 sums are float32 already
MODE = "binary_tv"


def _inputs(dtype: torch.dtype) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).to(dtype).requires_grad_()
    weight = (0.05 * torch.randn(V, H, generator=gen)).to(dtype).requires_grad_()
    tokens = torch.randint(0, V, (N,), generator=gen)
    rollout = -3.0 * torch.rand(N, generator=gen)
    advantages = torch.randn(N, generator=gen)
    return {"hidden": hidden, "weight": weight, "tokens": tokens, "rollout": rollout, "advantages": advantages}


def _loss(path: str, x: dict) -> torch.Tensor:
    if path in ("fused", "fused_f32sums"):
        accum = torch.float32 if path == "fused_f32sums" else None
        loss, _ = fused_linear_dppo_loss(
            x["hidden"], x["weight"], x["tokens"], x["rollout"], x["advantages"], mode=MODE, accum_dtype=accum
        )
        return loss
    if path == "fused_per_row":
        out = fused_linear_dppo_loss_per_row(
            x["hidden"], x["weight"], x["tokens"], x["rollout"], x["advantages"], mode=MODE
        )
        return out.loss.sum() / N
    logits = x["hidden"] @ x["weight"].t()
    return dppo_loss(
        logits, x["tokens"], x["rollout"], x["advantages"], mode=MODE, inplace_backward=path == "logits_inplace"
    )[0]


@pytest.mark.parametrize("dtype,path,phase", CASES, ids=["-".join(c) for c in CASES])
def test_fused_linear(benchmark, dtype: str, path: str, phase: str) -> None:
    x = _inputs(getattr(torch, dtype))
    benchmark.group = f"fused linear {dtype} {phase} N={N} H={H} V={V}"
    benchmark.extra_info.update(path=path)

    def train_step() -> torch.Tensor:
        x["hidden"].grad = x["weight"].grad = None
        loss = _loss(path, x)
        loss.backward()
        return loss.detach()

    def evaluate() -> torch.Tensor:
        with torch.no_grad():
            return _loss(path, x)

    loss = benchmark.pedantic(train_step if phase == "fwd+bwd" else evaluate, rounds=ROUNDS, warmup_rounds=1)
    assert loss.dim() == 0 and torch.isfinite(loss)
    if phase == "fwd+bwd":
        assert x["weight"].grad is not None and bool(torch.isfinite(x["weight"].grad).all())

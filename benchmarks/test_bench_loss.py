"""pytest-benchmark suite of the DPPO loss: every contender x mode x dtype, forward / backward / both.

Not part of the normal test run (pyproject's testpaths is python_tests). Run it with

    pytest benchmarks/ --benchmark-only                       # N=512, V=32768
    DPPO_BENCH_N=2048 pytest benchmarks/ --benchmark-only     # the size docs/results.md states

Tests of one mode, dtype and phase share a ``benchmark.group``, so pytest-benchmark prints the
contenders side by side. Memory is not measured here (bench_loss.py measures peaks in fresh
processes); this suite is for timing comparisons and pytest-benchmark's history (--benchmark-save).
"""

from __future__ import annotations

import os

import pytest
import torch
from benchlib import contenders, inputs, timing

N = int(os.environ.get("DPPO_BENCH_N", "512"))
V = int(os.environ.get("DPPO_BENCH_V", "32768"))
K = int(os.environ.get("DPPO_BENCH_K", "20"))
DEVICE = os.environ.get("DPPO_BENCH_DEVICE", "cpu")
ROUNDS = int(os.environ.get("DPPO_BENCH_ROUNDS", "5"))
PHASES = ("forward", "backward", "fwd+bwd")
CONTENDERS = contenders.CPU_CONTENDERS + (contenders.CUDA_ONLY_CONTENDERS if DEVICE.startswith("cuda") else ())

# Ordered so each (mode, dtype, contender) runs its three phases back to back: one compile each.
CASES = [
    (mode, dtype, name, phase)
    for mode in inputs.MODES
    for dtype in ("float32", "bfloat16")
    for name in CONTENDERS
    for phase in PHASES
]

_cache: dict[tuple, tuple] = {}


def _setup(mode: str, dtype: str, name: str) -> tuple:
    """(contender, inputs, leaf, pristine logits) for a case, built once and reused by its phases."""
    key = (mode, dtype, name)
    if key not in _cache:
        _cache.clear()
        try:
            contender = contenders.build_contender(name, mode, DEVICE)
        except contenders.ContenderUnavailable as exc:
            pytest.skip(str(exc))
        inp = inputs.make_inputs(N, V, K, mode, inputs.DTYPES[dtype], DEVICE)
        leaf = contender.make_leaf(inp)
        pristine = inp.logits.detach().clone() if contender.consumes_logits else None
        _cache[key] = (contender, inp, leaf, pristine)
    return _cache[key]


@pytest.mark.parametrize("mode,dtype,name,phase", CASES, ids=["-".join(c) for c in CASES])
def test_dppo_loss(benchmark, mode: str, dtype: str, name: str, phase: str) -> None:
    contender, inp, leaf, pristine = _setup(mode, dtype, name)
    benchmark.group = f"{mode} {dtype} {phase} N={N} V={V}"
    benchmark.extra_info.update(contender=name, note=contender.note)

    def fresh() -> None:
        if pristine is not None:
            timing.restore_logits(leaf, pristine)

    def forward() -> torch.Tensor:
        loss = contender.forward(inp)
        timing.synchronize(DEVICE)
        return loss

    def backward(loss: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(loss, [leaf])
        timing.synchronize(DEVICE)
        return grad

    def both() -> torch.Tensor:
        return backward(forward())

    def setup_backward() -> tuple[tuple, dict]:
        fresh()
        return (forward(),), {}

    if phase == "forward":
        loss = benchmark.pedantic(forward, setup=fresh, rounds=ROUNDS, warmup_rounds=1)
        assert loss.dim() == 0 and torch.isfinite(loss)
        return
    if phase == "backward":
        grad = benchmark.pedantic(backward, setup=setup_backward, rounds=ROUNDS, warmup_rounds=1)
    else:
        grad = benchmark.pedantic(both, setup=fresh, rounds=ROUNDS, warmup_rounds=1)
    assert grad.shape == leaf.shape and bool(torch.isfinite(grad).all())


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_copy_pass(benchmark, dtype: str) -> None:
    """The yardstick of the groups above: one read+write pass over logits of the same size and dtype."""
    logits = torch.randn(N, V, device=DEVICE).to(inputs.DTYPES[dtype])
    copy = timing.CopyPass(logits, DEVICE)
    benchmark.group = f"copy pass {dtype} N={N} V={V}"
    benchmark.extra_info.update(bytes_moved=copy.nbytes)
    benchmark.pedantic(copy.run, rounds=ROUNDS, warmup_rounds=1)
    assert torch.equal(copy.dst, logits)

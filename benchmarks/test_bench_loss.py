"""pytest-benchmark suite of the DPPO loss: every contender x mode x dtype, forward / backward / both.

Not part of the normal test run (pyproject's testpaths is python_tests). Run it with

    pytest benchmarks/ --benchmark-only                       # N=512, V=32768
    DPPO_BENCH_N=2048 pytest benchmarks/ --benchmark-only     # the acceptance size

Tests of one mode, dtype and phase share a ``benchmark.group``, so pytest-benchmark prints the
contenders side by side. Memory is not measured here (bench_loss.py measures peaks in fresh
processes); this suite is for timing comparisons and pytest-benchmark's history (--benchmark-save).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_common as bc  # noqa: E402

N = int(os.environ.get("DPPO_BENCH_N", "512"))
V = int(os.environ.get("DPPO_BENCH_V", "32768"))
K = int(os.environ.get("DPPO_BENCH_K", "20"))
DEVICE = os.environ.get("DPPO_BENCH_DEVICE", "cpu")
ROUNDS = int(os.environ.get("DPPO_BENCH_ROUNDS", "5"))
PHASES = ("forward", "backward", "fwd+bwd")
CONTENDERS = bc.CPU_CONTENDERS + (bc.CUDA_ONLY_CONTENDERS if DEVICE.startswith("cuda") else ())

# Ordered so each (mode, dtype, contender) runs its three phases back to back: one compile each.
CASES = [(mode, dtype, name, phase) for mode in bc.MODES for dtype in ("float32", "bfloat16")
         for name in CONTENDERS for phase in PHASES]

_cache: dict[tuple, tuple] = {}


def _setup(mode: str, dtype: str, name: str) -> tuple:
    """(contender, inputs, leaf, pristine logits) for a case, built once and reused by its phases."""
    key = (mode, dtype, name)
    if key not in _cache:
        _cache.clear()
        try:
            contender = bc.build_contender(name, mode, DEVICE)
        except bc.ContenderUnavailable as exc:
            pytest.skip(str(exc))
        inp = bc.make_inputs(N, V, K, mode, bc.DTYPES[dtype], DEVICE)
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
            bc.restore_logits(leaf, pristine)

    def forward() -> torch.Tensor:
        loss = contender.forward(inp)
        bc.synchronize(DEVICE)
        return loss

    def backward(loss: torch.Tensor) -> torch.Tensor:
        (grad,) = torch.autograd.grad(loss, [leaf])
        bc.synchronize(DEVICE)
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

"""The CPU backward's gradient buffers (csrc/cpu/buffer_cache.h): freed [N, V] gradients are kept resident and
reused, so a steady training loop does not page-fault its gradient in again every step.

What must hold: a reused block is fully overwritten (no stale values, padding rows zero), a live gradient is
never handed out twice, the cache keeps at most two freed blocks, a block serves only requests of at least
half its size, and DPPO_CPU_BUFFER_CACHE=0 turns it off. The page-fault count of a warm backward (a count,
not a timing) shows the reuse.
"""

from __future__ import annotations

import resource
import subprocess
import sys

import torch
from dppo_testing import child_env

from dppo_ext import _native

MIB = 1 << 20


def _backward(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The op's backward with grad_target = 1 per row at lse = logsumexp(logits): softmax - onehot, negated."""
    n = logits.shape[0]
    lse = torch.logsumexp(logits.float(), dim=-1)
    return torch.ops.dppo.dppo_loss_backward(torch.ones(n), None, logits, tokens, lse, None, 1.0)


def _expected(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.double(), dim=-1)
    grad = -p
    valid = tokens >= 0
    rows = torch.arange(logits.shape[0])[valid]
    grad[rows, tokens[valid]] += 1.0
    grad[~valid] = 0.0
    return grad


def _inputs(n: int, v: int, seed: int, pad_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(n, v, generator=gen)
    tokens = torch.randint(0, v, (n,), generator=gen)
    tokens[:pad_rows] = -100
    return logits, tokens


def _cached() -> int:
    return _native.library.cpu_cached_bytes()


def test_reused_block_is_fully_overwritten():
    logits, tokens = _inputs(64, 8192, seed=1)  # 2 MiB of float32: served by the cache
    first = _backward(logits, tokens)
    ptr = first.data_ptr()
    first.fill_(float("nan"))  # what a stale block holds must never show through
    del first
    assert _cached() >= 64 * 8192 * 4
    logits2, tokens2 = _inputs(64, 8192, seed=2, pad_rows=5)
    second = _backward(logits2, tokens2)
    assert second.data_ptr() == ptr, "a freed gradient of the same size should be reused"
    torch.testing.assert_close(second.double(), _expected(logits2, tokens2), atol=1e-6, rtol=1e-4)
    assert bool((second[:5] == 0).all())


def test_live_gradients_never_share_a_block():
    logits, tokens = _inputs(64, 8192, seed=3)
    a = _backward(logits, tokens)
    b = _backward(logits, tokens)
    assert a.data_ptr() != b.data_ptr()
    b.zero_()
    torch.testing.assert_close(a.double(), _expected(logits, tokens), atol=1e-6, rtol=1e-4)


def test_at_most_two_freed_blocks_and_no_small_request_holds_a_big_block():
    # 24, 40 and 72 MiB of float32, larger than anything the other tests left cached: three new blocks.
    grads = [_backward(*_inputs(n, 8192, seed=n)) for n in (768, 1280, 2304)]
    big_ptr = grads[-1].data_ptr()
    for i in range(3):
        grads[i] = None  # freed in this order: the 24 MiB block is the least recently freed
    assert (40 + 72) * MIB <= _cached() <= (40 + 72) * MIB * 9 // 8 + 4 * MIB, "only the two last freed stay"
    small = _backward(*_inputs(64, 8192, seed=8))  # 2 MiB: must not take the 72 MiB block
    assert small.data_ptr() != big_ptr
    again = _backward(*_inputs(2304, 8192, seed=9))
    assert again.data_ptr() == big_ptr


def test_warm_backward_does_not_fault_its_gradient_in():
    # 48 MiB of float32 (12,288 pages of 4 KiB): above glibc's 32 MiB ceiling for recycling freed blocks itself.
    n, v = 768, 16384
    logits, tokens = _inputs(n, v, seed=4)
    lse = torch.logsumexp(logits, dim=-1)
    ones = torch.ones(n)
    _backward(logits, tokens)  # the first use faults the block in once (then frees it)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        grad = torch.ops.dppo.dppo_loss_backward(ones, None, logits, tokens, lse, None, 1.0)
        del grad
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = n * v * 4 // 4096
    assert faults < pages // 4, f"3 warm backwards faulted {faults} pages (a fresh gradient is {pages} pages)"


def test_cache_off_by_environment():
    code = (
        "import torch, dppo_ext.ops; from dppo_ext import _native\n"
        "z = torch.randn(64, 8192); t = torch.zeros(64, dtype=torch.long)\n"
        "g = torch.ops.dppo.dppo_loss_backward(torch.ones(64), None, z, t, torch.logsumexp(z, -1), None, 1.0)\n"
        "del g\n"
        "print(_native.library.cpu_cached_bytes())\n"
    )
    out = {}
    for value in ("0", "1"):
        proc = subprocess.run(
            [sys.executable, "-c", code],
            env=child_env(DPPO_CPU_BUFFER_CACHE=value),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        out[value] = int(proc.stdout.split()[-1])
    assert out["0"] == 0 and out["1"] >= 64 * 8192 * 4

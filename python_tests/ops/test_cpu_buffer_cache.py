"""The CPU backward's gradient buffers (csrc/cpu/buffer_cache.h): freed [N, V] gradients are kept resident and
reused, so a steady training loop does not page-fault its gradient in again every step.

What must hold: a reused block is fully overwritten (no stale values, padding rows zero), a live gradient is
never handed out twice, the cache keeps at most two freed blocks, a block serves only requests of at least
half its size, a freed block that 8 backward calls of any size do not take goes back (a workload that shrinks
does not keep its big block), dppo_ext.empty_cpu_cache() frees every idle block, a cached gradient's storage
resizes like any tensor's (FSDP/ZeRO free a gradient with untyped_storage().resize_(0)), and
DPPO_CPU_BUFFER_CACHE / DPPO_CPU_HUGEPAGES are read as PyTorch's build reads a boolean switch (0/off/no/false/n
turn it off, any case; an unknown value fails the import, naming the variable). The page-fault
count of a warm backward (a count, not a timing) shows the reuse.
"""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch
from dppo_testing import child_env

import dppo_ext
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


def test_a_shrinking_workload_returns_its_big_block():
    dppo_ext.empty_cpu_cache()
    big = _backward(*_inputs(2304, 8192, seed=10))  # 72 MiB
    del big
    assert _cached() >= 72 * MIB
    small_inputs = _inputs(64, 8192, seed=11)  # 2 MiB: never served by the 72 MiB block
    for step in range(8):
        assert _cached() >= 72 * MIB, f"the big block went back after only {step} smaller steps"
        small = _backward(*small_inputs)
        del small
    assert _cached() < 8 * MIB, f"after 8 small steps the cache still holds {_cached() / MIB:.0f} MiB"


def test_steps_too_small_for_the_cache_return_the_big_block_too():
    dppo_ext.empty_cpu_cache()
    big = _backward(*_inputs(2304, 8192, seed=13))  # 72 MiB
    del big
    tiny_inputs = _inputs(16, 4096, seed=14)  # 256 KiB: at::empty serves it, yet it passes the big block over
    for _ in range(8):
        tiny = _backward(*tiny_inputs)
        del tiny
    assert _cached() == 0, f"after 8 small steps the cache still holds {_cached() / MIB:.0f} MiB"


def test_empty_cpu_cache_frees_every_idle_block():
    grads = [_backward(*_inputs(n, 8192, seed=n)) for n in (256, 512)]
    del grads
    held = _cached()
    assert held >= (256 + 512) * 8192 * 4
    assert dppo_ext.cpu_cached_bytes() == held
    assert dppo_ext.empty_cpu_cache() == held
    assert _cached() == 0 and dppo_ext.cpu_cached_bytes() == 0
    assert dppo_ext.empty_cpu_cache() == 0


def test_cached_gradient_storage_resizes_like_any_tensor():
    logits, tokens = _inputs(64, 8192, seed=12)
    want = _expected(logits, tokens)
    grad = _backward(logits, tokens)
    kept = grad.clone()
    dppo_ext.empty_cpu_cache()
    grad.untyped_storage().resize_(0)  # FSDP/ZeRO's way to free a gradient's memory, keeping the tensor
    assert grad.untyped_storage().nbytes() == 0
    assert _cached() >= 64 * 8192 * 4, "the freed storage's block should go back to the cache"
    grad.untyped_storage().resize_(64 * 8192 * 4)
    grad.copy_(kept)
    torch.testing.assert_close(grad.double(), want, atol=1e-6, rtol=1e-4)
    other = _backward(logits, tokens)
    other.resize_(128, 8192)  # growing: moves to the allocator, the first half kept
    torch.testing.assert_close(other[:64].double(), want, atol=1e-6, rtol=1e-4)
    other.resize_(8)
    assert other.shape == (8,)


def _cached_after_one_backward(**env: str) -> subprocess.CompletedProcess:
    code = (
        "import torch, dppo_ext.ops; from dppo_ext import _native\n"
        "z = torch.randn(64, 8192); t = torch.zeros(64, dtype=torch.long)\n"
        "g = torch.ops.dppo.dppo_loss_backward(torch.ones(64), None, z, t, torch.logsumexp(z, -1), None, 1.0)\n"
        "del g\n"
        "print(_native.library.cpu_buffer_cache, _native.library.cpu_cached_bytes())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


# tools/setup_helpers/env.py's spellings (how PyTorch's build reads its switches), in any case; empty is unset.
OFF = ("0", "off", "no", "false", "n")
ON = ("1", "on", "yes", "true", "y")


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "false", "OFF", "No", "n", "1", "true", "On", "YES", "Y", ""])
def test_cache_switch_reads_like_a_torch_boolean(value):
    proc = _cached_after_one_backward(DPPO_CPU_BUFFER_CACHE=value)
    assert proc.returncode == 0, proc.stderr
    enabled, cached = proc.stdout.split()[-2:]
    if value.lower() in OFF:
        assert (enabled, int(cached)) == ("False", 0)
    else:
        assert value.lower() in ON + ("",)
        assert enabled == "True" and int(cached) >= 64 * 8192 * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["DPPO_CPU_BUFFER_CACHE", "DPPO_CPU_HUGEPAGES"])
@pytest.mark.parametrize("value", ["disabled", "2", " 0", "0 "])
def test_switches_refuse_an_unknown_value_at_import(name, value):
    proc = _cached_after_one_backward(**{name: value})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: dppo_ext._C: "), proc.stderr
    assert f"{name}='{value}' is not a boolean" in last  # quoted: a stray space shows
    assert "1, on, yes, true, y (enable) or 0, off, no, false, n (disable)" in last

"""One rank of the vocabulary-parallel sampling-replay test (python_tests/ops/test_replay.py): gloo, env:// rendezvous.

Every rank builds the same global inputs with ``kept_ids`` (python_tests/ops/test_replay.py's ``replay_inputs``),
runs the real API on its slice (``dppo_loss(..., vocab_parallel_group=)``, ``dppo_loss_per_row`` on a DTensor
sharded on V, ``fused_linear_dppo_loss`` with a sharded LM head) and compares the loss, metrics, per-row outputs and
the gathered gradients with the single-device op. Each comparison is recorded (name, ok, error) in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from clean_exit import exit_after

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
from test_replay import replay_inputs  # noqa: E402

from dppo_ext import dppo_loss, dppo_loss_per_row, fused_linear_dppo_loss  # noqa: E402
from dppo_ext.vocab_parallel import even_vocab_offsets  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-10)


def _batched(inputs: dict) -> dict:
    valid = inputs["tokens"] != -100
    out = dict(
        tokens=torch.where(valid, inputs["tokens"], 0)[None],
        rollout_logprobs=inputs["rollout_logprobs"][None],
        advantages=inputs["advantages"][None],
        response_mask=valid[None],
        kept_ids=inputs["kept_ids"][None],
        temperature=inputs["temperature"],
    )
    for key in ("topk_ids", "topk_logprobs"):
        if key in inputs:
            out[key] = inputs[key][None]
    return out


def gather_columns(local: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's column slice of an even split, concatenated."""
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)


def check_group(mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = replay_inputs(torch.float64, mode, n=24, v=96, rule="top_p", value=0.9)
    kw = _batched(inputs)
    full = inputs["logits"].clone()[None].requires_grad_(True)
    want_loss, want_metrics = dppo_loss(full, **kw, mode=mode)
    want_loss.backward()
    a, b = even_vocab_offsets(96, world)[rank : rank + 2]
    local = inputs["logits"][None, :, a:b].clone().requires_grad_(True)
    loss, metrics = dppo_loss(local, **kw, mode=mode, vocab_parallel_group=dist.group.WORLD)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, **TOL)
    for key in want_metrics:
        torch.testing.assert_close(metrics[key], want_metrics[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(gather_columns(local.grad, world), full.grad, rtol=1e-9, atol=1e-12)


def check_dtensor_per_row(mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    inputs = replay_inputs(torch.float64, mode, n=24, v=96, rule="min_p", value=0.05)
    kw = {k: x for k, x in inputs.items() if k != "logits"}
    full = inputs["logits"].clone().requires_grad_(True)
    want = dppo_loss_per_row(full, **kw)
    (want.loss.sum() + 0.5 * want.entropy.sum()).backward()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = distribute_tensor(inputs["logits"].clone(), mesh, [Shard(1)]).requires_grad_(True)
    got = dppo_loss_per_row(dt, **kw)
    (got.loss.sum() + 0.5 * got.entropy.sum()).backward()
    for key, value in got._asdict().items():
        torch.testing.assert_close(value, getattr(want, key), **TOL, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(dt.grad.full_tensor(), full.grad, rtol=1e-9, atol=1e-12)


def check_fused(mode: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = replay_inputs(torch.float64, mode, n=24, v=96, rule="top_k", value=6.0)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(24, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(96, 8, generator=gen, dtype=torch.float64)
    kw = _batched(inputs)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want_loss, _ = dppo_loss((h1 @ w1.T)[None], **kw, mode=mode)
    want_loss.backward()
    a, b = even_vocab_offsets(96, world)[rank : rank + 2]
    h2, w2 = hidden.clone().requires_grad_(True), weight[a:b].clone().requires_grad_(True)
    loss, _ = fused_linear_dppo_loss(h2[None], w2, **kw, mode=mode, vocab_parallel_group=dist.group.WORLD)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, **TOL)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(gather_columns(w2.grad.T, world).T, w1.grad, rtol=1e-9, atol=1e-12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    checks = []
    for name, fn in [
        ("group binary_tv", lambda: check_group("binary_tv")),
        ("group topk_kl", lambda: check_group("topk_kl")),
        ("dtensor per-row binary_kl", lambda: check_dtensor_per_row("binary_kl")),
        ("fused binary_tv", lambda: check_fused("binary_tv")),
    ]:
        try:
            fn()
            checks.append({"name": name, "ok": True, "error": ""})
        except Exception:  # recorded for the parent, which asserts on every check
            checks.append({"name": name, "ok": False, "error": traceback.format_exc()[-3000:]})
    Path(args.out).write_text(json.dumps({"rank": dist.get_rank(), "checks": checks}))
    exit_after(dist.barrier)


if __name__ == "__main__":
    main()

"""One rank of the vocabulary-parallel test (python_tests/api/test_vocab_parallel.py): gloo, env:// rendezvous.

Every rank builds the same global inputs, keeps its uneven column slice (``split_offsets``), runs the real API
and compares loss, metrics, per-row outputs and the all-gathered gradient with the single-device op on the
whole logits. Each comparison is recorded (name, ok, error) in ``--out``; the parent asserts on them.
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.distributed as dist
from clean_exit import exit_after
from dppo_testing import TOL, assert_decisive, sample_inputs
from dppo_testing.vocab_parallel import (
    compare_grads,
    compare_outputs,
    owners,
    place_tokens,
    single_device,
    split_offsets,
    tie_rows,
    upstream,
    weighted_sum,
)

from dppo_ext import dppo_loss, dppo_loss_per_row, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row
from dppo_ext.contract import AGG_MODES, DEFAULT_DELTAS, MODES, accumulation_dtype
from dppo_ext.vocab_parallel import even_vocab_offsets


def gather_columns(local: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """All ranks' column slices, concatenated in rank order (uneven widths: padded for the collective)."""
    width = max(b - a for a, b in zip(offsets, offsets[1:]))
    pad = local.new_zeros(local.shape[0], width)
    pad[:, : local.shape[1]] = local
    parts = [torch.empty_like(pad) for _ in offsets[1:]]
    dist.all_gather(parts, pad.contiguous())
    return torch.cat([p[:, : b - a] for p, a, b in zip(parts, offsets, offsets[1:])], dim=1)


def gather_rows(local: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    return gather_columns(local.t().contiguous(), offsets).t()


def check_rowwise(mode: str, dtype: torch.dtype, inplace: bool, derive_offsets: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    offsets = split_offsets(129, world)
    inputs = place_tokens(sample_inputs("cpu", dtype, mode, "v129", seed=3, anchor=mode == "binary_kl"), offsets)
    g = upstream(inputs["tokens"].shape[0], accumulation_dtype(dtype), tie_rows(inputs))
    want_out, want_grad = single_device(inputs, g)
    leaf = inputs["logits"][:, offsets[rank] : offsets[rank + 1]].detach().clone().requires_grad_(True)
    local = leaf * 1  # a non-leaf, as a model's logits are (the in-place backward consumes them)
    kw = {k: v for k, v in inputs.items() if k != "logits"}
    out = dppo_loss_per_row(
        local,
        **kw,
        vocab_parallel_group=dist.group.WORLD,
        inplace_backward=inplace,
        vocab_offsets=None if derive_offsets else offsets,
    )
    weighted_sum(out._asdict(), g).backward()
    assert leaf.grad.shape == (inputs["logits"].shape[0], offsets[rank + 1] - offsets[rank])
    gathered = gather_columns(leaf.grad, offsets)  # collectives first: a failed comparison must not skip one
    name = f"rowwise/{mode}/{dtype}/inplace={inplace}"
    compare_outputs(name, inputs, {k: v.detach() for k, v in out._asdict().items()}, want_out)
    compare_grads(name, inputs, g, gathered, want_grad)


def _sequence_inputs(mode: str, dtype: torch.dtype) -> dict:
    """[B=4, T=9, V=129] inputs with padding (response_mask) and per-sequence advantages.

    The aggregated loss sums every row, so no row may decide its mask at a tie (``assert_decisive``): the
    comparison would then depend on the last bit of each path's log-prob, which differs by host."""
    inputs = sample_inputs("cpu", dtype, mode, "v129", seed=4)
    b, t = 4, 9
    valid = inputs["tokens"][: b * t] != -100
    valid[5:9] = False  # sequence 0 ends early
    valid[18:27] = False  # sequence 2 has no response token
    rows = {k: (v[: b * t] if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()}
    assert_decisive(
        f"sequence inputs {mode}/{dtype}",
        dict(
            rows,
            tokens=torch.where(valid, rows["tokens"], -100),
            delta_low=DEFAULT_DELTAS[mode][0],
            delta_high=DEFAULT_DELTAS[mode][1],
        ),
    )
    out = {
        "logits": inputs["logits"][: b * t].reshape(b, t, -1),
        "tokens": inputs["tokens"][: b * t].clamp(min=0).reshape(b, t),
        "rollout_logprobs": inputs["rollout_logprobs"][: b * t].reshape(b, t),
        "advantages": torch.linspace(-1.5, 2.0, b, dtype=accumulation_dtype(dtype)),
        "response_mask": valid.reshape(b, t),
        "mode": mode,
        "temperature": inputs["temperature"],
    }
    if inputs["topk_ids"] is not None:
        out["topk_ids"] = inputs["topk_ids"][: b * t].reshape(b, t, -1)
        out["topk_logprobs"] = inputs["topk_logprobs"][: b * t].reshape(b, t, -1)
    return out


def check_aggregated(mode: str, agg: str, dtype: torch.dtype, losses: list) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = _sequence_inputs(mode, dtype)
    v = inputs["logits"].shape[-1]
    offsets = split_offsets(v, world)
    full = inputs["logits"].detach().clone().requires_grad_(True)
    kw = {k: x for k, x in inputs.items() if k != "logits"}
    want_loss, want_metrics = dppo_loss(full, **kw, loss_agg_mode=agg)
    want_loss.backward()
    leaf = inputs["logits"][..., offsets[rank] : offsets[rank + 1]].detach().clone().requires_grad_(True)
    loss, metrics = dppo_loss(
        leaf * 1,
        **kw,
        loss_agg_mode=agg,
        vocab_parallel_group=dist.group.WORLD,
        vocab_offsets=offsets,
        inplace_backward=True,
    )
    loss.backward()
    losses.append(loss.item().hex())
    got = gather_columns(leaf.grad.reshape(-1, leaf.shape[-1]), offsets)
    tol = TOL[dtype]
    torch.testing.assert_close(loss, want_loss, rtol=tol["fwd_rtol"], atol=tol["fwd_atol"])
    assert metrics.keys() == want_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(
            metrics[key],
            want_metrics[key],
            rtol=tol["fwd_rtol"],
            atol=tol["fwd_atol"],
            msg=lambda m, key=key: f"metric {key}: {m}",
        )
    torch.testing.assert_close(got, full.grad.reshape(-1, v), rtol=tol["grad_rtol"], atol=tol["grad_atol"])


def check_fused_linear(mode: str, dtype: torch.dtype, chunk_size: int | None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = sample_inputs("cpu", torch.float64, mode, "v129", seed=5)
    n, v, h = inputs["tokens"].shape[0], inputs["logits"].shape[1], 16
    gen = torch.Generator().manual_seed(9)
    hidden0 = (torch.randn(n, h, generator=gen, dtype=torch.float64)).to(dtype)
    weight0 = (torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.5).to(dtype)
    bias0 = (torch.randn(v, generator=gen, dtype=torch.float64) * 0.1).to(dtype)
    offsets = split_offsets(v, world)
    acc = accumulation_dtype(dtype)
    valid = inputs["tokens"] != -100
    kw = dict(
        tokens=inputs["tokens"].clamp(min=0),
        rollout_logprobs=inputs["rollout_logprobs"].to(acc),
        advantages=inputs["advantages"].to(acc),
        response_mask=valid,
        mode=mode,
        topk_ids=inputs["topk_ids"],
        topk_logprobs=None if inputs["topk_logprobs"] is None else inputs["topk_logprobs"].to(acc),
        chunk_size=chunk_size,
    )

    def run(w: torch.Tensor, b: torch.Tensor, **extra):
        hidden = hidden0.clone().requires_grad_(True)
        w = w.clone().requires_grad_(True)
        b = b.clone().requires_grad_(True)
        loss, metrics = fused_linear_dppo_loss(hidden, w, bias=b, **kw, **extra)
        loss.backward()
        return loss, metrics, hidden.grad, w.grad, b.grad

    want = run(weight0, bias0)
    lo, hi = offsets[rank], offsets[rank + 1]
    got = run(weight0[lo:hi], bias0[lo:hi], vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets)
    grad_weight, grad_bias = gather_rows(got[3], offsets), gather_rows(got[4][:, None], offsets)[:, 0]
    tol = TOL[dtype]
    fwd = dict(rtol=tol["fwd_rtol"], atol=tol["fwd_atol"])
    grad = dict(rtol=1e-9, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[0], want[0], **fwd)
    for key in want[1]:
        torch.testing.assert_close(got[1][key], want[1][key], **fwd, msg=lambda m, key=key: f"metric {key}: {m}")
    torch.testing.assert_close(got[2], want[2], **grad, msg=lambda m: f"grad hidden: {m}")
    torch.testing.assert_close(grad_weight, want[3], **grad, msg=lambda m: f"grad weight: {m}")
    torch.testing.assert_close(grad_bias, want[4], **grad, msg=lambda m: f"grad bias: {m}")


def check_dtensor(mode: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = dist.get_world_size()
    inputs = _sequence_inputs(mode, torch.float64)
    full = inputs["logits"].detach().clone().requires_grad_(True)
    kw = {k: x for k, x in inputs.items() if k != "logits"}
    want_loss, want_metrics = dppo_loss(full, **kw)
    want_loss.backward()
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(inputs["logits"].detach().clone(), mesh, [Shard(2)]).requires_grad_(True)
    loss, metrics = dppo_loss(dt, **kw)
    loss.backward()
    grad = dt.grad.full_tensor()
    assert dt.to_local().shape[-1] == even_vocab_offsets(129, world)[1] or dist.get_rank() == world - 1
    torch.testing.assert_close(loss, want_loss, rtol=1e-9, atol=1e-10)
    for key in metrics:
        torch.testing.assert_close(metrics[key], want_metrics[key], rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, full.grad, rtol=1e-9, atol=1e-12)


def check_dtensor_per_row(mode: str) -> None:
    """dppo_loss_per_row on DTensor logits sharded on V: the per-row outputs and gradient of the whole logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    inputs = sample_inputs("cpu", torch.float64, mode, "v129", seed=4)
    kw = {k: v for k, v in inputs.items() if k != "logits"}
    full = inputs["logits"].detach().clone().requires_grad_(True)
    want = dppo_loss_per_row(full, **kw)
    (want.loss.sum() + 0.5 * want.entropy.sum()).backward()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = distribute_tensor(inputs["logits"].detach().clone(), mesh, [Shard(1)]).requires_grad_(True)
    got = dppo_loss_per_row(dt, **kw)
    (got.loss.sum() + 0.5 * got.entropy.sum()).backward()
    for key, value in got._asdict().items():
        torch.testing.assert_close(value, getattr(want, key), rtol=1e-9, atol=1e-10, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(dt.grad.full_tensor(), full.grad, rtol=1e-9, atol=1e-12)


def check_fused_per_row_unreduced_hidden_grad() -> None:
    """fused_linear_dppo_loss_per_row(reduce_hidden_grad=False) leaves each rank its slice's part of the hidden-state
    gradient (as under sequence parallelism); the parts sum to the reduced and to the single-device gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = sample_inputs("cpu", torch.float64, "binary_kl", "v129", seed=7)
    n, v, h = inputs["tokens"].shape[0], inputs["logits"].shape[1], 8
    gen = torch.Generator().manual_seed(11)
    hidden0 = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight0 = torch.randn(v, h, generator=gen, dtype=torch.float64) * 0.5
    offsets = split_offsets(v, world)
    kw = {k: inputs[k] for k in ("tokens", "rollout_logprobs", "advantages", "mode")}

    def hidden_grad(weight: torch.Tensor, **extra) -> torch.Tensor:
        hidden = hidden0.clone().requires_grad_(True)
        out = fused_linear_dppo_loss_per_row(hidden, weight, **kw, **extra)
        (out.loss.sum() + out.logp.sum()).backward()
        return hidden.grad

    want = hidden_grad(weight0)
    local = weight0[offsets[rank] : offsets[rank + 1]]
    sharded = dict(vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets)
    reduced = hidden_grad(local, **sharded)
    part = hidden_grad(local, **sharded, reduce_hidden_grad=False)
    summed = part.clone()
    dist.all_reduce(summed)
    torch.testing.assert_close(reduced, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(summed, want, rtol=1e-9, atol=1e-12)
    assert not torch.allclose(part, want), "reduce_hidden_grad=False still returned the reduced gradient"


def check_wrong_offsets_raise_everywhere() -> None:
    """Offsets that do not match the slices raise the same error on every rank (no rank left in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = sample_inputs("cpu", torch.float32, "binary_tv", "v129")
    offsets = split_offsets(129, world)
    local = inputs["logits"][:, offsets[rank] : offsets[rank + 1]]
    kw = {k: v for k, v in inputs.items() if k != "logits"}
    try:
        dppo_loss_per_row(
            local, **kw, vocab_parallel_group=dist.group.WORLD, vocab_offsets=even_vocab_offsets(129, world)
        )
    except ValueError as exc:
        assert "vocab-parallel split mismatch" in str(exc), str(exc)
    else:
        raise AssertionError("wrong vocab_offsets were accepted")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: list = []
    plan = []
    for mode in MODES:
        for dtype in (torch.float64, torch.bfloat16):
            for inplace in (False, True):
                plan.append(
                    (
                        f"rowwise/{mode}/{dtype}/inplace={inplace}",
                        lambda m=mode, d=dtype, i=inplace: check_rowwise(m, d, i, derive_offsets=i),
                    )
                )
    for agg in AGG_MODES:
        for mode in ("binary_tv", "topk_kl"):
            plan.append(
                (f"aggregated/{mode}/{agg}", lambda m=mode, a=agg: check_aggregated(m, a, torch.float64, losses))
            )
    plan.append(
        (
            "aggregated/binary_kl/token-mean/bf16",
            lambda: check_aggregated("binary_kl", "token-mean", torch.bfloat16, losses),
        )
    )
    for mode in ("topk_tv", "binary_kl"):
        for dtype in (torch.float64, torch.float32):
            plan.append((f"fused_linear/{mode}/{dtype}/chunk=5", lambda m=mode, d=dtype: check_fused_linear(m, d, 5)))
    plan.append(("fused_linear/ratio/float64/auto", lambda: check_fused_linear("ratio", torch.float64, None)))
    for mode in ("binary_tv", "topk_tv"):
        plan.append((f"dtensor/{mode}", lambda m=mode: check_dtensor(m)))
    plan.append(("dtensor/per_row/topk_kl", lambda: check_dtensor_per_row("topk_kl")))
    plan.append(("fused_linear/per_row/reduce_hidden_grad=False", check_fused_per_row_unreduced_hidden_grad))
    plan.append(("wrong_offsets_raise_everywhere", check_wrong_offsets_raise_everywhere))

    checks = []
    for name, fn in plan:
        try:
            fn()
            checks.append({"name": name, "ok": True, "error": ""})
        except Exception:  # noqa: BLE001 - every failure is reported to the parent test
            checks.append({"name": name, "ok": False, "error": traceback.format_exc()[-2000:]})
    offsets = split_offsets(129, world)
    inputs = place_tokens(sample_inputs("cpu", torch.float64, "topk_kl", "v129", seed=3), offsets)
    valid = inputs["tokens"] != -100
    coverage = {
        "token_owners": sorted(set(owners(inputs["tokens"][valid], offsets).tolist())),
        "max_topk_owners_per_row": max(len(set(r.tolist())) for r in owners(inputs["topk_ids"], offsets)),
    }
    with open(args.out, "w") as f:
        json.dump(
            {
                "rank": rank,
                "world": world,
                "planned": [p[0] for p in plan],
                "checks": checks,
                "coverage": coverage,
                "losses": losses,
            },
            f,
        )
    exit_after(dist.barrier)  # not gloo's teardown: see clean_exit.py


if __name__ == "__main__":
    main()

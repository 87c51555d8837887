"""Vocabulary-parallel DPPO (``dppo_ext.vocab_parallel``, ops ``dppo_vocab_parallel_stats`` / ``_epilogue``).

In-process: W simulated ranks (the logits split into uneven column slices, every slice's statistics stacked
as the all-gather would, the epilogue, each slice's backward) against the single-device op on the whole
logits, for every mode, dtype and input case; opcheck of both ops; their error messages.
Distributed: 2 and 3 gloo processes run ``dist_scripts/vocab_parallel_worker.py`` (the real API:
``dppo_loss(..., vocab_parallel_group=)``, the per-row function, in-place backward, every aggregation mode,
the fused linear path with a sharded LM head, DTensor input) and report every comparison; one gloo rank shows
that no call uses a deprecated collective.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dppo_testing import child_env, sample_inputs
from dppo_testing.vocab_parallel import (
    compare_grads,
    compare_outputs,
    owners,
    place_tokens,
    single_device,
    split_offsets,
    tie_rows,
    upstream,
)

from dppo_ext import dppo_loss_per_row
from dppo_ext._autograd import grad_args
from dppo_ext.contract import MODES, TOPK_MODES, accumulation_dtype
from dppo_ext.vocab_parallel import _local_tokens, _slice_backward, even_vocab_offsets, gathered_bytes_per_row

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parents[1] / "dist_scripts" / "vocab_parallel_worker.py"
SIM_CASES = ("v129", "v7_k1", "extreme", "noncontig", "n0")


def simulate(inputs: dict, offsets: list[int], g: dict[str, torch.Tensor], inplace: bool):
    """W ranks in one process: stats per slice -> stacked -> epilogue -> per-slice backward -> concatenated."""
    logits, tokens, t = inputs["logits"].detach(), inputs["tokens"], float(inputs["temperature"])
    mode = inputs["mode"]
    ids = inputs["topk_ids"] if mode in TOPK_MODES else None
    slices = [logits[:, a:b].clone() for a, b in zip(offsets, offsets[1:])]
    stats = torch.stack(
        [torch.ops.dppo.dppo_vocab_parallel_stats(s, tokens, ids, a, t, True) for s, a in zip(slices, offsets)]
    )
    out = torch.ops.dppo.dppo_vocab_parallel_epilogue(
        stats,
        offsets,
        tokens,
        inputs["rollout_logprobs"],
        inputs["advantages"],
        ids,
        inputs["topk_logprobs"] if ids is not None else None,
        inputs["anchor_logprobs"],
        mode,
        inputs["delta_low"],
        inputs["delta_high"],
        inputs["ratio_cap"],
        True,
    )
    out = dict(zip(("loss", "logp", "divergence", "mask", "weight", "entropy", "lse"), out))
    gt, ge, ent = grad_args(
        True, inputs["advantages"], out["mask"], out["weight"], g["loss"], g["logp"], g["entropy"], out["entropy"]
    )
    grads = []
    for s, a in zip(slices, offsets):
        local, foreign = _local_tokens(tokens, a, s.shape[1])
        grads.append(_slice_backward(gt, ge, ent, s, local, foreign, out["lse"], t, inplace))
    if inplace:
        assert all(gr is s for gr, s in zip(grads, slices)), "the in-place backward must write into the slices"
    return out, torch.cat(grads, dim=1)


@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("case", SIM_CASES)
@pytest.mark.parametrize("dtype", (torch.float64, torch.bfloat16), ids=str)
@pytest.mark.parametrize("mode", MODES)
def test_simulated_ranks_match_single_device(mode, dtype, case, world):
    inputs = sample_inputs("cpu", dtype, mode, case, seed=3, anchor=mode == "binary_kl")
    v = inputs["logits"].shape[1]
    offsets = split_offsets(v, world)
    inputs = place_tokens(inputs, offsets)
    g = upstream(inputs["tokens"].shape[0], accumulation_dtype(dtype), tie_rows(inputs))
    want_out, want_grad = single_device(inputs, g)
    for inplace in (False, True):
        got_out, got_grad = simulate(inputs, offsets, g, inplace)
        name = f"{mode}/{dtype}/{case}/W={world}/inplace={inplace}"
        compare_outputs(name, inputs, got_out, want_out)
        compare_grads(name, inputs, g, got_grad, want_grad)


def test_simulated_cases_cover_every_owner():
    """The inputs above put sampled tokens on every rank and spread one row's top-K over several ranks."""
    for world in (2, 3):
        offsets = split_offsets(129, world)
        inputs = place_tokens(sample_inputs("cpu", torch.float64, "topk_kl", "v129", seed=3), offsets)
        valid = inputs["tokens"] != -100
        assert set(owners(inputs["tokens"][valid], offsets).tolist()) == set(range(world))
        topk_owners = owners(inputs["topk_ids"], offsets)
        assert max(len(set(row.tolist())) for row in topk_owners) >= 2
        assert set(topk_owners.flatten().tolist()) == set(range(world))


def test_one_column_slices_and_padding_rows_exact_float64():
    """Every rank a single column (W = V): the most foreign-token rows possible; still the single-device op."""
    inputs = sample_inputs("cpu", torch.float64, "binary_kl", "v7_k1", seed=5)
    offsets = list(range(8))
    g = upstream(inputs["tokens"].shape[0], torch.float64, tie_rows(inputs))
    want_out, want_grad = single_device(inputs, g)
    got_out, got_grad = simulate(inputs, offsets, g, inplace=True)
    compare_outputs("W=V", inputs, got_out, want_out)
    compare_grads("W=V", inputs, g, got_grad, want_grad)


@pytest.mark.parametrize("mode", TOPK_MODES)
def test_a_direction_tie_may_go_either_way(mode):
    """docs/contract.md, "Ties": a row whose mu(a) equals the single-device op's own pi(a) to the last bit, with a
    top-K divergence above delta_low and A < 0, is kept by that op (the comparison pi < mu is strict). The
    vocabulary-parallel path merges the log-sum-exp in another order, so its log-prob may be an ulp lower and the
    row masked: both outcomes are correct. Either way the row holds one of exactly two values (kept: the
    single-device loss; masked: 0) and no other row moves."""
    inputs = sample_inputs("cpu", torch.float64, mode, "v129", seed=3)
    first = dppo_loss_per_row(**inputs)
    valid = inputs["tokens"] != -100
    row = int(((first.divergence > inputs["delta_low"] * 2) & valid).nonzero()[0])
    inputs["rollout_logprobs"] = inputs["rollout_logprobs"].clone()
    inputs["advantages"] = inputs["advantages"].clone()
    inputs["rollout_logprobs"][row] = first.logp[row]
    inputs["advantages"][row] = -1.0
    want = dppo_loss_per_row(**inputs)._asdict()
    assert want["mask"][row] == 1 and want["divergence"][row] > inputs["delta_low"], "the strict tie rule"
    others = torch.ones_like(valid)
    others[row] = False
    zero = {key: torch.zeros(valid.shape[0], dtype=torch.float64) for key in ("loss", "logp", "entropy")}
    outcomes = set()
    for world in (2, 3):
        got, _ = simulate(inputs, split_offsets(129, world), zero, inplace=False)
        outcomes.add(int(got["mask"][row]))
        if got["mask"][row] == 1:
            torch.testing.assert_close(got["loss"][row], want["loss"][row], rtol=1e-12, atol=0.0)
        else:
            assert got["loss"][row] == 0.0
        for key in ("loss", "mask", "weight", "logp", "divergence"):
            torch.testing.assert_close(got[key][others], want[key][others], rtol=1e-9, atol=1e-10)
    assert outcomes <= {0, 1}


def test_stats_layout():
    """The statistics row: max, non-target sum, entropy moment, owned target logit, owned top-K logits."""
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 4.0, 3.0, 2.0]], dtype=torch.float64)
    tokens = torch.tensor([1, 9])  # row 0 owns column 1 (global 11), row 1's token lives elsewhere
    ids = torch.tensor([[10, 13], [0, 12]])
    st = torch.ops.dppo.dppo_vocab_parallel_stats(z, tokens + 10 * torch.tensor([1, 0]), ids, 10, 2.0, True)
    s = z / 2.0
    mx = s.max(1).values
    torch.testing.assert_close(st[:, 0], mx)
    torch.testing.assert_close(st[0, 1], (s[0] - mx[0]).exp().sum() - (s[0, 1] - mx[0]).exp())
    torch.testing.assert_close(st[1, 1], (s[1] - mx[1]).exp().sum())
    x = s - mx[:, None]
    torch.testing.assert_close(st[:, 2], (x.exp() * x).sum(1))
    torch.testing.assert_close(st[:, 3], torch.tensor([s[0, 1], 0.0], dtype=torch.float64))
    torch.testing.assert_close(st[:, 4:], torch.tensor([[s[0, 0], s[0, 3]], [0.0, s[1, 2]]], dtype=torch.float64))


def test_all_minus_inf_slice_is_empty():
    """A slice whose logits are all -inf (e.g. masked vocabulary padding) contributes no mass."""
    inputs = sample_inputs("cpu", torch.float64, "binary_tv", "v129", seed=6)
    z = inputs["logits"].clone()
    z[:, 100:] = -torch.inf
    inputs = dict(inputs, logits=z)
    inputs["tokens"] = torch.where(inputs["tokens"] >= 100, torch.zeros_like(inputs["tokens"]), inputs["tokens"])
    g = upstream(z.shape[0], torch.float64, tie_rows(inputs))
    want_out, want_grad = single_device(inputs, g)
    got_out, got_grad = simulate(inputs, [0, 100, 129], g, inplace=False)
    compare_outputs("-inf slice", inputs, got_out, want_out)
    compare_grads("-inf slice", inputs, g, got_grad, want_grad)


@pytest.mark.parametrize("kind", ("nan_one_slice", "nan_row", "posinf", "neginf_row"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=str)
def test_simulated_nonfinite_rows_are_nan_like_single_device(dtype, kind):
    """A row without a distribution (docs/contract.md) is all NaN across ranks too, its gradient NaN in every
    slice; the other rows are untouched. The NaN sits in one rank's slice only for nan_one_slice / posinf."""
    inputs = sample_inputs("cpu", dtype, "binary_tv", "v129", seed=7)
    offsets = split_offsets(129, 3)
    inputs = place_tokens(inputs, offsets)
    z = inputs["logits"].clone()
    bad = 5
    col = offsets[1] + 3 if int(inputs["tokens"][bad]) != offsets[1] + 3 else offsets[1] + 4
    if kind == "nan_one_slice":
        z[bad, col] = float("nan")
    elif kind == "nan_row":
        z[bad] = float("nan")
    elif kind == "posinf":
        z[bad, col] = float("inf")
    else:
        z[bad] = -float("inf")
    inputs = dict(inputs, logits=z)
    g = upstream(z.shape[0], accumulation_dtype(dtype), tie_rows(dict(inputs, logits=z.nan_to_num())))
    want_out, want_grad = single_device(inputs, g)
    got_out, got_grad = simulate(inputs, offsets, g, inplace=False)
    keep = torch.arange(z.shape[0]) != bad
    for key, value in got_out.items():
        assert torch.isnan(value[bad]), f"{kind}: {key} of the non-finite row is {value[bad].item()}"
        assert torch.isnan(want_out[key][bad]), key
        torch.testing.assert_close(value[keep], want_out[key][keep])
    assert torch.isnan(got_grad[bad]).all()
    torch.testing.assert_close(got_grad[keep], want_grad[keep])


@pytest.mark.parametrize("mode", ("binary_kl", "topk_tv"))
def test_opcheck(mode):
    inputs = sample_inputs("cpu", torch.float32, mode, "v129", anchor=True)
    ids = inputs["topk_ids"]
    z = inputs["logits"][:, 50:]
    torch.library.opcheck(torch.ops.dppo.dppo_vocab_parallel_stats.default, (z, inputs["tokens"], ids, 50, 0.7, True))
    stats = torch.stack(
        [
            torch.ops.dppo.dppo_vocab_parallel_stats(inputs["logits"][:, a:b], inputs["tokens"], ids, a, 1.0, True)
            for a, b in ((0, 50), (50, 129))
        ]
    )
    torch.library.opcheck(
        torch.ops.dppo.dppo_vocab_parallel_epilogue.default,
        (
            stats,
            [0, 50, 129],
            inputs["tokens"],
            inputs["rollout_logprobs"],
            inputs["advantages"],
            ids,
            inputs["topk_logprobs"],
            inputs["anchor_logprobs"],
            mode,
            0.1,
            0.2,
            10.0,
            True,
        ),
    )


def _epilogue_args(**over):
    inputs = sample_inputs("cpu", torch.float32, "topk_kl", "v129")
    stats = torch.zeros(2, 37, 4 + inputs["topk_ids"].shape[1])
    args = dict(
        stats=stats,
        vocab_offsets=[0, 50, 129],
        tokens=inputs["tokens"],
        rollout_logprobs=inputs["rollout_logprobs"],
        advantages=inputs["advantages"],
        topk_ids=inputs["topk_ids"],
        topk_logprobs=inputs["topk_logprobs"],
        anchor_logprobs=None,
        mode="topk_kl",
        delta_low=0.1,
        delta_high=0.1,
        ratio_cap=10.0,
        compute_entropy=True,
    )
    args.update(over)
    return list(args.values())


@pytest.mark.parametrize(
    "over, err, match",
    [
        ({"vocab_offsets": [0, 50]}, ValueError, r"vocab_offsets must have W \+ 1 = 3 entries"),
        ({"vocab_offsets": [0, 50, 50]}, ValueError, "strictly increasing"),
        ({"vocab_offsets": [1, 50, 129]}, ValueError, r"vocab_offsets\[0\] must be 0"),
        ({"stats": torch.zeros(2, 37, 3)}, ValueError, r"stats must be 3-D \[W, N, 4 \+ K\]"),
        ({"stats": torch.zeros(2, 37, 5)}, ValueError, "stats must have 4 \\+ K \\+ S = 9 columns"),
        ({"stats": torch.zeros(2, 37, 9, dtype=torch.float16)}, TypeError, "stats must be float32 or float64"),
        ({"tokens": torch.full((37,), 129)}, IndexError, r"tokens must hold ids in \[0, V=129\)"),
        ({"rollout_logprobs": torch.zeros(36)}, ValueError, "rollout_logprobs must be 1-D with N=37"),
        ({"advantages": torch.zeros(37, dtype=torch.float64)}, TypeError, "advantages must have dtype Float"),
        ({"topk_ids": None, "topk_logprobs": None}, ValueError, "needs the rollout's top-K"),
        ({"mode": "tv"}, ValueError, "mode must be one of"),
    ],
)
def test_epilogue_errors(over, err, match):
    with pytest.raises(err, match=match):
        torch.ops.dppo.dppo_vocab_parallel_epilogue(*_epilogue_args(**over))


def test_stats_errors():
    z = torch.zeros(4, 6)
    tok = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_start .* must be >= 0, got -1"):
        torch.ops.dppo.dppo_vocab_parallel_stats(z, tok, None, -1, 1.0, True)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        torch.ops.dppo.dppo_vocab_parallel_stats(z, tok, None, 0, 0.0, True)
    with pytest.raises(ValueError, match="tokens must be 1-D with N=4"):
        torch.ops.dppo.dppo_vocab_parallel_stats(z, tok[:3], None, 0, 1.0, True)
    with pytest.raises(ValueError, match="topk_ids must be 2-D"):
        torch.ops.dppo.dppo_vocab_parallel_stats(z, tok, tok, 0, 1.0, True)


def test_offsets_helpers():
    assert even_vocab_offsets(10, 4) == [0, 3, 6, 9, 10]
    assert even_vocab_offsets(8, 2) == [0, 4, 8]
    assert gathered_bytes_per_row(4, 0, torch.bfloat16) == 4 * 4 * 4
    assert gathered_bytes_per_row(2, 20, torch.float64) == 2 * 24 * 8


def test_api_needs_process_group():
    from dppo_ext import dppo_loss

    inputs = sample_inputs("cpu", torch.float32, "binary_tv", "v129")
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        dppo_loss(
            inputs["logits"],
            inputs["tokens"],
            inputs["rollout_logprobs"],
            inputs["advantages"],
            vocab_parallel_group=object(),
        )


# ---- 2 and 3 gloo processes -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(world: int, out_dir: Path, timeout: int = 420) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "python_tests")]),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world),
    )
    procs = []
    for rank in range(world):
        out = out_dir / f"rank{rank}.json"
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), "--out", str(out)],
                    env=dict(env, RANK=str(rank)),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
                out,
            )
        )
    results = []
    try:
        for proc, out in procs:
            log, _ = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{log[-6000:]}"
            results.append(json.loads(out.read_text()))
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", (2, 3))
def test_gloo_processes_match_single_device(world, tmp_path):
    results = run_workers(world, tmp_path)
    names = [c["name"] for c in results[0]["checks"]]
    failures = [f"rank {r['rank']}: {c['name']}: {c['error']}" for r in results for c in r["checks"] if not c["ok"]]
    assert not failures, "\n".join(failures[:20])
    # The worker ran every planned check on every rank (a check that did not run cannot fail).
    for r in results:
        assert [c["name"] for c in r["checks"]] == names
    expected = set(results[0]["planned"])
    assert set(names) == expected and len(expected) >= 40, sorted(expected - set(names))
    coverage = results[0]["coverage"]
    assert coverage["token_owners"] == list(range(world)), coverage
    assert coverage["max_topk_owners_per_row"] >= 2, coverage
    # Every rank computed the same loss bits.
    losses = {json.dumps(r["losses"]) for r in results}
    assert len(losses) == 1, "ranks disagree on the loss"


_ONE_RANK = """
import os, sys, warnings
import torch
import torch.distributed as dist
from dppo_ext import dppo_loss, fused_linear_dppo_loss

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
g = torch.Generator().manual_seed(0)
hidden = torch.randn(6, 8, generator=g, requires_grad=True)
weight = torch.randn(13, 8, generator=g, requires_grad=True)
tokens = torch.randint(0, 13, (6,), generator=g)
rollout = torch.log_softmax(hidden.detach() @ weight.detach().T, -1).gather(1, tokens[:, None])[:, 0] - 0.05
adv = torch.randn(6, generator=g)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loss, _ = dppo_loss(hidden @ weight.T, tokens, rollout, adv, vocab_parallel_group=dist.group.WORLD,
                        vocab_offsets=[0, 13])
    loss.backward()
    loss, _ = fused_linear_dppo_loss(hidden, weight, tokens, rollout, adv, vocab_parallel_group=dist.group.WORLD)
    loss.backward()
print([f"{w.category.__name__}: {w.message}" for w in caught if issubclass(w.category, (DeprecationWarning,
                                                                                      FutureWarning))])
sys.stdout.flush()
os._exit(0)  # no gloo teardown (docs/distributed.md)
"""


@pytest.mark.slow
def test_vocab_parallel_calls_use_no_deprecated_collective(tmp_path):
    """The forward's one all-gather uses torch.distributed's current collective: neither vocab-parallel entry point
    (logits, fused linear; forward and backward) emits a deprecation warning (torch 2.13 deprecated
    all_gather_into_tensor). One gloo rank in a child process."""
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_RANK, str(tmp_path / "store")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rollout_logprobs", math.nan),
        ("advantages", math.nan),
        ("anchor_logprobs", 0.5),
        ("topk_logprobs", math.nan),
        ("topk_ids", -1),
    ],
)
def test_values_at_padding_rows_are_ignored_by_the_vocab_parallel_ops(field, value):
    """A padding row's (token -100) inputs hold anything: the stats and epilogue ops accept them and every output
    and gradient is exactly that of clean padding (docs/contract.md), on simulated ranks."""
    inputs = sample_inputs("cpu", torch.float64, "topk_kl", "v129", seed=8, anchor=True)
    pad = inputs["tokens"] == -100
    assert pad.any()
    dirty = dict(inputs)
    dirty[field] = inputs[field].clone()
    dirty[field][pad] = value
    g = upstream(inputs["tokens"].shape[0], torch.float64, tie_rows(inputs))
    offsets = split_offsets(129, 3)
    want_out, want_grad = simulate(inputs, offsets, g, inplace=False)
    got_out, got_grad = simulate(dirty, offsets, g, inplace=False)
    for key in want_out:
        torch.testing.assert_close(got_out[key], want_out[key], rtol=0, atol=0, equal_nan=True, msg=key)
    torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)

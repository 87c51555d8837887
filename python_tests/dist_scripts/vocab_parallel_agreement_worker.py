"""One rank of the vocabulary-parallel agreement test (python_tests/api/test_vocab_parallel_agreement.py).

Each scenario makes one vocab-parallel loss call in which rank 1 alone passes something else than the other ranks
(fewer rows, one changed token, advantage, mask entry, rollout log-prob, top-K entry, anchor or setting) or fails
its own checks (a bad shape or dtype). Every rank records what its call did (the exception's type and message, or
the loss it returned) in ``--out``; the parent test asserts that every rank raised the expected error. The last
scenario is a correct call: the group is still usable after the refused ones. gloo, env:// rendezvous, a short
collective timeout so that a rank left waiting fails instead of hanging.
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.distributed as dist
from clean_exit import exit_after
from dppo_testing import sample_inputs
from dppo_testing.vocab_parallel import place_tokens, split_offsets

from dppo_ext import dppo_loss, dppo_loss_per_row, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row

ODD = 1  # the rank whose call differs


def _inputs(mode: str, anchor: bool = False) -> tuple[torch.Tensor, dict, list[int]]:
    """(this rank's logits slice, the other per-row kwargs, the offsets); identical on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    offsets = split_offsets(129, world)
    inputs = place_tokens(sample_inputs("cpu", torch.float32, mode, "v129", seed=5, anchor=anchor), offsets)
    kw = {
        k: v
        for k, v in inputs.items()
        if k in ("tokens", "rollout_logprobs", "advantages", "topk_ids", "topk_logprobs", "anchor_logprobs")
        and v is not None
    }
    kw["mode"] = mode
    return inputs["logits"][:, offsets[rank] : offsets[rank + 1]].contiguous(), kw, offsets


def _odd() -> bool:
    return dist.get_rank() == ODD


def _changed(t: torch.Tensor, row: int = 5) -> torch.Tensor:
    """``t`` with one element of ``row`` changed (on the odd rank only)."""
    if not _odd():
        return t
    t = t.clone()
    if t.dtype == torch.long:
        t.view(t.shape[0], -1)[row, 0] = (t.view(t.shape[0], -1)[row, 0] + 1) % 129
    else:
        t.view(t.shape[0], -1)[row, 0] -= 0.25
    return t


def per_row_call(mode: str, derive: bool = False, anchor: bool = False, **change):
    local, kw, offsets = _inputs(mode, anchor)
    for name, fn in change.items():
        kw[name] = fn(kw[name])
    out = dppo_loss_per_row(
        local, **kw, vocab_parallel_group=dist.group.WORLD, vocab_offsets=None if derive else offsets
    )
    return out.loss.sum()


def scenario_rows():
    local, kw, offsets = _inputs("binary_tv")
    if _odd():
        local, kw = local[:-1], {k: (v[:-1] if torch.is_tensor(v) else v) for k, v in kw.items()}
    return dppo_loss_per_row(local, **kw, vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets).loss.sum()


def scenario_rows_derived_offsets():
    local, kw, _offsets = _inputs("binary_tv")
    if _odd():
        local, kw = local[:-1], {k: (v[:-1] if torch.is_tensor(v) else v) for k, v in kw.items()}
    return dppo_loss_per_row(local, **kw, vocab_parallel_group=dist.group.WORLD).loss.sum()


def _sequence_call(mode: str = "binary_tv", mask_change: bool = False, over: dict | None = None):
    """dppo_loss on [B, T, V_local] logits with a response mask (the aggregating entry point)."""
    local, kw, offsets = _inputs(mode)
    b, t = 2, local.shape[0] // 2
    n = b * t
    shaped = {k: (v[:n].reshape(b, t, *v.shape[1:]) if torch.is_tensor(v) else v) for k, v in kw.items()}
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, -1] = False
    if mask_change and _odd():
        mask[0, 1] = False
    shaped.update(over or {})
    logits = local[:n].reshape(b, t, -1)
    loss, _ = dppo_loss(
        logits, **shaped, response_mask=mask, vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets
    )
    return loss


def scenario_fused(
    rows_differ: bool = False,
    tokens_differ: bool = False,
    bad_weight: bool = False,
    hidden_change=None,
    odd_dtype: torch.dtype | None = None,
    over: dict | None = None,
):
    world, rank = dist.get_world_size(), dist.get_rank()
    offsets = split_offsets(129, world)
    gen = torch.Generator().manual_seed(11)
    n, h = 9, 6
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(129, h, generator=gen, dtype=torch.float64)[offsets[rank] : offsets[rank + 1]]
    tokens = torch.randint(0, 129, (n,), generator=gen)
    rollout = torch.full((n,), -4.0, dtype=torch.float64)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    if tokens_differ:
        tokens = _changed(tokens, row=2)
    if hidden_change is not None and _odd():
        hidden = hidden_change(hidden.clone())
    if odd_dtype is not None:  # e.g. bf16 hidden and head rows on one rank, fp32 on the others
        hidden, weight = (hidden.to(odd_dtype), weight.to(odd_dtype)) if _odd() else (hidden.float(), weight.float())
    hidden.requires_grad_(True)
    if bad_weight and _odd():
        weight = weight[:, :-1]
    if rows_differ:
        if _odd():
            hidden, tokens, rollout, adv = hidden[:-1], tokens[:-1], rollout[:-1], adv[:-1]
        return fused_linear_dppo_loss_per_row(
            hidden, weight, tokens, rollout, adv, vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets
        ).loss.sum()
    loss, _ = fused_linear_dppo_loss(
        hidden,
        weight,
        tokens,
        rollout,
        adv,
        vocab_parallel_group=dist.group.WORLD,
        vocab_offsets=offsets,
        **(over or {}),
    )
    loss.backward()  # the backward's hidden-gradient all-reduce is the collective a dtype mismatch would reach
    return loss


def _one_hidden_row(hidden: torch.Tensor) -> torch.Tensor:
    hidden[4] += 0.5
    return hidden


def _one_nan(hidden: torch.Tensor) -> torch.Tensor:
    hidden[3, 2] = float("nan")
    return hidden


def _by_value(integer, real):
    """The same setting spelled as an int on the odd rank and as a float elsewhere."""
    return integer if _odd() else real


def scenario_empty_slice():
    local, kw, offsets = _inputs("binary_tv")
    if _odd():
        local = local[:, :0]
    return dppo_loss_per_row(local, **kw, vocab_parallel_group=dist.group.WORLD, vocab_offsets=offsets).loss.sum()


def _bad_advantages_shape(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t[:1]]) if _odd() else t


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.int() if _odd() else t


SCENARIOS = {
    "rows": scenario_rows,
    "rows_derived_offsets": scenario_rows_derived_offsets,
    "tokens": lambda: per_row_call("binary_tv", tokens=_changed),
    "tokens_derived_offsets": lambda: per_row_call("binary_tv", derive=True, tokens=_changed),
    "advantages": lambda: per_row_call("binary_tv", advantages=_changed),
    "rollout_logprobs": lambda: per_row_call("binary_kl", rollout_logprobs=_changed),
    "topk_ids": lambda: per_row_call("topk_tv", topk_ids=_changed),
    "topk_logprobs": lambda: per_row_call("topk_kl", topk_logprobs=_changed),
    "anchor_logprobs": lambda: per_row_call("binary_kl", anchor=True, anchor_logprobs=_changed),
    "response_mask": lambda: _sequence_call(mask_change=True),
    "settings": lambda: _sequence_call(over={"delta_low": 0.3 if _odd() else 0.2}),
    # a float32 tensor 0.7 holds 0.699999988: another temperature than the float 0.7, named with both values
    "settings_tensor": lambda: _sequence_call(over={"temperature": torch.tensor(0.7) if _odd() else 0.7}),
    "fused_tokens": lambda: scenario_fused(tokens_differ=True),
    "fused_rows": lambda: scenario_fused(rows_differ=True),
    "fused_hidden_row": lambda: scenario_fused(hidden_change=_one_hidden_row),
    "fused_hidden_nan": lambda: scenario_fused(hidden_change=_one_nan),
    "fused_hidden_dtype": lambda: scenario_fused(odd_dtype=torch.bfloat16),
    "settings_by_value": lambda: _sequence_call(
        over={"temperature": _by_value(1, 1.0), "ratio_cap": _by_value(10, 10.0)}
    ),
    "settings_tensor_by_value": lambda: _sequence_call(
        over={"temperature": torch.tensor(0.5) if _odd() else 0.5}  # exact in float32: the same value
    ),
    "fused_settings_by_value": lambda: scenario_fused(
        over={"temperature": _by_value(1, 1.0), "ratio_cap": _by_value(10, 10.0)}
    ),
    "local_shape_error": lambda: _sequence_call(over={"advantages": _bad_advantages_shape(torch.zeros(2, 1))}),
    "local_dtype_error": lambda: per_row_call("binary_tv", tokens=_int32),
    "local_fused_error": lambda: scenario_fused(bad_weight=True),
    "local_settings_error": lambda: _sequence_call(over={"mode": "bogus"} if _odd() else {}),
    "local_empty_slice": scenario_empty_slice,
    "correct_call_after": lambda: per_row_call("topk_kl"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="comma-separated scenario names (default: all, in order)")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    names = args.only.split(",") if args.only else list(SCENARIOS)
    results = []
    for name in names:
        try:
            loss = SCENARIOS[name]()
            results.append({"name": name, "raised": None, "message": "", "loss": float(loss.detach())})
        except Exception as exc:  # noqa: BLE001 - every outcome is reported to the parent test
            results.append({"name": name, "raised": type(exc).__name__, "message": str(exc), "loss": None})
        with open(args.out, "w") as f:  # after every scenario: a rank that dies later still reports these
            json.dump({"rank": dist.get_rank(), "world": dist.get_world_size(), "results": results}, f)
    exit_after(dist.barrier)  # not gloo's teardown: see clean_exit.py


if __name__ == "__main__":
    main()

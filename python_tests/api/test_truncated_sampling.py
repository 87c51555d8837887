"""Truncated sampling (top-k / top-p / min-p): the kept set from vLLM's outputs, the kept set by rule, and the
refusal every sampling entry point gives until the loss replays the set.

Checks: (1) ``vllm_rollout_tensors(..., sampling_params=)`` on hand-built vLLM outputs (the fields vLLM's
``RequestOutput`` / ``Logprob`` carry): the finite entries are the kept set, by rank, -1 padded; a position whose
set may exceed what vLLM returned raises naming the request, completion, position, count and the settings to
raise; top-k sampling with k <= logprobs is exact even when every entry is finite; the whole vocabulary returned
is exact; a sampled token outside its set, and a -inf beside the sampled token without ``sampling_params``, raise;
(2) ``kept_ids_by_rule`` against an independent float64 oracle (full sort, the rules' definitions), across row
chunks and settings, and its errors; (3) ``contract.refuse_truncated_sampling``'s messages.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from dppo_ext import contract
from dppo_ext.rollout import kept_ids_by_rule, truncation, vllm_rollout_tensors
from dppo_ext.rollout.vllm_outputs import kept_sets

INF = math.inf


def _position(entries: list[tuple[int, float]]) -> dict:
    """A vLLM ``logprobs`` entry: token -> Logprob(logprob, rank), ranks in the order given."""
    return {tok: SimpleNamespace(logprob=lp, rank=rank) for rank, (tok, lp) in enumerate(entries, start=1)}


def _request(token_ids: list[int], positions: list[list[tuple[int, float]]]) -> SimpleNamespace:
    completion = SimpleNamespace(
        token_ids=token_ids, logprobs=[_position(p) for p in positions], finish_reason="stop", text=""
    )
    return SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion])


def _params(top_k=0, top_p=1.0, min_p=0.0, logprobs=3) -> SimpleNamespace:
    """The ``SamplingParams`` fields the helper reads."""
    return SimpleNamespace(top_k=top_k, top_p=top_p, min_p=min_p, logprobs=logprobs)


def test_finite_entries_are_the_kept_set():
    # logprobs=3: three best ranks; the set ends among them (a -inf entry) at every position
    outputs = [
        _request([4, 7], [[(4, -0.3), (5, -1.4), (6, -INF)], [(8, -0.1), (7, -2.4), (9, -INF)]]),
        _request([5], [[(3, -0.7), (5, -0.7), (4, -INF)]]),
    ]
    rollout = vllm_rollout_tensors(outputs, sampling_params=_params(top_p=0.8))
    assert rollout.kept_ids.dtype == torch.long
    assert rollout.kept_ids.tolist() == [[[4, 5], [8, 7]], [[3, 5], [-1, -1]]]
    torch.testing.assert_close(rollout.rollout_logprobs, torch.tensor([[-0.3, -2.4], [-0.7, 0.0]]))


def test_untruncated_sampling_has_no_kept_ids():
    outputs = [_request([4], [[(4, -0.3), (5, -1.4), (6, -2.0)]])]
    for params in (None, _params(), _params(top_k=-1, min_p=None)):
        assert vllm_rollout_tensors(outputs, sampling_params=params).kept_ids is None


@pytest.mark.parametrize(
    "params",
    [_params(top_p=0.9), _params(min_p=0.05), _params(top_k=5)],
    ids=("top_p", "min_p", "top_k_above_logprobs"),
)
def test_all_returned_entries_finite_raises(params):
    outputs = [
        _request([4], [[(4, -0.3), (5, -1.4), (6, -INF)]]),
        _request([4, 5], [[(4, -0.3), (5, -1.4), (6, -INF)], [(8, -0.5), (5, -1.1), (9, -2.0)]]),
    ]
    with pytest.raises(
        ValueError,
        match=r"request 1, completion 0: position 1: all 3 best log-probs vLLM returned are finite.*raise "
        r"SamplingParams\(logprobs=\.\.\.\) above 3 \(and vLLM's LLM\(max_logprobs=\.\.\.\).*kept_ids_by_rule",
    ):
        vllm_rollout_tensors(outputs, sampling_params=params)


def test_sampled_token_ranked_below_the_returned_ones_raises():
    # the sampled token came back beyond the logprobs=2 best ranks: the set is larger than what was returned
    outputs = [_request([9], [[(4, -0.3), (5, -1.4), (9, -3.0)]])]
    with pytest.raises(ValueError, match=r"position 0: all 2 best log-probs"):
        vllm_rollout_tensors(outputs, sampling_params=_params(top_p=0.99, logprobs=2))


def test_top_k_within_logprobs_is_exact_when_every_entry_is_finite():
    outputs = [_request([5], [[(4, -0.3), (5, -1.4)]])]
    rollout = vllm_rollout_tensors(outputs, sampling_params=_params(top_k=2, logprobs=2))
    assert rollout.kept_ids.tolist() == [[[4, 5]]]


def test_whole_vocabulary_returned_is_exact():
    # logprobs=5 asked, 3 came back: the whole (3-token) vocabulary, so the finite entries are the set
    outputs = [_request([5], [[(4, -0.3), (5, -1.4), (6, -2.0)]])]
    rollout = vllm_rollout_tensors(outputs, sampling_params=_params(top_p=0.999, logprobs=5))
    assert rollout.kept_ids.tolist() == [[[4, 5, 6]]]


def test_sampled_token_outside_its_kept_set_raises():
    outputs = [_request([6], [[(4, -0.3), (5, -1.4), (6, -INF)]])]
    with pytest.raises(
        ValueError, match=r"request 0, completion 0: position 0: the sampled token 6 is not in its kept"
    ):
        vllm_rollout_tensors(outputs, sampling_params=_params(top_p=0.8))


def test_truncation_without_sampling_params_is_not_silent():
    outputs = [_request([4], [[(4, -0.3), (5, -1.4), (6, -INF)]])]
    with pytest.raises(
        ValueError, match=r"position 0: vLLM returned log-prob -inf for token\(s\) \[6\].*sampling_params="
    ):
        vllm_rollout_tensors(outputs, top_k=2)


def test_kept_sets_rejects_bad_sampling_params():
    outputs = [_request([4], [[(4, -0.3), (5, -1.4), (6, -INF)]])]
    with pytest.raises(ValueError, match=r"sampling_params.top_p must be a number in \(0, 1\]"):
        vllm_rollout_tensors(outputs, sampling_params=_params(top_p=1.5))
    with pytest.raises(ValueError, match="same length"):
        kept_sets([4, 5], [_position([(4, -0.1)])], logprobs=1, top_k=0)


# ---- the kept set by rule ---------------------------------------------------------------------------------------


def oracle(logits: torch.Tensor, temperature: float, top_k, top_p, min_p) -> list[Optional[set[int]]]:
    """Per row, in float64 over the fully sorted vocabulary: min-p (p >= min_p * p_max), then top-k (logit >= the
    k-th largest), then top-p on the renormalised rest (keep while the mass ranked above is < top_p). None for a row
    whose top-p or min-p boundary lies within float32 rounding (1e-5) of a token: either answer is right there."""
    sets: list[Optional[set[int]]] = []
    for row in logits.double().reshape(-1, logits.shape[-1]):
        z = row / temperature
        p = torch.softmax(z, -1)
        keep = torch.ones_like(p, dtype=torch.bool)
        ambiguous = False
        if min_p:
            keep &= p >= min_p * p.max()
            ambiguous |= bool(((p / (min_p * p.max()) - 1).abs() < 1e-5).any())
        if top_k and top_k > 0:
            keep &= z >= torch.sort(z, descending=True).values[top_k - 1]
        if top_p < 1:
            q = torch.where(keep, p, 0.0)
            q = q / q.sum()
            order = torch.argsort(q, descending=True)
            above = 0.0
            for tok in order.tolist():
                if not keep[tok]:
                    continue
                ambiguous |= abs(above - top_p) < 1e-5
                if above >= top_p:
                    keep[tok] = False
                above += q[tok].item()
        sets.append(None if ambiguous else set(keep.nonzero().flatten().tolist()))
    return sets


SETTINGS = {
    "top_p_0.7": dict(top_p=0.7),
    "top_p_0.9": dict(top_p=0.9),
    "top_k_5": dict(top_k=5),
    "min_p_0.1": dict(min_p=0.1),
    "top_k_8_top_p_0.8": dict(top_k=8, top_p=0.8),
    "min_p_0.05_top_p_0.9": dict(min_p=0.05, top_p=0.9),
    "all_three": dict(top_k=20, top_p=0.95, min_p=0.02),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float64), ids=str)
def test_kept_ids_by_rule_matches_oracle(setting, dtype, monkeypatch):
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bfloat16:  # distinct values (k / 64, k < 251: exact in bfloat16): no tie decides a boundary
        perms = torch.stack([torch.randperm(251, generator=g) for _ in range(39)])
        logits = (perms.reshape(3, 13, 251).float() / 64).to(dtype)
    else:
        logits = (torch.randn(3, 13, 251, generator=g) * 3).to(dtype)
    monkeypatch.setattr(truncation, "ROW_CHUNK_BYTES", 5 * 251 * 4)  # chunks of 5 rows: 39 rows cross 8 chunks
    kwargs = SETTINGS[setting]
    kept = kept_ids_by_rule(logits, 0.7, max_kept=128, **kwargs)
    assert kept.shape[:2] == (3, 13) and kept.dtype == torch.long
    want = oracle(logits, 0.7, kwargs.get("top_k"), kwargs.get("top_p", 1.0), kwargs.get("min_p"))
    flat = kept.reshape(-1, kept.shape[-1])
    for row, (got, expected) in enumerate(zip(flat.tolist(), want)):
        ids = [t for t in got if t >= 0]
        assert got[len(ids) :] == [-1] * (len(got) - len(ids)), row  # padding only at the end
        assert expected is None or set(ids) == expected, (row, sorted(ids), sorted(expected))
    decided = [s for s in want if s is not None]
    assert len(decided) >= 36, f"{39 - len(decided)} of 39 rows within rounding of a boundary"
    assert flat.shape[1] >= max(len(s) for s in decided)  # S is the largest set
    assert any(len(s) > 1 for s in decided) and any(len(s) < 251 for s in decided)


def test_kept_ids_by_rule_small_vocabulary_and_empty():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    assert kept_ids_by_rule(logits, 1.0, top_p=0.999999, max_kept=8).tolist() == [[0, 1, 2]]
    assert kept_ids_by_rule(torch.zeros(0, 5), 1.0, top_p=0.5).shape == (0, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(top_p=1.0), r"do not truncate"),
        (dict(top_p=0.9, max_kept=0), r"max_kept must be an int >= 1, got 0"),
        (dict(top_p=0.9, temperature=0.0), r"temperature must be a finite number > 0, got 0.0"),
        (dict(top_p=1.2), r"top_p must be a number in \(0, 1\] \(1: no top-p truncation\), got 1.2"),
        (dict(top_k=-3), r"top_k must be an int >= -1"),
        (dict(min_p=2.0), r"min_p must be a number in \[0, 1\]"),
        (dict(top_p=0.999, max_kept=4), r"logits row 0: the kept set of \{'top_p': 0.999\} .* more than max_kept=4"),
    ],
)
def test_kept_ids_by_rule_errors(kwargs, match):
    kwargs = {"temperature": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        kept_ids_by_rule(torch.zeros(2, 10), **kwargs)


def test_kept_ids_by_rule_nonfinite_logits():
    logits = torch.zeros(3, 10)
    logits[2, 4] = math.nan
    with pytest.raises(ValueError, match="logits row 2 holds a non-finite value"):
        kept_ids_by_rule(logits, 1.0, top_p=0.5)


# ---- the refusal ------------------------------------------------------------------------------------------------


def test_refusal_names_each_truncating_setting_and_the_fix():
    names = {"top_p": "rollout.top_p", "top_k": "rollout.top_k", "min_p": "rollout.min_p"}
    with pytest.raises(
        ValueError,
        match=r"rollout.top_k=50, rollout.top_p=0.9 truncates the sampling distribution.*rollout.top_p=1, "
        r"rollout.top_k=-1 \(or 0\) and rollout.min_p=0$",
    ):
        contract.refuse_truncated_sampling(50, 0.9, 0.0, names=names)
    for untruncated in ((-1, 1.0, 0.0), (0, 1.0, None), (None, 1, 0)):
        contract.refuse_truncated_sampling(*untruncated)
    assert contract.sampling_truncation(3, 1.0, 0.2) == {"top_k": 3, "min_p": 0.2}
    with pytest.raises(ValueError, match=r"top_k must be an int >= -1 .*got True"):
        contract.sampling_truncation(True, 1.0, 0.0)

"""The sync guard (``dppo_ext.rollout.sync_guard``) on a stand-in for vLLM's scoring, no engine: its tolerance by
dtype, a trained model's float32 rounding accepted and a step of staleness refused, infinite log-probs compared like
with like.
"""

from __future__ import annotations

import pytest
import torch

from dppo_ext.rollout.sync_guard import sync_tolerance
from dppo_ext.rollout.weight_sync import WeightSyncError


def test_tolerance_follows_the_narrower_dtype():
    assert sync_tolerance(torch.float32, torch.float32) == (1e-3, 1e-5)
    assert sync_tolerance(torch.bfloat16, torch.float32) == sync_tolerance(torch.float32, torch.bfloat16)
    assert sync_tolerance(torch.bfloat16, torch.float32)[0] > sync_tolerance(torch.float16, torch.float32)[0]


class _Logprob:
    def __init__(self, value: float) -> None:
        self.logprob = value


class _Output:
    def __init__(self, prompt_logprobs: list) -> None:
        self.prompt_logprobs = prompt_logprobs


class _ScoringEngine:
    """Answers the guard's ``prompt_logprobs`` request with fixed log-probs of ``ids[1:]`` (a stand-in for vLLM)."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        self.logprobs = logprobs

    def generate(self, prompts, params, use_tqdm=False):
        ids = prompts[0]["prompt_token_ids"]
        entries = [None] + [{t: _Logprob(float(v))} for t, v in zip(ids[1:], self.logprobs)]
        return [_Output(entries)]


@pytest.mark.parametrize(
    ("offset", "accepted"),
    [
        # the largest float32 difference measured on a model trained for 279 RL steps, every parameter in sync
        # (benchmarks/bench_sync_guard_trained.py): the old tolerance 5e-5 stopped that run
        (1.6e-4, True),
        (-1.6e-4, True),
        # a stale tensor moves log-probs by 1e-2 or more (one RL step of those runs: 0.017 in probability, median)
        (1e-2, False),
        (float("nan"), False),
    ],
)
def test_float32_guard_accepts_a_trained_models_rounding_and_refuses_a_step_of_staleness(offset, accepted):
    pytest.importorskip("vllm")
    from dppo_ext.rollout.sync_guard import SyncGuard

    ids = [1, 13, 9, 14, 10, 16, 5, 13, 9, 2]
    pi = -torch.linspace(0.1, 23.0, len(ids) - 1).double()  # float32 values: the trainer side returns them exactly
    mu = pi.clone()
    mu[-1] += offset  # one token off, as measured (the ill-conditioned position is one token of the probe)
    guard = SyncGuard(torch.float32, max_model_len=64)
    guard.remember(ids)
    if accepted:
        check = guard.check(_ScoringEngine(mu), lambda _: pi.float(), trainer_dtype=torch.float32)
        assert check.max_diff == pytest.approx(abs(offset), rel=1e-3)
    else:
        with pytest.raises(WeightSyncError, match=r"accepted: 0\.001 \+ 1e-05 \* \|log pi\|"):
            guard.check(_ScoringEngine(mu), lambda _: pi.float(), trainer_dtype=torch.float32)


@pytest.mark.parametrize(
    ("trainer", "engine", "accepted"),
    [
        (float("-inf"), float("-inf"), True),  # both give the token no probability: they agree
        (float("-inf"), -3.0, False),
        (-3.0, float("-inf"), False),
        (float("inf"), float("inf"), False),  # +inf is no log-probability
    ],
)
def test_the_guard_compares_infinite_log_probs_like_with_like(trainer, engine, accepted):
    pytest.importorskip("vllm")
    from dppo_ext.rollout.sync_guard import SyncGuard

    ids = [1, 13, 9, 14, 10, 16]
    pi = -torch.linspace(0.5, 6.0, len(ids) - 1).double()
    mu = pi.clone()
    pi[2], mu[2] = trainer, engine
    guard = SyncGuard(torch.float32, max_model_len=64)
    guard.remember(ids)
    if accepted:
        check = guard.check(_ScoringEngine(mu), lambda _: pi.float(), trainer_dtype=torch.float32)
        assert check.max_diff == 0.0
    else:
        with pytest.raises(WeightSyncError, match="at token 3 of 5"):
            guard.check(_ScoringEngine(mu), lambda _: pi.float(), trainer_dtype=torch.float32)


class _SyncingEngine(_ScoringEngine):
    """The stand-in also takes a weight sync (``collective_rpc("reload_weights")``) and records what it received."""

    def __init__(self, logprobs: torch.Tensor) -> None:
        super().__init__(logprobs)
        self.received: list[tuple[str, torch.dtype]] = []
        self.resets = 0

    def collective_rpc(self, method, kwargs):
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.received.extend((name, tensor.dtype) for name, tensor in kwargs["weights_iterator"])

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def test_push_and_check_loads_by_the_plan_then_checks_the_engine():
    pytest.importorskip("vllm")
    from dppo_ext.rollout.sync_guard import SyncGuard, push_and_check
    from dppo_ext.rollout.weight_sync import SyncPlan

    model = torch.nn.Linear(3, 2)
    plan = SyncPlan("StandIn", sends={"weight": ("w",), "bias": ("b", "b_copy")})
    ids = [1, 13, 9, 14, 10]
    pi = -torch.linspace(0.5, 4.0, len(ids) - 1).double()
    guard = SyncGuard(torch.float32, max_model_len=64)

    def push(engine, guard):
        weights = iter(model.state_dict().items())
        return push_and_check(engine, plan, weights, torch.bfloat16, guard, model, lambda _: pi.float())

    engine = _SyncingEngine(pi)
    assert push(engine, guard) is None  # nothing remembered yet: loaded, nothing to check
    assert engine.received == [("w", torch.bfloat16), ("b", torch.bfloat16), ("b_copy", torch.bfloat16)]
    assert engine.resets == 1
    guard.remember(ids)
    check = push(engine, guard)
    assert check.max_diff == 0.0 and check.tokens == len(ids) - 1 and engine.resets == 2
    assert push(engine, None) is None and engine.resets == 3  # no guard: loaded, never checked
    stale = _SyncingEngine(pi + 1e-2)
    with pytest.raises(WeightSyncError, match=r"sync guard: after the weight sync vLLM's StandIn scores"):
        push(stale, guard)
    assert stale.resets == 1  # the weights went in before the check refused them

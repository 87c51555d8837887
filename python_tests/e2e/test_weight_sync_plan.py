"""The weight-sync rule (``dppo_ext.rollout.weight_sync.plan_weight_sync``) on stand-ins for vLLM models, no vLLM.

The stand-ins have what the rule reads from a loaded vLLM model: its parameter names, tied parameters and
``packed_modules_mapping``. Checked: a tied head is sent under both names where the engine has both (also when the
trainer streams ``named_parameters()``, which names it once), dropped where the engine has no head (Gemma2);
q/k/v shards land on the stacked parameter and a missing shard, an engine parameter nobody sends, an unknown
trainer parameter and a shape mismatch are refused with the parameter and the architecture named.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dppo_ext.rollout.weight_sync import WeightSyncError, plan_weight_sync, sync_tolerance, trainer_aliases


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(4, 12, bias=False)


class _Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.attn = _Attn()
        self.register_buffer("cos_sin_cache", torch.zeros(3))


class EngineWithHead(nn.Module):
    """A vLLM-style model with a stacked qkv_proj and an LM head (tied to the embedding when ``tied``)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.model = _Body()
        self.lm_head = nn.Linear(4, 8, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight


class EngineWithoutHead(EngineWithHead):
    """Gemma2-style: logits from the embedding, no lm_head module."""

    def __init__(self) -> None:
        super().__init__(tied=True)
        del self.lm_head


def _trainer(tied: bool) -> nn.Module:
    """A transformers-style model: separate q/k/v projections, an LM head tied to the embedding when ``tied``."""
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = nn.Embedding(8, 4)
    root.model.attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(root.model.attn, name, nn.Linear(4, 4, bias=False))
    root.lm_head = nn.Linear(4, 8, bias=False)
    if tied:
        root.lm_head.weight = root.model.embed_tokens.weight
    return root


def _plan(engine: nn.Module, trainer: nn.Module, names=None):
    state = trainer.state_dict()
    names = list(state) if names is None else names
    return plan_weight_sync(
        engine,
        names,
        shapes={n: tuple(t.shape) for n, t in state.items()},
        aliases=trainer_aliases(trainer),
        trained=list(state),
    )


def test_tied_head_goes_under_both_names_where_the_engine_has_both():
    trainer = _trainer(tied=True)
    plan = _plan(EngineWithHead(tied=True), trainer)
    assert plan.sends["model.embed_tokens.weight"] == ("model.embed_tokens.weight",)
    assert plan.sends["lm_head.weight"] == ("lm_head.weight",)
    assert plan.sends["model.attn.q_proj.weight"] == ("model.attn.q_proj.weight",)
    # TRL streams named_parameters(): the head's second name is added from the model's aliases
    streamed = [n for n, _ in trainer.named_parameters()]
    assert "lm_head.weight" not in streamed
    plan = _plan(EngineWithHead(tied=True), trainer, names=streamed)
    assert plan.sends["model.embed_tokens.weight"] == ("model.embed_tokens.weight", "lm_head.weight")


def test_tied_head_is_dropped_where_the_engine_has_no_head():
    plan = _plan(EngineWithoutHead(), _trainer(tied=True))
    assert "lm_head.weight" in plan.dropped and "lm_head.weight" not in plan.sends
    assert plan.num_tensors == 4


def test_untied_head_without_a_place_in_the_engine_is_refused():
    with pytest.raises(
        WeightSyncError,
        match=r"parameter\(s\) \['lm_head\.weight'\] have no counterpart in "
        r"vLLM's EngineWithoutHead",
    ):
        _plan(EngineWithoutHead(), _trainer(tied=False))


def test_missing_shard_and_unsent_engine_parameter_are_refused():
    trainer = _trainer(tied=False)
    del trainer.model.attn.v_proj
    with pytest.raises(
        WeightSyncError,
        match=r"'model\.attn\.qkv_proj\.weight' stacks \['q_proj', 'k_proj', "
        r"'v_proj'\], but the trainer model sends only \['k_proj', 'q_proj'\]",
    ):
        _plan(EngineWithHead(tied=False), trainer)
    trainer = _trainer(tied=False)
    del trainer.lm_head
    with pytest.raises(
        WeightSyncError,
        match=r"vLLM's EngineWithHead parameter\(s\) \['lm_head\.weight'\] would "
        r"get no tensor",
    ):
        _plan(EngineWithHead(tied=False), trainer)


def test_shape_mismatch_is_refused():
    trainer = _trainer(tied=False)
    trainer.lm_head = nn.Linear(5, 8, bias=False)
    with pytest.raises(
        WeightSyncError,
        match=r"'lm_head\.weight' has shape \[8, 5\], vLLM's EngineWithHead "
        r"parameter 'lm_head\.weight' \[8, 4\]",
    ):
        _plan(EngineWithHead(tied=False), trainer)


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
    from dppo_ext.rollout.weight_sync import SyncGuard

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
    from dppo_ext.rollout.weight_sync import SyncGuard

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

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

from dppo_ext.rollout.weight_sync import WeightSyncError, plan_weight_sync, trainer_aliases


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

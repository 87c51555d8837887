"""Inputs held wrong get an error that names the argument, what it got and what to do, at every entry point.

The entry points: ``dppo_loss``, ``DPPOLoss``, ``fused_linear_dppo_loss`` (and ``_per_row``),
``FusedLinearDPPOLoss``, ``dppo_loss_per_row``, and both per-row functions given a ``vocab_parallel_group``
(their checks run before any collective, so no process group is needed to see them). The cases: a
``temperature`` tensor that requires grad (the op treats it as a constant: its ``.grad`` would silently stay
None), a per-row ``temperature`` tensor, a Python list where a tensor belongs, ``torch.func`` transforms with
``inplace_backward=True``, and a vLLM output whose sampled token has no log-prob.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dppo_ext import (
    DPPOLoss,
    FusedLinearDPPOLoss,
    dppo_loss,
    dppo_loss_per_row,
    fused_linear_dppo_loss,
    fused_linear_dppo_loss_per_row,
)
from dppo_ext.rollout import vllm_rollout_tensors

N, V, H = 6, 11, 5


def _inputs() -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, requires_grad=True)
    return dict(
        logits=(hidden @ weight.T),
        hidden=hidden,
        weight=weight,
        tokens=torch.randint(0, V, (N,), generator=gen),
        rollout_logprobs=torch.full((N,), -2.5),
        advantages=torch.randn(N, generator=gen),
    )


ROWS = ("tokens", "rollout_logprobs", "advantages")
# Stands for a tensor-parallel group: the checks tested here run before a vocab-parallel call's first collective,
# so that no rank waits for one that fails them; no process group is needed to see them.
GROUP = object()


def _call(entry: str, inputs: dict, temperature=1.0):
    """One loss call through ``entry`` with the given inputs (the row inputs by name)."""
    rows = {k: inputs[k] for k in ROWS}
    logits, hidden, weight = inputs["logits"], inputs["hidden"], inputs["weight"]
    if entry == "dppo_loss":
        return dppo_loss(logits, **rows, temperature=temperature)
    if entry == "DPPOLoss":
        return DPPOLoss(temperature=temperature)(logits, **rows)
    if entry == "fused_linear_dppo_loss":
        return fused_linear_dppo_loss(hidden, weight, **rows, temperature=temperature)
    if entry == "fused_linear_dppo_loss_per_row":
        return fused_linear_dppo_loss_per_row(hidden, weight, **rows, temperature=temperature)
    if entry == "FusedLinearDPPOLoss":
        return FusedLinearDPPOLoss(temperature=temperature)(hidden, weight, **rows)
    if entry == "dppo_loss_per_row":
        return dppo_loss_per_row(logits, **rows, temperature=temperature)
    if entry == "dppo_loss_per_row, vocab-parallel":
        return dppo_loss_per_row(logits, **rows, temperature=temperature, vocab_parallel_group=GROUP)
    if entry == "fused_linear_dppo_loss_per_row, vocab-parallel":
        return fused_linear_dppo_loss_per_row(
            hidden, weight, **rows, temperature=temperature, vocab_parallel_group=GROUP
        )
    raise AssertionError(entry)


ENTRIES = (
    "dppo_loss",
    "DPPOLoss",
    "fused_linear_dppo_loss",
    "fused_linear_dppo_loss_per_row",
    "FusedLinearDPPOLoss",
    "dppo_loss_per_row",
    "dppo_loss_per_row, vocab-parallel",
    "fused_linear_dppo_loss_per_row, vocab-parallel",
)


@pytest.mark.parametrize("entry", ENTRIES)
def test_temperature_that_requires_grad_is_refused(entry):
    temperature = torch.tensor(0.7, requires_grad=True)
    with pytest.raises(ValueError, match=r"temperature is a tensor that requires grad.*stay None.*Python float"):
        _call(entry, _inputs(), temperature)
    assert temperature.grad is None


@pytest.mark.parametrize("entry", ENTRIES)
def test_per_row_temperature_is_refused(entry):
    with pytest.raises(ValueError, match=r"temperature must be one number.*shape \(6,\).*per-row temperatures"):
        _call(entry, _inputs(), torch.full((N,), 0.7))


@pytest.mark.parametrize("entry", ENTRIES[:6])
def test_a_constant_temperature_tensor_is_the_number_it_holds(entry):
    inputs = _inputs()
    as_tensor, as_float = _call(entry, inputs, torch.tensor(0.7)), _call(entry, inputs, 0.7)
    loss_t = as_tensor[0] if isinstance(as_tensor, tuple) and not hasattr(as_tensor, "loss") else as_tensor.loss
    loss_f = as_float[0] if isinstance(as_float, tuple) and not hasattr(as_float, "loss") else as_float.loss
    assert torch.equal(loss_t, loss_f)


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", ROWS)
def test_a_list_where_a_tensor_belongs_is_named(entry, name):
    inputs = _inputs()
    inputs[name] = inputs[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor, got a list; convert it first"):
        _call(entry, inputs)


@pytest.mark.parametrize("entry", ENTRIES)
def test_list_logits_or_hidden_is_named(entry):
    inputs = _inputs()
    name = "hidden" if "fused" in entry.lower() else "logits"
    inputs[name] = inputs[name].tolist()
    with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor, got a list"):
        _call(entry, inputs)


_FUNC = "does not support torch.func transforms"


@pytest.mark.parametrize("transform", ("grad", "vjp"))
@pytest.mark.parametrize(
    "loss",
    (
        lambda x, i: dppo_loss(x, i["tokens"], i["rollout_logprobs"], i["advantages"], inplace_backward=True)[0],
        lambda x, i: DPPOLoss(inplace_backward=True)(x, i["tokens"], i["rollout_logprobs"], i["advantages"])[0],
        lambda x, i: dppo_loss_per_row(
            x, i["tokens"], i["rollout_logprobs"], i["advantages"], inplace_backward=True
        ).loss.sum(),
    ),
    ids=("dppo_loss", "DPPOLoss", "dppo_loss_per_row"),
)
def test_torch_func_with_inplace_backward_names_torch_func(loss, transform):
    """The transformed input looks like a leaf to the in-place rule: the message must say torch.func."""
    inputs = _inputs()
    logits = inputs["logits"].detach()
    with pytest.raises(RuntimeError, match=_FUNC) as caught:
        if transform == "grad":
            torch.func.grad(lambda x: loss(x, inputs))(logits)
        else:
            torch.func.vjp(lambda x: loss(x, inputs), logits)
    assert "leaf" not in str(caught.value)


# ---- vLLM outputs whose sampled token has no log-prob ---------------------------------------------------


def _request(token_ids, logprobs):
    positions = [{tok: SimpleNamespace(logprob=lp, rank=1)} for tok, lp in zip(token_ids, logprobs)]
    completion = SimpleNamespace(token_ids=token_ids, logprobs=positions, finish_reason="stop", text="")
    return SimpleNamespace(prompt_token_ids=[1, 2], outputs=[completion])


def test_vllm_output_without_a_sampled_log_prob_names_sequence_and_position():
    outputs = [_request([4, 5], [-0.5, -1.0]), _request([6, 7, 8], [-0.2, None, -0.3])]
    with pytest.raises(ValueError, match=r"request 1, completion 0, position 1: vLLM returned no log-prob.*token 7"):
        vllm_rollout_tensors(outputs)


def test_vllm_output_missing_the_sampled_token_names_the_sequence():
    outputs = [_request([4, 5], [-0.5, -1.0]), _request([6, 7], [-0.2, -0.1])]
    outputs[1].outputs[0].logprobs[1] = {3: SimpleNamespace(logprob=-0.1, rank=1)}
    with pytest.raises(
        ValueError,
        match=r"request 1, completion 0: vLLM returned no log-prob for the sampled token 7 "
        r"at position 1",
    ):
        vllm_rollout_tensors(outputs)


def test_packing_a_sample_without_a_sampled_log_prob_names_sample_and_position():
    from dppo_ext.rollout import RolloutSample, pack_rollout_samples

    samples = [
        RolloutSample(
            prompt_ids=[1],
            response_ids=[4, 5, 6],
            logprobs=[-0.5, -0.2, None],
            topk_ids=None,
            topk_logprobs=None,
            text="",
            finish_reason="stop",
        )
    ]
    with pytest.raises(ValueError, match=r"sample 0, position 2: no rollout log-prob \(None\) for the sampled token 6"):
        pack_rollout_samples(samples, pad_token_id=0, with_topk=False)


def test_vllm_output_with_every_log_prob_packs():
    packed = vllm_rollout_tensors([_request([4, 5], [-0.5, -math.inf])])
    assert packed.rollout_logprobs.tolist() == [[-0.5, -math.inf]]

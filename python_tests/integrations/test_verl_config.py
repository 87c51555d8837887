"""The verl plugin's config check (``dppo_ext.integrations.verl.config.validate``) on plain mappings: pure Python, so
it runs without verl installed (test_verl_plugin.py checks it on verl's own composed config when verl is there)."""

from __future__ import annotations

import pytest

from dppo_ext.integrations.verl.config import validate


def _config(max_logprobs=None, topk=4) -> dict:
    rollout = {"name": "vllm", "custom": {"dppo_topk": topk}}
    if max_logprobs is not None:
        rollout["engine_kwargs"] = {"vllm": {"max_logprobs": max_logprobs}}
    actor = {
        "policy_loss": {"loss_mode": "dppo_topk_tv"},
        "strategy": "fsdp2",
        "clip_ratio_low": 0.15,
        "clip_ratio_high": 0.15,
    }
    return {"actor_rollout_ref": {"actor": actor, "rollout": rollout}}


def test_max_logprobs_minus_one_is_no_cap():
    """vLLM's max_logprobs=-1 means no cap: any K passes (it was refused as 'more than vLLM returns (-1)')."""
    validate(_config(max_logprobs=-1, topk=64))
    validate(_config(max_logprobs=64, topk=64))
    with pytest.raises(ValueError, match=r"dppo_topk=65 is more than vLLM returns \(max_logprobs=64\)"):
        validate(_config(max_logprobs=64, topk=65))
    with pytest.raises(ValueError, match=r"dppo_topk=21 is more than vLLM returns \(max_logprobs=20\)"):
        validate(_config(topk=21))  # unset: vLLM's default, 20


@pytest.mark.parametrize("value", ["lots", "20", 2.5, True, -2])
def test_max_logprobs_that_is_not_a_count_is_refused_by_name(value):
    with pytest.raises(
        ValueError, match=r"engine_kwargs\.vllm\.max_logprobs must be an int >= 0 .* or -1 \(no cap\), got "
    ):
        validate(_config(max_logprobs=value))

"""The verl plugin's config check of the rollout's distribution (no verl needed: plain mappings, as the check reads
an omegaconf tree): ``rollout.logprobs_mode`` other than ``processed_logprobs`` is refused for the DPPO modes
(``raw_logprobs`` accepted at temperature 1 only), and truncated sampling (``rollout.top_p`` < 1, ``rollout.top_k``
> 0, a ``min_p`` > 0) is refused wherever the loss's mu is the rollout's log-probs (the top-K modes, bypass mode),
each message naming the setting, its value and the fix."""

from __future__ import annotations

import copy

import pytest

from dppo_ext.integrations.verl.config import validate

ROLLOUT = "actor_rollout_ref.rollout"


def _config(mode: str = "dppo_topk_tv", bypass: bool = False, **rollout) -> dict:
    """A composed ppo_trainer config reduced to what the check reads (verl's defaults for the rollout)."""
    base = {
        "actor_rollout_ref": {
            "actor": {
                "strategy": "fsdp2",
                "policy_loss": {"loss_mode": mode},
                "clip_ratio_low": 0.15,
                "clip_ratio_high": 0.15,
            },
            "rollout": {
                "name": "vllm",
                "temperature": 0.7,
                "top_p": 1.0,
                "top_k": -1,
                "logprobs_mode": "processed_logprobs",
                "custom": {"dppo_topk": 4},
            },
            "model": {},
        },
        "algorithm": {"rollout_correction": {"bypass_mode": bypass}},
        "trainer": {"use_v1": True},
    }
    config = copy.deepcopy(base)
    config["actor_rollout_ref"]["rollout"].update(rollout)
    return config


@pytest.mark.parametrize("mode", ("dppo_topk_tv", "dppo_topk_kl", "dppo_tv", "dppo_kl"))
def test_untruncated_processed_logprobs_pass(mode):
    validate(_config(mode))
    validate(_config(mode, top_k=0, top_p=1))


@pytest.mark.parametrize(
    "rollout, match",
    [
        (dict(top_p=0.9), rf"{ROLLOUT}.top_p=0.9 truncates the sampling distribution"),
        (dict(top_k=50), rf"{ROLLOUT}.top_k=50 truncates the sampling distribution"),
        (dict(min_p=0.05), rf"{ROLLOUT}.min_p=0.05 truncates the sampling distribution"),
        (dict(top_p=0.9, top_k=50), rf"{ROLLOUT}.top_k=50, {ROLLOUT}.top_p=0.9 truncates"),
        (dict(top_p=0.0), rf"{ROLLOUT}.top_p must be a number in \(0, 1\]"),
    ],
)
@pytest.mark.parametrize(("mode", "bypass"), [("dppo_topk_tv", False), ("dppo_topk_kl", False), ("dppo_tv", True)])
def test_truncated_sampling_refused_where_mu_is_the_rollouts(mode, bypass, rollout, match):
    with pytest.raises(ValueError, match=match) as caught:
        validate(_config(mode, bypass, **rollout))
    if "truncates" in match:
        fix = f"{ROLLOUT}.top_p=1, {ROLLOUT}.top_k=-1 (or 0) and {ROLLOUT}.min_p=0"
        assert str(caught.value).endswith(fix), str(caught.value)


@pytest.mark.parametrize("mode", ("dppo_tv", "dppo_kl"))
def test_binary_modes_anchored_on_old_log_probs_accept_truncated_sampling(mode):
    """Outside bypass mode the binary modes compare pi with the actor's recomputed old_log_probs, a
    full-vocabulary distribution: truncated sampling leaves their trust region exact."""
    validate(_config(mode, top_p=0.9, top_k=50))


@pytest.mark.parametrize("mode", ("dppo_topk_tv", "dppo_tv"))
@pytest.mark.parametrize(
    "rollout, match",
    [
        (dict(logprobs_mode="raw_logits"), rf"{ROLLOUT}.logprobs_mode='raw_logits' does not report log-probs"),
        (dict(logprobs_mode="processed_logits"), r"logprobs_mode='processed_logits' does not report log-probs"),
        (
            dict(logprobs_mode="raw_logprobs"),
            rf"{ROLLOUT}.logprobs_mode=raw_logprobs at {ROLLOUT}.temperature=0.7: .*set {ROLLOUT}.logprobs_mode="
            r"processed_logprobs",
        ),
    ],
)
def test_logprobs_mode_refused(mode, rollout, match):
    with pytest.raises(ValueError, match=match):
        validate(_config(mode, **rollout))


def test_raw_logprobs_at_temperature_one_pass():
    validate(_config(logprobs_mode="raw_logprobs", temperature=1.0))


def test_other_loss_modes_are_not_checked():
    validate(_config("vanilla", top_p=0.9, logprobs_mode="raw_logits"))

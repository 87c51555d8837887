"""The trainer's mechanism metrics (``--mechanism-metrics``) and rollout logit noise, against references
written here: the loss's mask recomputed from the logits the loss saw, pi_new recomputed with the model
right after each optimizer step, and the noise's mu recomputed from the documented key."""

from __future__ import annotations

import math

import pytest
import torch
from dppo_testing.trainers import hf_trainer

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.mechanism import MU_BIN_EDGES

TEMPERATURE = 0.5  # a random tiny model is near-uniform; a low temperature makes the noisy mu peaked (mu > 0.5 exists)


def _trainer(model_dir, tmp_path, **overrides):
    settings = dict(
        steps=2,
        prompts_per_step=8,
        group_size=4,
        max_new_tokens=4,
        num_minibatches=2,
        ppo_epochs=2,
        lr=3e-2,
        warmup_steps=0,
        seed=1,
        max_model_len=64,
        temperature=TEMPERATURE,
        mechanism_metrics=True,
        rollout_logit_noise=1.0,
    )
    return hf_trainer(model_dir, tmp_path, **{**settings, **overrides})


def _token_logp(model, micro) -> torch.Tensor:
    from dppo_ext.trainer.batch import response_logits

    logits = response_logits(model, micro).float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, micro.tokens[..., None]).squeeze(-1)


def _reference_mask(loss: str, logp: torch.Tensor, micro) -> torch.Tensor:
    """True where the loss masks the token: DPPO Binary-TV |pi - mu| > 0.15 moving away, or GRPO-clip-higher's
    ratio pi / mu outside [0.8, 1.28] in the advantage's direction."""
    pi, mu = logp.exp(), micro.rollout_logprobs.exp()
    adv = micro.advantages[:, None].expand_as(pi)
    if loss == "dppo_binary_tv":
        return torch.where(adv > 0, pi - mu > 0.15, mu - pi > 0.15)
    ratio = pi / mu
    return torch.where(adv > 0, ratio > 1.28, ratio < 0.8)


@pytest.mark.parametrize("loss", ["dppo_binary_tv", "grpo_clip_higher"])
def test_mechanism_metrics_match_a_recomputation(tiny_model_dir, tmp_path, loss):
    from dppo_ext.trainer import loop

    trainer = _trainer(tiny_model_dir, tmp_path, loss=loss)
    seen = []  # per optimizer update: [(micro, log pi before, log pi after)]
    pending = []
    real_logits = loop.response_logits

    def spy_logits(model, batch, logits_dtype=None):
        if torch.is_grad_enabled():
            with torch.no_grad():
                pending.append((batch, _token_logp(model, batch)))
        return real_logits(model, batch, logits_dtype)

    real_step = trainer.optimizer.step

    def spy_step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        with torch.no_grad():
            seen.append([(micro, before, _token_logp(trainer.model, micro)) for micro, before in pending])
        pending.clear()
        return out

    loop.response_logits = spy_logits
    trainer.optimizer.step = spy_step
    try:
        record = trainer.train_step()
    finally:
        loop.response_logits = real_logits
    assert record["optimizer_steps"] == len(seen) == 4

    masked = {"first": [0, 0], "later": [0, 0]}
    bins = {key: [0] * (len(MU_BIN_EDGES) - 1) for key in ("mp", "mn", "tp", "tn")}
    drift, drift_max, tokens, bad, removed, high = 0.0, 0.0, 0, 0, 0.0, 0
    for index, update in enumerate(seen):
        for micro, before, after in update:
            valid = micro.response_mask
            mu = micro.rollout_logprobs.exp()
            adv = micro.advantages[:, None].expand_as(mu)
            mask = _reference_mask(loss, before, micro) & valid
            key = "first" if index == 0 else "later"
            masked[key][0] += int(mask.sum())
            masked[key][1] += int(valid.sum())
            for b, (lo, hi) in enumerate(zip(MU_BIN_EDGES[:-1], MU_BIN_EDGES[1:])):
                in_bin = valid & (mu >= lo) & ((mu < hi) if hi < 1.0 else (mu <= hi))
                bins["tp"][b] += int((in_bin & (adv > 0)).sum())
                bins["tn"][b] += int((in_bin & (adv < 0)).sum())
                bins["mp"][b] += int((in_bin & (adv > 0) & mask).sum())
                bins["mn"][b] += int((in_bin & (adv < 0) & mask).sum())
            pi, pi_old = after.exp(), before.exp()
            gap = (pi - mu).abs()[valid]
            drift += float(gap.sum())
            drift_max = max(drift_max, float(gap.max()))
            tokens += int(valid.sum())
            away_new = torch.where(adv > 0, pi - mu, mu - pi)
            away_old = torch.where(adv > 0, pi_old - mu, mu - pi_old)
            bad += int((valid & (away_new > 0.15) & (away_new > away_old)).sum())
            neg_high = valid & (adv < 0) & (mu > 0.5)
            removed += float((pi_old - pi)[neg_high].sum())
            high += int(neg_high.sum())

    assert record["masked_frac_first"] == pytest.approx(masked["first"][0] / masked["first"][1], abs=1e-6)
    assert record["masked_frac_later"] == pytest.approx(masked["later"][0] / masked["later"][1], abs=1e-6)
    assert record["tokens_by_mu_pos"] == bins["tp"] and record["tokens_by_mu_neg"] == bins["tn"]
    assert record["masked_by_mu_pos"] == bins["mp"] and record["masked_by_mu_neg"] == bins["mn"]
    assert record["drift_mean"] == pytest.approx(drift / tokens, abs=1e-5)
    assert record["drift_max"] == pytest.approx(drift_max, abs=1e-5)
    assert record["bad_update_frac"] == pytest.approx(bad / tokens, abs=1e-6)
    assert record["neg_high_tokens"] == high
    assert record["neg_high_removed"] == pytest.approx(removed / high, abs=1e-5)
    # the inputs exercise what the metrics measure: the noise switches the mask on before any update,
    # tokens the rollout found likely exist, and updates move tokens (lr 3e-2)
    assert record["masked_frac_first"] > 0.05
    assert high > 0 and drift_max > 0.15
    assert sum(record["tokens_by_mu_pos"]) + sum(record["tokens_by_mu_neg"]) == masked["first"][1] + masked["later"][1]


def test_mechanism_metrics_are_off_by_default_and_cost_nothing_then(tiny_model_dir, tmp_path):
    record = _trainer(tiny_model_dir, tmp_path, mechanism_metrics=False).train_step()
    assert "masked_frac_first" not in record and "drift_mean" not in record
    assert record["optimizer_steps"] == 4


def test_rollout_logit_noise_reaches_the_rollouts_but_not_the_evaluation(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, rollout_logit_noise=0.3)
    calls = []
    real_generate = trainer.engine.generate

    def spy(prompts, **kwargs):
        calls.append(kwargs)
        return real_generate(prompts, **kwargs)

    trainer.engine.generate = spy
    record = trainer.train_step()
    trainer.evaluate()
    assert calls[0]["logit_noise"] == 0.3
    assert calls[1].get("logit_noise", 0.0) == 0.0
    # the rollout's mu is the noisy one: pre-update |pi - mu| far above float32 rounding (~1e-7 without noise)
    assert record["mismatch_mean"] > 1e-3


def test_noise_and_mechanism_flags_are_checked():
    with pytest.raises(ValueError, match=r"--rollout-logit-noise must be >= 0, got -0.1"):
        TrainConfig(rollout_logit_noise=-0.1).validate()
    with pytest.raises(ValueError, match=r"--rollout-logit-noise must be a finite number, got nan"):
        TrainConfig(rollout_logit_noise=math.nan).validate()
    # finite as a float, but sigma * eps overflows the logits: refused naming the flag, not a sampler's traceback
    with pytest.raises(ValueError, match=r"--rollout-logit-noise must be in \[0, 1000\] .*got 1e\+39"):
        TrainConfig(rollout_logit_noise=1e39).validate()
    for size in (-1, 16):
        with pytest.raises(ValueError, match=rf"--tiny-vocab-size must be 0 \(no padding\) or >= 17 .*got {size}"):
            TrainConfig(tiny_vocab_size=size).validate()
    assert TrainConfig(tiny_vocab_size=17).validate().tiny_vocab_size == 17


def test_padded_vocabulary_tokens_decode_to_non_numbers(tmp_path):
    from transformers import AutoTokenizer

    from dppo_ext.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", seed=0, vocab_size=64)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 64
    assert tokenizer("12+7=")["input_ids"] == [1, 5, 6, 14, 11, 16]  # text never encodes to a padding token
    text = tokenizer.decode([5, 40, 6], skip_special_tokens=True)
    assert text.startswith("1") and not text.isdigit()
    with pytest.raises(ValueError, match="vocab_size=10 is below the 17 tokens"):
        build_tiny_model(tmp_path / "n", vocab_size=10)

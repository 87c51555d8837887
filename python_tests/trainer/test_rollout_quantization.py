"""Rollout weight quantisation (``dppo_ext.rollout.quantize``, ``--rollout-weight-bits``): the rounding against a
float64 loop written from the formula, its properties, which layers it touches, its errors; and in the trainer:
the engine rolls out with the quantised weights from the first step, the held-out evaluation with the trainer's,
and the pre-update mismatch is the rounding's."""

from __future__ import annotations

import math

import pytest
import torch
from dppo_testing.trainers import hf_trainer

from dppo_ext.rollout.quantize import check_weight_quantization, fake_quantize, quantize_rollout_weights_
from dppo_ext.trainer.config import TrainConfig


def _reference(weight: torch.Tensor, bits: int, group: int, near_tie: list | None = None) -> torch.Tensor:
    """Group by group in float64: s = max|w| / (2^(b-1) - 1), w -> s * round(w / s) (Python's round: ties to even).
    ``near_tie`` collects the (row, column) of weights whose w / s lies within 1e-5 of a rounding tie, where the
    float32 kernel may rightly round the other way."""
    top = 2 ** (bits - 1) - 1
    w = weight.double().tolist()
    out = []
    for i, row in enumerate(w):
        new = []
        for start in range(0, len(row), group):
            chunk = row[start : start + group]
            scale = max(abs(v) for v in chunk) / top
            new += [0.0 if scale == 0 else scale * round(v / scale) for v in chunk]
            for j, v in enumerate(chunk):
                if near_tie is not None and scale and abs(abs(v / scale) % 1 - 0.5) < 1e-5:
                    near_tie.append((i, start + j))
        out.append(new)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(("rows", "cols", "group"), [(5, 37, 8), (3, 16, 16), (4, 7, 32), (2, 9, 1), (1, 64, 32)])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_the_rounding_matches_the_formula_group_by_group(rows, cols, group, bits):
    torch.manual_seed(rows * 100 + cols + bits)
    weight = torch.randn(rows, cols) * torch.logspace(-3, 1, cols)  # groups of very different sizes
    got = fake_quantize(weight, bits, group)
    ties: list = []
    want = _reference(weight, bits, group, ties)
    assert got.dtype == weight.dtype and got.shape == weight.shape
    for i, j in ties:  # torch's inputs differ by host: a draw that lands on a tie may round either way
        got[i, j] = want[i, j]
    torch.testing.assert_close(got.double(), want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
def test_each_group_holds_at_most_2b_minus_1_levels_within_half_a_step(bits):
    torch.manual_seed(bits)
    group = 16
    weight = torch.randn(8, 64)
    got = fake_quantize(weight, bits, group)
    top = 2 ** (bits - 1) - 1
    for g in range(0, 64, group):
        w, q = weight[:, g : g + group], got[:, g : g + group]
        scale = w.abs().amax(dim=1, keepdim=True) / top
        assert ((w - q).abs() <= scale / 2 * (1 + 1e-6)).all()
        for row in q:
            assert len(set(row.tolist())) <= 2 * top + 1
        # the largest weight of a group is kept (it sets the scale)
        idx = w.abs().argmax(dim=1)
        torch.testing.assert_close(q.gather(1, idx[:, None]), w.gather(1, idx[:, None]), rtol=1e-6, atol=0)


def test_more_bits_round_less_and_zeros_stay_zero():
    torch.manual_seed(0)
    weight = torch.randn(16, 128)
    weight[3] = 0.0
    errors = [float((fake_quantize(weight, b, 32) - weight).abs().mean()) for b in (2, 3, 4, 8)]
    assert errors == sorted(errors, reverse=True) and errors[-1] < errors[0] / 50
    assert torch.equal(fake_quantize(weight, 3, 32)[3], torch.zeros(128))


def test_a_16_bit_weight_keeps_its_dtype_and_a_nan_spoils_only_its_group():
    torch.manual_seed(1)
    weight = torch.randn(4, 64, dtype=torch.bfloat16)
    weight[1, 5] = math.nan
    got = fake_quantize(weight, 4, 32)
    assert got.dtype == torch.bfloat16
    assert got[1, :32].isnan().all() and got[1, 32:].isfinite().all()
    assert got[[0, 2, 3]].isfinite().all()
    torch.testing.assert_close(got[0].float(), _reference(weight[:1].float(), 4, 32)[0].float(), rtol=1e-2, atol=0)


def test_every_linear_layer_but_the_head_is_quantised(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = quantize_rollout_weights_(model, 3, 32)
    linear = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(names) == linear - {"lm_head"} and names
    after = model.state_dict()
    for key, value in after.items():
        module = key.rsplit(".", 1)[0]
        if module in names and key.endswith(".weight"):
            assert not torch.equal(value, before[key]), key
            torch.testing.assert_close(value, fake_quantize(before[key], 3, 32), rtol=0, atol=0)
        else:  # the head, the embeddings, the norms, any bias
            assert torch.equal(value, before[key]), key


def test_bad_settings_are_refused_with_the_argument_named():
    for bits in (0, 1, 9, True, 4.0):
        with pytest.raises(ValueError, match=r"bits must be one of \[2, 3, 4, 5, 6, 7, 8\].*got"):
            check_weight_quantization(bits, 32)
    for group in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match="group must be an int >= 1"):
            check_weight_quantization(4, group)
    with pytest.raises(ValueError, match=r"weight must be 2-D \[out, in\], got shape \(2, 3, 4\)"):
        fake_quantize(torch.zeros(2, 3, 4), 4, 32)
    with pytest.raises(ValueError, match="found no linear layer"):
        quantize_rollout_weights_(torch.nn.Sequential(torch.nn.ReLU()), 4, 32)
    with pytest.raises(ValueError, match=r"--rollout-weight-bits: unknown value 1; expected one of \[0, 2,"):
        TrainConfig(rollout_weight_bits=1).validate()
    with pytest.raises(ValueError, match="--rollout-weight-group"):
        TrainConfig(rollout_weight_bits=4, rollout_weight_group=0).validate()


def _trainer(model_dir, tmp_path, **overrides):
    settings = dict(
        steps=3,
        prompts_per_step=4,
        group_size=4,
        max_new_tokens=4,
        num_minibatches=2,
        ppo_epochs=1,
        lr=1e-2,
        warmup_steps=0,
        seed=3,
        max_model_len=64,
        mechanism_metrics=True,
    )
    return hf_trainer(model_dir, tmp_path, **{**settings, **overrides})


@pytest.mark.parametrize("lag", [0, 2])
def test_the_engine_rolls_out_with_quantised_weights_and_evaluates_with_the_trainers(tiny_model_dir, tmp_path, lag):
    trainer = _trainer(tiny_model_dir, tmp_path, loss="dppo_binary_tv", rollout_weight_bits=3, rollout_lag=lag)
    engine_model, real_generate = trainer.engine.model, trainer.engine.generate
    used = []  # the weights the engine held at each generate call

    def spy_generate(*args, **kwargs):
        used.append({k: v.clone() for k, v in engine_model.state_dict().items()})
        return real_generate(*args, **kwargs)

    trainer.engine.generate = spy_generate
    history = [{k: v.clone() for k, v in trainer.model.state_dict().items()}]
    quantised = {n + ".weight" for n, m in trainer.model.named_modules() if isinstance(m, torch.nn.Linear)}
    quantised.discard("lm_head.weight")
    mismatch = []
    for _ in range(3):
        record = trainer.train_step()
        source = history[max(0, len(history) - 1 - lag)]  # under a lag, the weights of k steps ago
        for key, value in used[-1].items():
            if key in quantised:
                torch.testing.assert_close(
                    value, fake_quantize(source[key], 3, trainer.config.rollout_weight_group), rtol=0, atol=0
                )
            else:
                assert torch.equal(value, source[key]), key
        history.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        mismatch.append(record.get("pre_mismatch_mean"))  # absent on a step with nothing to train
    assert len(used) == 3
    measured = [m for m in mismatch if m is not None]
    assert measured and all(m > 1e-4 for m in measured)  # the rounding shows (synced weights: ~1e-8, as below)
    current = history[-1]
    held = {k: v.clone() for k, v in engine_model.state_dict().items()}
    trainer.evaluate()
    assert all(torch.equal(used[-1][k], current[k]) for k in current)  # evaluated with the trainer's own weights
    after = engine_model.state_dict()
    assert all(torch.equal(after[k], held[k]) for k in held)  # and the quantised ones back after it


def test_the_mismatch_is_the_roundings_and_shrinks_with_more_bits(tiny_model_dir, tmp_path):
    means = {}
    for bits in (0, 8, 3):
        trainer = _trainer(tiny_model_dir, tmp_path / f"b{bits}", loss="dppo_binary_tv", rollout_weight_bits=bits)
        means[bits] = trainer.train_step()["pre_mismatch_mean"]
    assert means[0] < 1e-5 < means[8] < means[3]

"""Unit tests of the reference trainer that need no vLLM: advantages, data loading, verifiers,
config validation, batch layout, a few HF-engine training steps, and exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dppo_ext.rollout.base import RolloutSample
from dppo_ext.tasks import DataFormatError, get_verifier, load_jsonl_problems, make_arithmetic_task
from dppo_ext.trainer.advantages import group_advantages
from dppo_ext.trainer.batch import checked_logits_dtype, collate_rollouts, response_logits
from dppo_ext.trainer.cli import parse_config
from dppo_ext.trainer.config import TrainConfig


# ---------------------------------------------------------------- advantages
def test_group_advantages_mean_only_on_hand_made_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, normalize_std=False)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0], [-0.25, -0.25, -0.25, 0.75]])
    torch.testing.assert_close(adv, expected)


def test_group_advantages_std_normalised_on_hand_made_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = group_advantages(rewards, normalize_std=True, eps=0.0)
    std3 = math.sqrt(0.75 * 0.25)  # population std of {0, 0, 0, 1}
    expected = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-0.25 / std3, -0.25 / std3, -0.25 / std3, 0.75 / std3]])
    torch.testing.assert_close(adv, expected)
    # every normalised group with variance has zero mean and unit population std
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(adv.std(dim=1, unbiased=False), torch.ones(2))


def test_group_advantages_zero_variance_groups_are_exactly_zero():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [0.0, 0.0, 0.0]])
    for normalize in (True, False):
        adv = group_advantages(rewards, normalize_std=normalize)
        assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize(
    ("rewards", "match"),
    [
        (torch.zeros(4), r"\[P, G\]"),
        (torch.zeros(3, 1), "group size >= 2"),
        (torch.tensor([[0.0, math.nan]]), "finite"),
    ],
)
def test_group_advantages_rejects_bad_rewards(rewards, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards)


# ---------------------------------------------------------------- verifiers and data
@pytest.mark.parametrize(
    ("verifier", "response", "answer", "accepted"),
    [
        ("exact", "19", "19", True),
        ("exact", "190", "19", False),
        ("exact", " -42 \nmore", "-42", True),
        ("numeric", "The total is 1,234 apples.", "1234", True),
        ("numeric", "first 3 then 5", "3", False),
        ("numeric", "so 6*7 = 42\n#### 42", "42", True),
        ("numeric", "#### 41 but really 42", "42", False),
        ("numeric", "answer \\boxed{3.50}", "3.5", True),
        ("numeric", "no number here", "7", False),
        ("auto", "x = -8", "-8", True),
        ("auto", "Paris", "Paris", True),
        ("auto", "paris", "Paris", False),
    ],
)
def test_verifiers(verifier, response, answer, accepted):
    assert get_verifier(verifier)(response, answer) is accepted


def test_numeric_verifier_needs_a_numeric_answer():
    with pytest.raises(ValueError, match="numeric answer"):
        get_verifier("numeric")("12", "twelve")


def test_arithmetic_task_splits_are_disjoint_and_answers_are_right():
    task = make_arithmetic_task(max_operand=12, num_eval=40, num_sft=60, seed=3)
    prompts = [{p.prompt for p in split} for split in (task.train, task.eval, task.sft)]
    assert not (prompts[0] & prompts[1]) and not (prompts[0] & prompts[2]) and not (prompts[1] & prompts[2])
    assert sum(map(len, prompts)) == 2 * 13 * 13
    for problem in task.train[:50] + task.eval:
        a, op, b = problem.prompt[:-1].partition("+") if "+" in problem.prompt else problem.prompt[:-1].partition("-")
        assert int(problem.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    assert task.reward(task.eval[0].answer, task.eval[0].answer) == 1.0


def test_jsonl_loader_reads_problems(tmp_path: Path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"prompt": "2+2?", "answer": 4}\n\n{"prompt": "capital of France?", "answer": "Paris", "id": 7}\n'
        '{"prompt": "half of 3?", "answer": 1.5}\n{"prompt": "3.0?", "answer": 3.0}\n'
    )
    problems = load_jsonl_problems(path)
    assert [(p.prompt, p.answer) for p in problems] == [
        ("2+2?", "4"),
        ("capital of France?", "Paris"),
        ("half of 3?", "1.5"),
        ("3.0?", "3"),
    ]


@pytest.mark.parametrize(
    ("bad_line", "match"),
    [
        ('{"prompt": "x", "answer": ', "invalid JSON"),
        ('["x", "1"]', "expected a JSON object"),
        ('{"prompt": "x"}', r"missing key\(s\) \['answer'\]"),
        ('{"prompt": "", "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": true}', "'answer' must be a string or number"),
        ('{"prompt": "x", "answer": null}', "'answer' must be a string or number"),
        ('{"prompt": "x", "answer": "  "}', "'answer' must not be empty"),
    ],
)
def test_jsonl_loader_names_file_and_line_of_a_malformed_line(tmp_path: Path, bad_line: str, match: str):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "answer": "1"}\n\n' + bad_line + "\n")
    with pytest.raises(DataFormatError, match=rf"bad\.jsonl:3: {match}"):
        load_jsonl_problems(path)


def test_jsonl_loader_missing_and_empty_files(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_jsonl_problems(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFormatError, match="no problems"):
        load_jsonl_problems(tmp_path / "empty.jsonl")


# ---------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"loss": "ppo_magic"}, r"--loss: unknown value 'ppo_magic'"),
        ({"loss": "dppo_topk_tv", "top_k": 0}, r"--top-k must be >= 1, got 0"),
        ({"loss": "dppo_topk_kl", "top_k": 0}, r"--top-k must be >= 1"),
        ({"group_size": 1}, r"--group-size must be >= 2"),
        ({"model": "/definitely/not/here", "data": ""}, r"--model '/definitely/not/here': no such folder"),
        ({"engine": "tgi"}, r"--engine: unknown value 'tgi'"),
        ({"temperature": 0.0}, r"--temperature must be > 0"),
        ({"data": "/no/such.jsonl"}, r"--data '/no/such.jsonl': no such file"),
        ({"delta_low": -0.1}, r"--delta-low must be >= 0"),
        ({"num_minibatches": 1000}, r"--num-minibatches=1000 exceeds"),
    ],
)
def test_config_validation_messages(overrides, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**overrides).validate()


def test_every_range_names_numeric_settings_whose_defaults_it_holds():
    import dataclasses
    import typing

    from dppo_ext.trainer.config import RANGES, Range

    hints = typing.get_type_hints(TrainConfig)
    numeric = {int, float, typing.Optional[float]}
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    for bound, names in RANGES:
        for name in names.split():
            assert hints[name] in numeric, name
            assert defaults[name] is None or defaults[name] in bound, (name, str(bound))
    # the ends, open or closed, as the messages write them
    assert (0.5 in Range(0, 1, high_open=True), 1 in Range(0, 1, high_open=True), 0 in Range(0, low_open=True)) == (
        True,
        False,
        False,
    )
    assert [str(r) for r in (Range(1), Range(0, low_open=True), Range(0, 2**32, high_open=True, why="w"))] == [
        ">= 1",
        "> 0",
        "in [0, 2**32) (w)",
    ]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--top-p", "0"], r"--top-p must be a number in \(0, 1\]"),
        (["--sample-top-k", "-2"], r"--sample-top-k must be an int >= -1"),
        (["--min-p", "1.5"], r"--min-p must be a number in \[0, 1\]"),
        (["--sample-logprobs", "-1"], r"--sample-logprobs must be >= 0"),
        (["--engine", "hf", "--top-p", "0.9"], r"--top-p=0.9 truncates the sampling, which only --engine vllm"),
        (["--engine", "hf", "--top-p", "0.7", "--sample-top-k", "2"], r"--sample-top-k=2, --top-p=0.7 truncates"),
    ],
)
def test_sampling_flags_checked_and_truncation_refused_where_it_cannot_be_replayed(flags, match):
    """Each sampling flag's range is checked, naming the flag; truncated sampling runs with replay on the vLLM
    engine and is refused, with the fix, on the transformers engine (which cannot return the kept sets)."""
    with pytest.raises(ValueError, match=match) as caught:
        parse_config(flags)
    if "truncates" in match:
        assert str(caught.value).endswith("--top-p 1 --sample-top-k -1 --min-p 0"), str(caught.value)


def test_truncated_sampling_config_carries_the_replay_settings():
    config = parse_config(["--engine", "vllm", "--top-p", "0.7", "--sample-top-k", "5", "--sample-logprobs", "8"])
    assert config.truncates_sampling
    truncation = config.truncation()
    assert (truncation.top_k, truncation.top_p, truncation.min_p, truncation.logprobs) == (5, 0.7, 0.0, 8)
    assert config.sampling_replay and not parse_config(["--top-p", "0.7", "--no-sampling-replay"]).sampling_replay
    plain = parse_config(["--top-p", "1", "--sample-top-k", "0", "--min-p", "0"])
    assert not plain.truncates_sampling and not plain.truncation().truncates


def test_cli_parses_every_field_and_rejects_bad_values(capsys):
    config = parse_config(
        ["--loss", "dppo_topk_kl", "--top-k", "4", "--no-adv-std", "--delta-low", "0.1", "--steps", "3"]
    )
    assert (config.loss, config.mode, config.top_k, config.adv_std, config.delta_low, config.steps) == (
        "dppo_topk_kl",
        "topk_kl",
        4,
        False,
        0.1,
        3,
    )
    assert config.delta_high is None
    with pytest.raises(SystemExit):
        parse_config(["--loss", "unknown"])
    assert "invalid choice: 'unknown'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--group-size must be >= 2"):
        parse_config(["--group-size", "1"])


def test_cli_accepts_verl_names():
    """verl's loss_mode names select our modes; every aggregation mode, current verl's names included, parses."""
    assert parse_config(["--loss", "dppo_tv"]).mode == "binary_tv"
    assert parse_config(["--loss", "dppo_kl"]).mode == "binary_kl"
    for agg in ("token-sum", "seq-mean-token-sum-norm", "token-sum-norm"):
        assert parse_config(["--loss-agg-mode", agg]).loss_agg_mode == agg


def test_cli_main_reports_config_errors(capsys):
    from dppo_ext.train import main

    assert main(["--loss", "dppo_topk_tv"]) == 2
    assert "--top-k must be >= 1" in capsys.readouterr().err


def test_settings_dump_shows_only_what_applies():
    """Issue 38 row 9: with --model the dump listed the embedded model's settings (warm-start-steps 1000, ...)."""
    embedded_only = {
        "max-operand",
        "max-second-operand",
        "tiny-layers",
        "tiny-hidden",
        "tiny-vocab-size",
        "warm-start-steps",
        "warm-start-problems",
        "warm-start-lr",
        "warm-start-label-smoothing",
    }

    def flags(text: str) -> set[str]:
        return {line.split()[0] for line in text.splitlines() if not line.strip().startswith("(")}

    embedded = TrainConfig().describe()
    assert embedded_only <= flags(embedded) and "do not apply" not in embedded
    with_model = TrainConfig(model="Qwen/Qwen2.5-0.5B-Instruct", data="train.jsonl").describe()
    assert flags(with_model) == flags(embedded) - embedded_only
    assert "(9 settings of the embedded model and task do not apply to --model)" in with_model
    assert "'Qwen/Qwen2.5-0.5B-Instruct'" in with_model and "num-eval" in flags(with_model)


# ---------------------------------------------------------------- batch layout
def _sample(prompt, response, logprobs):
    return RolloutSample(prompt, response, logprobs, None, None, "", "stop")


def test_collate_and_response_logits_match_unpadded_forwards(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from dppo_ext.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    samples = [
        _sample([1, 5, 6, 14, 7, 16], [8, 9, 2], [-0.1, -0.2, -0.3]),
        _sample([1, 4, 14, 4, 16], [4, 2], [-0.5, -0.6]),
        _sample([1, 9, 9, 15, 10, 10, 16], [4], [-0.7]),
    ]
    batch = collate_rollouts(samples, [1.0, -1.0, 0.5], pad_id=0, with_topk=False)
    assert batch.tokens.tolist() == [[8, 9, 2], [4, 2, 0], [4, 0, 0]]
    assert batch.response_mask.tolist() == [[True, True, True], [True, True, False], [True, False, False]]
    assert batch.rollout_logprobs[1].tolist() == pytest.approx([-0.5, -0.6, 0.0])
    with torch.no_grad():
        logits = response_logits(model, batch)
        for row, sample in enumerate(samples):
            full = model(input_ids=torch.tensor([sample.prompt_ids + sample.response_ids])).logits[0]
            p, t = len(sample.prompt_ids), len(sample.response_ids)
            torch.testing.assert_close(logits[row, :t], full[p - 1 : p + t - 1], atol=1e-5, rtol=1e-5)
        sub = batch.select(torch.tensor([2, 1]))
        assert sub.response_len == 2 and sub.tokens.tolist() == [[4, 0], [4, 2]]
        torch.testing.assert_close(response_logits(model, sub)[1], logits[1, :2], atol=1e-5, rtol=1e-5)


def _bf16_batch(tmp_path: Path):
    from transformers import AutoModelForCausalLM

    from dppo_ext.models.tiny import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    samples = [
        _sample([1, 5, 6, 14, 7, 16], [8, 9, 2], [-0.1, -2.2, -0.3]),
        _sample([1, 4, 14, 4, 16], [4, 2], [-1.5, -0.6]),
        _sample([1, 9, 9, 15, 10, 10, 16], [4], [-0.7]),
    ]
    return folder, model, collate_rollouts(samples, [1.0, -1.0, 0.5], pad_id=0, with_topk=False)


def test_float32_logits_from_a_bf16_model_are_the_float32_lm_heads(tmp_path: Path):
    """--logits-dtype float32 on a bfloat16 model: the response logits are the LM head's products of the bf16
    hidden states and weight accumulated in float32 (float64's, rounded once to float32), not the bf16 logits
    widened; and the loss on them equals fused_linear_dppo_loss(logits_dtype=torch.float32) on the same rows."""
    from dppo_ext import dppo_loss, fused_linear_dppo_loss

    _, model, batch = _bf16_batch(tmp_path)
    with torch.no_grad():
        wide = response_logits(model, batch, torch.float32)
        narrow = response_logits(model, batch)
        hidden = model.base_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
        ).last_hidden_state[:, -(batch.response_len + 1) : -1]
    weight = model.get_output_embeddings().weight
    exact = hidden.double() @ weight.double().t()
    assert wide.dtype == torch.float32 and narrow.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16
    wide_error = (wide.double() - exact).abs().max()
    narrow_error = (narrow.double() - exact).abs().max()
    assert wide_error < 1e-5 * exact.abs().max(), wide_error
    assert narrow_error > 100 * wide_error, (narrow_error, wide_error)  # the bf16 logits are rounded, these are not
    inputs = (batch.tokens, batch.rollout_logprobs, batch.advantages[:, None].expand(batch.tokens.shape))
    settings = dict(response_mask=batch.response_mask, temperature=0.8)
    loss, _ = dppo_loss(wide, *inputs, **settings)
    fused, _ = fused_linear_dppo_loss(hidden, weight, *inputs, logits_dtype=torch.float32, **settings)
    torch.testing.assert_close(loss, fused, rtol=1e-5, atol=1e-7)
    narrow_loss, _ = dppo_loss(narrow, *inputs, **settings)
    assert not torch.allclose(loss, narrow_loss.float(), rtol=1e-5, atol=1e-7)


def test_logits_dtype_reaches_the_trainers_loss_and_is_checked(tmp_path: Path, monkeypatch):
    """--logits-dtype float32 with --dtype bfloat16: every logits the trainer scores are response_logits(...,
    torch.float32); a bad value, and a model that soft-caps its logits, are refused naming the flag."""
    from transformers import AutoTokenizer

    from dppo_ext.trainer.loop import Trainer

    folder, model, batch = _bf16_batch(tmp_path)
    config = TrainConfig(dtype="bfloat16", logits_dtype="float32", num_minibatches=1, ppo_epochs=1).validate()
    assert checked_logits_dtype(model, config.logits_dtype) == torch.float32
    assert checked_logits_dtype(model.float(), "float32") is None  # a float32 model's logits are float32 already
    model.bfloat16()
    assert parse_config(["--dtype", "bfloat16", "--logits-dtype", "float32"]).logits_dtype == "float32"
    with pytest.raises(ValueError, match=r"--logits-dtype: unknown value 'fp32'; expected one of \['float32'\]"):
        TrainConfig(logits_dtype="fp32").validate()
    with pytest.raises(SystemExit):
        parse_config(["--logits-dtype", "bfloat16"])
    trainer = Trainer(config, model, AutoTokenizer.from_pretrained(folder), make_arithmetic_task(), None, tmp_path)
    seen = []

    def spy(logits, *args, **kwargs):
        seen.append((logits.detach().clone(), args[0]))
        return dppo_loss(logits, *args, **kwargs)

    from dppo_ext import dppo_loss

    monkeypatch.setattr(trainer, "_dppo_loss", spy)
    with torch.no_grad():
        want = response_logits(model, batch, torch.float32)
    trainer.update(batch)
    ((logits, tokens),) = seen
    assert logits.dtype == torch.float32
    for row, row_tokens in enumerate(tokens):  # the mini-batch holds the batch's rows in a shuffled order
        index = next(i for i, t in enumerate(batch.tokens) if torch.equal(t, row_tokens))
        torch.testing.assert_close(logits[row], want[index], rtol=0, atol=0)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"--logits-dtype does not support models that transform .*: leave"):
        Trainer(config, model, AutoTokenizer.from_pretrained(folder), make_arithmetic_task(), None, tmp_path)


# ---------------------------------------------------------------- short training runs (HF engine)
def _tiny_run_config(out: Path, **overrides) -> TrainConfig:
    settings = dict(
        out=str(out),
        engine="hf",
        max_operand=9,
        num_eval=16,
        warm_start_problems=60,
        warm_start_steps=30,
        steps=4,
        prompts_per_step=6,
        group_size=4,
        num_minibatches=2,
        eval_every=2,
        eval_samples=1,
        save_every=2,
        max_new_tokens=4,
        lr=1e-3,
        threads=1,
        seed=5,
        warm_start_label_smoothing=0.0,
    )
    settings.update(overrides)
    return TrainConfig(**settings).validate()


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


TIMING_KEYS = ("rollout_s", "update_s", "sync_s", "eval_s", "elapsed_s")


def _comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.parametrize("loss", ["dppo_binary_tv", "dppo_topk_kl"])
def test_hf_engine_training_steps_change_weights_and_stay_in_sync(tmp_path: Path, loss: str):
    from dppo_ext.train import run
    from dppo_ext.trainer.metrics import read_metrics

    config = _tiny_run_config(tmp_path / "run", loss=loss, top_k=3 if "topk" in loss else 0, steps=2, save_every=0)
    summary = run(config, progress=False)
    before = _weights(tmp_path / "run" / "base_model")
    after = _weights(tmp_path / "run" / "checkpoint-2" / "model")
    assert any(not torch.equal(before[name], after[name]) for name in before)
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] > 0]
    assert len(records) == 2
    # linear warm-up: step s (1-based) trains at lr * s / warmup_steps
    assert [r["lr"] for r in records] == pytest.approx(
        [config.lr / config.warmup_steps, 2 * config.lr / config.warmup_steps]
    )
    for record in records:
        assert record["optimizer_steps"] > 0 and math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])
        # fp32 HF rollouts of synced weights: the trainer's pi equals the rollout's mu up to rounding
        assert record["mismatch_max"] < 1e-4
    assert summary["start_acc"] is not None and summary["end_acc"] is not None
    assert (tmp_path / "run" / "metrics.png").stat().st_size > 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_resume_continues_identically(tmp_path: Path):
    from dppo_ext.train import run
    from dppo_ext.trainer.metrics import read_metrics

    run(_tiny_run_config(tmp_path / "straight"), progress=False)
    run(_tiny_run_config(tmp_path / "split", steps=2), progress=False)
    # a crash after step 3 was logged but before its checkpoint, in the middle of the next line
    with (tmp_path / "split" / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "reward": 0.123}\n{"step": 4, "rew')
    run(_tiny_run_config(tmp_path / "split", steps=4, resume=True), progress=False)

    straight = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    split = read_metrics(tmp_path / "split" / "metrics.jsonl")
    assert [r["step"] for r in split] == [0, 1, 2, 3, 4]
    assert _comparable(split) == _comparable(straight)
    assert read_metrics(tmp_path / "split" / "metrics.dropped.jsonl") == [{"step": 3, "reward": 0.123}]
    assert sorted(p.name for p in (tmp_path / "split").glob("checkpoint*")) == ["checkpoint-2", "checkpoint-4"]
    a, b = (
        _weights(tmp_path / "straight" / "checkpoint-4" / "model"),
        _weights(tmp_path / "split" / "checkpoint-4" / "model"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_checkpoint_fails_fast(tmp_path: Path):
    from dppo_ext.train import run

    with pytest.raises(FileNotFoundError, match="--resume: no complete checkpoint"):
        run(_tiny_run_config(tmp_path / "fresh", resume=True), progress=False)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize(
    "agg",
    (
        "token-mean",
        "token-sum",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "token-sum-norm",
    ),
)
def test_micro_batches_add_up_to_the_mini_batch(agg):
    """Gradient accumulation: the micro-batches' losses (each trimmed to its own longest response, as the trainer
    does), weighted by micro_batch_scale, add up to the mini-batch's loss in every aggregation mode
    (docs/aggregation.md)."""
    from dppo_ext.aggregation import aggregate_loss, micro_batch_scale
    from dppo_ext.contract import NORM_AGG_MODES

    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 3, 2, 4, 1, 2]
    samples = [_sample([1, 2], [3] * n, [-0.5] * n) for n in lengths]
    batch = collate_rollouts(samples, [1.0] * len(samples), pad_id=0, with_topk=False)
    per_token = torch.randn(len(samples), max(lengths), generator=g, dtype=torch.float64)
    horizon = 6.0 if agg in NORM_AGG_MODES else None  # the trainer passes --max-new-tokens
    mb_index = torch.tensor([6, 0, 3, 1, 5, 2, 4])
    want = aggregate_loss(per_token[mb_index], batch.response_mask[mb_index], agg, horizon)
    mb_mask = batch.response_mask[mb_index]
    total = 0.0
    for part in mb_index.split(3):
        micro = batch.select(part)
        loss = aggregate_loss(per_token[part, : micro.response_len], micro.response_mask, agg, horizon)
        total += loss * micro_batch_scale(agg, micro.response_mask, float(mb_mask.sum()), float(mb_mask.any(-1).sum()))
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)


def test_the_run_folders_json_reader_takes_an_object_only(tmp_path: Path):
    from dppo_ext.trainer.run_folder.files import json_object_or_none, read_json_object

    (tmp_path / "object.json").write_text('{"step": 3}')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "cut.json").write_text('{"step": ')
    assert read_json_object(tmp_path / "object.json") == {"step": 3}
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        read_json_object(tmp_path / "list.json")
    with pytest.raises(ValueError):
        read_json_object(tmp_path / "cut.json")
    with pytest.raises(OSError):
        read_json_object(tmp_path / "missing.json")
    assert [json_object_or_none(tmp_path / n) for n in ("list.json", "cut.json", "missing.json")] == [None] * 3


@pytest.mark.parametrize(
    "logits_dtype, rollout_dtype, head",
    [("float32", "bfloat16", "float32"), (None, "bfloat16", None), ("float32", "float32", None)],
)
def test_a_float32_head_in_the_trainer_runs_the_vllm_engines_head_in_float32_too(
    logits_dtype, rollout_dtype, head, monkeypatch
):
    """--logits-dtype float32 with a 16-bit vLLM engine: the engine's LM head runs in float32 too (vLLM's
    head_dtype), so the head's rounding is not left in |pi - mu| on one side only."""
    from dppo_ext.trainer import engine as engine_module

    seen = {}
    monkeypatch.setattr(engine_module, "make_engine", lambda kind, path, **kw: seen.update(kw) or "engine")
    monkeypatch.setattr(engine_module, "engine_kind", lambda config: "vllm")
    config = TrainConfig(logits_dtype=logits_dtype, rollout_dtype=rollout_dtype, dtype="bfloat16")
    assert engine_module.make_rollout_engine(config, "model", torch.device("cpu")) == "engine"
    assert seen.get("hf_overrides", {}).get("head_dtype") == head

"""dppo_ext.integrations.trl: DPPOGRPOTrainer on a tiny local model (no download), CPU.

Checks: a few training steps through TRL (fused-linear and logits paths): finite loss, every weight changes, our
metrics in TRL's log history; the trainer's loss on a fixed batch equals the op-free reference computed from the
model's ordinary logits (so the hidden-state/token alignment is right); vLLM log-probs are the anchor when
present, NaN ones fall back to the old policy; config and version errors; the package imports nothing and
changes nothing until a name is used, and every public name keeps its import path; docs/trl.md's snippet runs
as written; examples/trl_dppo_grpo.py learns (its held-out accuracy and training reward rise).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from datasets import Dataset  # noqa: E402
from dppo_testing import child_env  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import dppo_ext  # noqa: E402
from dppo_ext.contract import AGG_MODES, DEFAULT_DELTAS, icepop_deltas  # noqa: E402
from dppo_ext.integrations import trl as dppo_trl  # noqa: E402
from dppo_ext.integrations.trl import (  # noqa: E402
    DPPOGRPOConfig,
    DPPOGRPOTrainer,
    add_dppo_head,
    check_trl_version,
    split_vllm_logprobs,
)
from dppo_ext.models.tiny import build_tiny_model  # noqa: E402
from dppo_ext.reference import aggregate_loss_reference, dppo_loss_reference  # noqa: E402

DPPO_METRICS = ("masked_frac", "mismatch_mean", "divergence_mean", "entropy_mean", "ratio_max", "num_tokens")
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
# The flags test_example_learns runs examples/trl_dppo_grpo.py with (shorter than its default run).
EXAMPLE_TEST_FLAGS = ("--steps", "100", "--updates-per-generation", "1")  # on-policy: the learning check
# The public names of dppo_ext.integrations.trl when it was one module (trl.py): each still imports from there.
PUBLIC_NAMES = {
    "DPPOGRPOConfig": "config",
    "VLLM_DTYPES": "config",
    "DPPOForwardOutput": "head",
    "add_dppo_head": "head",
    "split_vllm_logprobs": "generation",
    "DPPOGRPOTrainer": "trainer",
    "SUPPORTED_TRL": "versions",
    "TESTED_TRL": "versions",
    "TESTED_VLLM": "versions",
    "check_trl_version": "versions",
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def count_ones(completions, **_):
    return [float(c.count("1")) for c in completions]


def make_trainer(model_dir: str, out_dir, **config) -> DPPOGRPOTrainer:
    settings = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    args = DPPOGRPOConfig(**{**settings, **config})
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]})
    return DPPOGRPOTrainer(
        model=model_dir,
        reward_funcs=count_ones,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )


@pytest.mark.parametrize("fused", (True, False), ids=("fused_linear", "logits"))
def test_trains_a_few_steps(tiny_model, tmp_path, fused, caplog):
    trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=fused, dppo_chunk_size=5 if fused else None)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with caplog.at_level("WARNING", logger=dppo_trl.__name__):
        trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    assert all(math.isfinite(h["loss"]) for h in steps)
    for name in DPPO_METRICS:
        assert all(f"dppo/{name}" in h and math.isfinite(h[f"dppo/{name}"]) for h in steps), name
    assert all(h["dppo/num_tokens"] > 0 and h["dppo/recompute_variant"] == 1.0 for h in steps)
    assert "'recompute' variant" in caplog.text
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p.detach())]
    assert not unchanged, f"parameters not updated: {unchanged}"


def _fixed_batch(trainer: DPPOGRPOTrainer, seed: int = 0) -> dict:
    """A generation-batch-like dict: 3 sequences, left-padded prompts, right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_ids = torch.randint(4, vocab, (3, 5), generator=g)
    prompt_mask = torch.ones(3, 5, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_ids = torch.randint(4, vocab, (3, 6), generator=g)
    completion_mask = torch.ones(3, 6, dtype=torch.long)
    completion_mask[1, 4:] = 0
    completion_mask[2, 2:] = 0
    old = -torch.rand(3, 6, generator=g) * 4
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7]),
        "old_per_token_logps": old,
        "num_items_in_batch": completion_mask.sum().float(),
    }


@pytest.mark.parametrize("fused", (True, False), ids=("fused_linear", "logits"))
@pytest.mark.parametrize("mode", ("binary_tv", "ratio"))
def test_loss_matches_reference_on_model_logits(tiny_model, tmp_path, fused, mode):
    # bf16=False: TRL 1.16 defaults to bf16 autocast, which would round the backbone differently per path.
    trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=fused, dppo_mode=mode, temperature=0.9, bf16=False)
    inputs = _fixed_batch(trainer)
    trainer.model.eval()  # eval: no gradient-accumulation scaling, same as a single micro-batch
    loss = trainer._compute_loss(trainer.model, inputs)

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
    mask = inputs["completion_mask"].bool()
    low, high = DEFAULT_DELTAS[mode]
    ref = dppo_loss_reference(
        logits.reshape(18, -1).double(),
        inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        inputs["old_per_token_logps"].reshape(-1).double(),
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        mode=mode,
        temperature=0.9,
        delta_low=low,
        delta_high=high,
        ratio_cap=10.0,
    )
    want = ref["loss"].sum() / mask.sum()
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=1e-6)
    assert trainer._metrics["eval"]["dppo/num_tokens"][-1] == mask.sum().item()


@pytest.mark.parametrize("fused", (True, False), ids=("fused_linear", "logits"))
def test_symmetric_mask_and_penalty_reach_the_loss(tiny_model, tmp_path, fused):
    """dppo_mask_direction and dppo_kl_tau / dppo_kl_mask_type are the API's mask_direction, kl_tau, kl_mask_type:
    IcePop's band through the TRL config gives the float64 reference's loss (plus the penalty on the kept tokens)."""
    low, high = icepop_deltas(0.12, 2.0)
    trainer = make_trainer(
        tiny_model,
        tmp_path,
        dppo_fused_linear=fused,
        dppo_mode="ratio",
        dppo_mask_direction="symmetric",
        dppo_delta_low=low,
        dppo_delta_high=high,
        dppo_kl_tau=0.05,
        dppo_kl_mask_type="unmasked",
        bf16=False,
    )
    inputs = _fixed_batch(trainer)
    trainer.model.eval()
    loss = trainer._compute_loss(trainer.model, inputs)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
    mask = inputs["completion_mask"].bool()
    old = inputs["old_per_token_logps"].reshape(-1).double()
    ref = dppo_loss_reference(
        logits.reshape(18, -1).double(),
        inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        old,
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        mode="ratio",
        mask_direction="symmetric",
        delta_low=low,
        delta_high=high,
    )
    kept = (ref["mask"] > 0) & mask.reshape(-1)
    ratio = (ref["logp"] - old).exp()[mask.reshape(-1)]
    assert kept.any() and (~kept & mask.reshape(-1)).any(), f"the band must keep some tokens and drop others: {ratio}"
    penalty = torch.where(kept, 0.05 * (ref["logp"] - old) ** 2, torch.zeros_like(old))
    want = (ref["loss"] + penalty).sum() / mask.sum()
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match=r"dppo_mask_direction must be one of \('advantage', 'symmetric'\)"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mask_direction="both", use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_kl_tau must be a finite number >= 0"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_kl_tau=-1.0, use_cpu=True)


@pytest.mark.parametrize("fused", (True, False), ids=("fused_linear", "logits"))
def test_sequence_mask_reaches_the_loss(tiny_model, tmp_path, fused):
    """dppo_sequence_mask is the API's sequence_mask with each completion one sequence: the loss equals dppo_loss
    on the model's logits with the same SequenceMask (rows [B, T]: one sequence per completion) and differs from
    the loss without it; a bound between the completions' mean k1 drops some and keeps the others."""
    plain = make_trainer(tiny_model, tmp_path / "plain", dppo_fused_linear=fused, bf16=False)
    inputs = _fixed_batch(plain)
    plain.model.eval()
    loss_plain = plain._compute_loss(plain.model, inputs)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = plain.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
    mask = inputs["completion_mask"].bool()
    old = inputs["old_per_token_logps"]
    logp = torch.log_softmax(logits.double(), -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    k1_mean = ((old.double() - logp) * mask).sum(1) / mask.sum(1)
    high = float(k1_mean.sort().values[:2].mean())  # between the smallest two: drops two of the three
    sequence_mask = dppo_ext.SequenceMask("k1", "mean", high=high)
    trainer = make_trainer(
        tiny_model, tmp_path / "masked", dppo_fused_linear=fused, bf16=False, dppo_sequence_mask=sequence_mask
    )
    assert trainer.args.dppo_sequence_mask == sequence_mask.to_config()  # stored as the dict (JSON-able)
    trainer.model.eval()
    loss = trainer._compute_loss(trainer.model, inputs)
    want, metrics = dppo_ext.dppo_loss(
        logits,
        inputs["completion_ids"].masked_fill(~mask, -100),
        torch.where(mask, old, torch.zeros_like(old)),
        inputs["advantages"][:, None].expand(3, 6).contiguous(),
        response_mask=mask,
        sequence_mask=sequence_mask,
    )
    assert metrics["seq_masked_frac"] == pytest.approx(2 / 3)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    assert not torch.allclose(loss, loss_plain), "the sequence mask must change this batch's loss"


@pytest.mark.parametrize(
    "value, match",
    [
        ("k1", r"dppo_sequence_mask must be None, a dppo_ext.SequenceMask, .* got the string 'k1'"),
        ({"statistic": "k1", "reduce": "sum"}, r"dppo_sequence_mask: SequenceMask needs a bound"),
        ({"statistic": "k4", "reduce": "sum", "high": 1.0}, r"dppo_sequence_mask: SequenceMask statistic must be"),
        ({"statistic": "k1", "reduce": "sum", "cap": 3.0}, r"dppo_sequence_mask takes the fields .*unknown \['cap'\]"),
        ({"reduce": "sum", "high": 1.0}, r"dppo_sequence_mask takes the fields .*statistic and reduce required"),
        (3.0, r"dppo_sequence_mask must be None, a dppo_ext.SequenceMask or a dict .* got 3.0 \(float\)"),
    ],
)
def test_config_refuses_bad_sequence_masks(tmp_path, value, match):
    with pytest.raises(ValueError, match=match):
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_sequence_mask=value)


def test_config_sequence_mask_forms_and_trls_off_policy_threshold(tmp_path):
    """A SequenceMask, its dict and its JSON are one setting, stored as the dict; TRL's off_policy_mask_threshold is
    refused with the dppo_sequence_mask that gives the same mask."""
    mask = dppo_ext.SequenceMask.from_trl("sequence_mask", None, 3.0)
    for value in (mask, mask.to_config(), json.dumps(mask.to_config())):
        args = DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_sequence_mask=value)
        assert args.dppo_sequence_mask == mask.to_config()
        json.dumps(args.to_dict())  # TRL / transformers serialise the config
    with pytest.raises(ValueError, match=r"dppo_sequence_mask=dppo_ext.SequenceMask.off_policy\(0.5\).to_config\(\)"):
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, off_policy_mask_threshold=0.5)


def test_aggregation_modes(tiny_model, tmp_path):
    """Every dppo_loss_agg_mode on a fixed batch against the reference formulas (the -norm modes divide by
    max_completion_length, as TRL's dr_grpo); in training with 2 accumulation steps the means are split across
    the steps and the sums are not (the optimizer step's gradient is the sum of its micro-batches')."""
    trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=True, temperature=0.9, bf16=False)
    inputs = _fixed_batch(trainer)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
    mask = inputs["completion_mask"].bool()
    low, high = DEFAULT_DELTAS["binary_tv"]
    ref = dppo_loss_reference(
        logits.reshape(18, -1).double(),
        inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        inputs["old_per_token_logps"].reshape(-1).double(),
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        mode="binary_tv",
        temperature=0.9,
        delta_low=low,
        delta_high=high,
        ratio_cap=10.0,
    )["loss"].reshape(3, 6)
    trainer.current_gradient_accumulation_steps = 2
    for agg in AGG_MODES:
        trainer.args.dppo_loss_agg_mode = agg
        horizon = 6.0 if agg.endswith("-norm") else None
        want = aggregate_loss_reference(ref, mask, agg, horizon)
        trainer.model.eval()
        torch.testing.assert_close(
            trainer._compute_loss(trainer.model, inputs).double(),
            want,
            rtol=1e-4,
            atol=1e-6,
            msg=lambda m, agg=agg: f"{agg} (eval): {m}",
        )
        trainer.model.train()
        split = 1.0 if agg in ("token-sum", "token-sum-norm") else 2.0
        if agg == "token-mean":  # the generation batch's tokens, one accumulation window of steps_per_generation
            split = 2.0 / trainer.args.steps_per_generation
        with torch.no_grad():
            got = trainer._compute_loss(trainer.model, inputs).double()
        torch.testing.assert_close(
            got, want / split, rtol=1e-4, atol=1e-6, msg=lambda m, agg=agg: f"{agg} (train): {m}"
        )


def test_bf16_autocast_fused_head_matches_logits_head(tiny_model, tmp_path):
    """Under TRL's bf16 autocast (bf16=True, TRL's default on a GPU) the fused head runs in bf16 like the autocast
    LM head does."""
    losses = {}
    for fused in (True, False):
        trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=fused, bf16=True)
        assert trainer.accelerator.mixed_precision == "bf16"
        trainer.model.eval()
        losses[fused] = trainer._compute_loss(trainer.model, _fixed_batch(trainer)).item()
    assert math.isclose(losses[True], losses[False], rel_tol=2e-3), losses


def test_vllm_logprobs_anchor_and_nan_fallback(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path)
    mask = torch.tensor([[True, True, True, False]])
    sampling = torch.tensor([[-0.5, float("nan"), -2.0, 0.0]])
    old = torch.tensor([[-0.7, -1.1, -2.2, -9.0]])
    rollout, new_mask, recompute = trainer._dppo_rollout(
        {"sampling_per_token_logps": sampling, "old_per_token_logps": old}, mask
    )
    assert not recompute and torch.equal(new_mask, mask)
    assert torch.equal(rollout[mask], torch.tensor([-0.5, -1.1, -2.0]))
    rollout, new_mask, _ = trainer._dppo_rollout({"sampling_per_token_logps": sampling}, mask)
    assert new_mask.tolist() == [[True, False, True, False]], "unscored token without old log-prob leaves the loss"
    rollout, _, recompute = trainer._dppo_rollout({"old_per_token_logps": old}, mask)
    assert recompute and torch.equal(rollout, old)


def test_split_vllm_logprobs():
    # position 0: sampled token 7 is in the top-2; position 1: sampled 9 is outside, vLLM appends it third.
    sampled, ids, lps = split_vllm_logprobs([[7, 9]], [[[-0.1, -2.5], [-0.3, None, -4.0]]], [[[3, 7], [5, 6, 9]]], k=2)
    assert sampled == [[-2.5, -4.0]]
    # the sampled token replaces the lowest-ranked entry, as in the reference trainer's vLLM engine
    assert ids == [[[3, 7], [5, 9]]]
    assert lps == [[[-0.1, -2.5], [-0.3, -4.0]]]
    _, _, lps = split_vllm_logprobs([[7]], [[[None, -2.5, -3.0]]], [[[3, 7, 8]]], k=3)
    assert lps == [[[-math.inf, -2.5, -3.0]]]
    with pytest.raises(ValueError, match=r"no log-prob for the sampled token 4"):
        split_vllm_logprobs([[4]], [[[-0.1]]], [[[3]]], k=1)
    with pytest.raises(ValueError, match=r"returned 1 log-prob entries at position 0, fewer than top_k=2"):
        split_vllm_logprobs([[3]], [[[-0.1]]], [[[3]]], k=2)


@pytest.mark.parametrize("mode", ("topk_tv", "topk_kl"))
def test_topk_loss_matches_reference(tiny_model, tmp_path, mode):
    """The top-K inputs flow from the batch through the patched forward into the op."""
    # A top-K config needs vLLM, which these CPU tests do not start: install the top-K head on the same model.
    # (Built before the trainer: building a TrainingArguments resets accelerate's state.)
    topk_args = DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, dppo_chunk_size=4)
    topk_args.dppo_mode = mode
    trainer = make_trainer(tiny_model, tmp_path, bf16=False, temperature=0.9, dppo_chunk_size=4)
    add_dppo_head(trainer.model, topk_args, 0.9)
    inputs = _fixed_batch(trainer)
    g = torch.Generator().manual_seed(3)
    vocab = trainer.model.config.vocab_size
    rollout = torch.log_softmax(torch.randn(3, 6, vocab, generator=g) * 2, -1)
    topk_logprobs, topk_ids = rollout.topk(3, dim=-1)
    inputs["dppo_topk_ids"], inputs["dppo_topk_logprobs"] = topk_ids, topk_logprobs
    inputs["old_per_token_logps"] = rollout.gather(2, inputs["completion_ids"][..., None]).squeeze(-1)
    trainer.model.eval()
    loss = trainer._compute_loss(trainer.model, inputs)

    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logits = trainer.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -7:-1]
    mask = inputs["completion_mask"].bool()
    low, high = DEFAULT_DELTAS[mode]
    ref = dppo_loss_reference(
        logits.reshape(18, -1).double(),
        inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        inputs["old_per_token_logps"].reshape(-1).double(),
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        topk_ids=topk_ids.reshape(18, 3),
        topk_logprobs=topk_logprobs.reshape(18, 3).double(),
        mode=mode,
        temperature=0.9,
        delta_low=low,
        delta_high=high,
        ratio_cap=10.0,
    )
    torch.testing.assert_close(loss.double(), ref["loss"].sum() / mask.sum(), rtol=1e-4, atol=1e-6)
    assert trainer._metrics["eval"]["dppo/divergence_mean"][-1] > 0


def test_config_errors(tmp_path, tiny_model):
    with pytest.raises(
        ValueError,
        match=r"dppo_mode='topk_tv' needs the rollout's top-K log-probs: set "
        r"use_vllm=True and dppo_topk=K >= 1 \(got use_vllm=False, dppo_topk=0\)",
    ):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="topk_tv", use_cpu=True)
    with pytest.raises(
        ValueError,
        match=r"dppo_topk \(K, the rollout top-K log-probs per token\) must be an int >= 0, "
        r"got -1",
    ):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_topk=-1, use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_mode must be one of .*got 'tv'"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="tv", use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_loss_agg_mode must be one of"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_loss_agg_mode="sum", use_cpu=True)
    with pytest.raises(ValueError, match=r"divides by max_completion_length, which must be a positive int, got None"):
        DPPOGRPOConfig(
            output_dir=str(tmp_path), dppo_loss_agg_mode="token-sum-norm", max_completion_length=None, use_cpu=True
        )
    with pytest.raises(ValueError, match=r"dppo_delta_low must be a finite number >= 0 or None .*got -0.1"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_delta_low=-0.1, use_cpu=True)
    for gib in (0, -1.0, math.nan, math.inf, True, "1"):
        with pytest.raises(
            ValueError,
            match=rf"dppo_vllm_kv_cache_gib must be a finite number of GiB > 0 or None "
            rf"\(vLLM's sizing\), got {re.escape(repr(gib))}",
        ):
            DPPOGRPOConfig(output_dir=str(tmp_path), dppo_vllm_kv_cache_gib=gib, use_cpu=True)
    with pytest.raises(ValueError, match=r"does not combine DPPO with TRL's \['entropy_coef'\]"):
        make_trainer(tiny_model, tmp_path, entropy_coef=0.01)
    from trl import GRPOConfig

    with pytest.raises(TypeError, match=r"needs args=DPPOGRPOConfig\(\.\.\.\), got GRPOConfig"):
        DPPOGRPOTrainer(
            model=tiny_model, reward_funcs=count_ones, args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True)
        )
    assert (
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="binary_kl", use_cpu=True).dppo_deltas
        == DEFAULT_DELTAS["binary_kl"]
    )
    verl_named = DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="dppo_kl", use_cpu=True)  # verl's name
    assert verl_named.dppo_mode == "binary_kl" and verl_named.dppo_deltas == DEFAULT_DELTAS["binary_kl"]


def test_trl_loss_fields(tmp_path):
    """TRL's loss_type picks the aggregation where it is one; its ratio clips are an error, never silently ignored."""

    def config(**kw):
        return DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kw)

    assert config().dppo_loss_agg_mode == "token-mean"  # TRL's default loss_type "dapo"
    assert config(loss_type="grpo").dppo_loss_agg_mode == "seq-mean-token-mean"
    assert config(loss_type="dr_grpo").dppo_loss_agg_mode == "seq-mean-token-sum-norm"
    assert config(dppo_loss_agg_mode="token-sum").dppo_loss_agg_mode == "token-sum"
    with pytest.raises(ValueError, match=r"loss_type='cispo' is a TRL loss formula of its own.*set dppo_loss_agg_mode"):
        config(loss_type="cispo")
    with pytest.raises(ValueError, match=r"set either loss_type \(TRL's name\) or dppo_loss_agg_mode, not both"):
        config(loss_type="grpo", dppo_loss_agg_mode="token-mean")
    for field, value in (("epsilon_high", 0.28), ("epsilon", 0.1), ("delta", 2.0)):
        with pytest.raises(
            ValueError,
            match=rf"does not read TRL's ratio-clip fields \{{'{field}': {value}\}}.*"
            r"Set dppo_delta_low / dppo_delta_high",
        ):
            config(**{field: value})


def test_unsupported_trl_version_is_a_clear_error():
    check_trl_version("1.16.0")
    for version in ("1.15.0", "1.17.0", "0.19.1"):
        with pytest.raises(
            ImportError, match=rf"supports trl.*but trl {version} is installed.*pip install 'trl==1\.16\.0'"
        ):
            check_trl_version(version)


def _vllm_logprob_error(llm, model, prompt_ids: list[list[int]], temperature: float) -> float:
    """Largest |vLLM log-prob - model log-prob| over the sampled tokens of fresh vLLM rollouts of ``prompt_ids``."""
    from vllm import SamplingParams

    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompt_ids],
        SamplingParams(n=4, temperature=temperature, max_tokens=6, logprobs=0, seed=1),
        use_tqdm=False,
    )
    worst = 0.0
    for request in outputs:
        for c in request.outputs:
            ids = torch.tensor([list(request.prompt_token_ids) + list(c.token_ids)])
            with torch.no_grad():
                logits = model(ids).logits[0, len(request.prompt_token_ids) - 1 : -1].float()
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            got = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)])
            worst = max(worst, (ref - got).abs().max().item())
    return worst


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_colocate_topk_trains_with_weight_sync(tiny_model, tmp_path, monkeypatch):
    """Six TRL steps with colocated vLLM (float32) generating for topk_tv: the weights are pushed into vLLM before
    every generation, so the first forward of each step (before its update) sees |pi - mu| at rounding level
    although the weights move every step; vLLM's top-K reaches the loss; after a final push, vLLM scores tokens
    as the trained model does and not as the initial one. The engine gets the dtype and KV-cache size the config
    asks for, and starting it shows no TRL warning about the tested vLLM release."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    # TRL's colocate mode sets the torch.distributed variables in os.environ: restore them afterwards.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    # vLLM's CPU backend lets this variable override the engine's KV-cache size; the config's size must win (and
    # the variable come back): it is set whenever the reference trainer's engine ran earlier in the process.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    steps = 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(
            tiny_model,
            tmp_path,
            max_steps=steps,
            dppo_mode="topk_tv",
            dppo_topk=3,
            use_vllm=True,
            vllm_mode="colocate",
            dppo_vllm_dtype="float32",
            bf16=False,
            dppo_vllm_kv_cache_gib=0.25,
            learning_rate=3e-2,
            temperature=1.3,
        )
    engine_config = trainer.vllm_generation.llm.llm_engine.vllm_config
    assert engine_config.model_config.dtype == torch.float32
    assert engine_config.cache_config.kv_cache_memory_bytes == 2**28, "dppo_vllm_kv_cache_gib reaches vLLM"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert not [w for w in caught if "TRL currently supports vLLM" in str(w.message)], "TRL's check at engine start"
    seen, snapshots = [], []
    generate = trainer._generate_and_score_completions

    def record(inputs):
        out = generate(inputs)
        seen.append(out)
        snapshots.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        return out

    trainer._generate_and_score_completions = record
    trainer.train()

    steps_logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps_logged) == steps and len(seen) == steps
    mismatch = [h["dppo/mismatch_max"] for h in steps_logged]
    logging.getLogger(__name__).info("TRL + colocated vLLM, max |pi - mu| per step after each sync: %s", mismatch)
    assert max(mismatch) < 1e-5, f"|pi - mu| after each weight sync: {mismatch}"
    moved = [
        max((snapshots[i + 1][n] - snapshots[i][n]).abs().max().item() for n in snapshots[i]) for i in range(steps - 1)
    ]
    assert sum(m > 0 for m in moved) >= 3, f"the weights must change between generations: {moved}"
    for h in steps_logged:
        assert h["dppo/recompute_variant"] == 0.0 and math.isfinite(h["loss"])
    for out in seen:
        valid = out["completion_mask"].bool()
        top = out["dppo_topk_logprobs"]
        assert out["dppo_topk_ids"].shape == (*out["completion_ids"].shape, 3)
        in_row = (out["dppo_topk_ids"] == out["completion_ids"][..., None]).any(-1)
        assert in_row[valid].all(), "the sampled token is in every top-K row"
        assert (top[..., :-1] >= top[..., 1:])[valid].all()

    trainer.vllm_generation.sync_weights()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    prompts = [trainer.processing_class(p)["input_ids"] for p in ("1+2=", "7+8=")]
    llm = trainer.vllm_generation.llm
    assert _vllm_logprob_error(llm, trainer.model.eval(), prompts, 1.3) < 1e-5
    assert _vllm_logprob_error(llm, initial, prompts, 1.3) > 1e-2
    trainer = generate = llm = None  # the engine goes before the process group
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_models_with_logit_transforms_are_rejected(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=17,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    )
    config.final_logit_softcapping = 30.0
    args = DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"transform the LM head's logits .*'final_logit_softcapping': 30.0"):
        add_dppo_head(LlamaForCausalLM(config), args, 1.0)


def test_models_with_logit_transforms_are_refused_before_vllm_starts(tmp_path, monkeypatch):
    """Issue 38 row 8: a Gemma2 model was refused only after TRL had started vLLM (81 s on a 2-core CPU)."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        vocab_size=17,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    )
    assert config.final_logit_softcapping == 30.0  # Gemma2's default
    model_dir = tmp_path / "gemma2"
    config.save_pretrained(model_dir)  # the config is all the check may read: no weights, no engine

    def engine_start(*args, **kwargs):
        raise AssertionError("GRPOTrainer.__init__ (which starts vLLM) ran before the model was refused")

    monkeypatch.setattr(dppo_trl.trainer.GRPOTrainer, "__init__", engine_start)
    args = DPPOGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, use_vllm=True, vllm_mode="colocate")
    with pytest.raises(ValueError, match=r"transform the LM head's logits .*'final_logit_softcapping': 30.0"):
        DPPOGRPOTrainer(str(model_dir), reward_funcs=lambda **kw: [0.0], args=args)


def _run_python(code: str, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that imports dppo_ext as this process does."""
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=str(cwd),
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


@pytest.mark.slow
def test_package_import_has_no_side_effects(tmp_path):
    """``import dppo_ext.integrations.trl`` imports none of TRL, transformers, accelerate or vLLM and changes no
    warning filter or logger; each public name loads only what it needs (the config TRL, not vLLM)."""
    code = textwrap.dedent("""
        import json, logging, sys, warnings
        heavy = ("trl", "transformers", "accelerate", "vllm")
        loaded = lambda: [m for m in heavy if m in sys.modules]
        import torch, dppo_ext  # what the package needs anyway
        filters, loggers = list(warnings.filters), dict(logging.root.manager.loggerDict)
        import dppo_ext.integrations.trl as t
        out = {"import": loaded(), "filters": warnings.filters == filters,
               "loggers": sorted(set(logging.root.manager.loggerDict) - set(loggers))}
        t.split_vllm_logprobs, t.check_trl_version, t.SUPPORTED_TRL
        out["split_vllm_logprobs"] = loaded()
        t.DPPOGRPOConfig
        out["DPPOGRPOConfig"] = loaded()
        print(json.dumps(out))
    """)
    out = json.loads(_run_python(code, tmp_path).stdout.strip().splitlines()[-1])
    assert out["import"] == [] and out["filters"], out
    assert all(not name.startswith(("trl", "vllm", "transformers")) for name in out["loggers"]), out
    assert out["split_vllm_logprobs"] == [], out
    assert "trl" in out["DPPOGRPOConfig"] and "vllm" not in out["DPPOGRPOConfig"], out


def test_public_names_keep_their_import_path():
    """Every public name of the former single module imports from ``dppo_ext.integrations.trl`` and is the object
    its module defines; ``__all__`` and ``dir()`` list them; an unknown name is an AttributeError."""
    import importlib

    for name, module in PUBLIC_NAMES.items():
        defined = getattr(importlib.import_module(f"dppo_ext.integrations.trl.{module}"), name)
        assert getattr(dppo_trl, name) is defined, name
        namespace: dict = {}
        exec(f"from dppo_ext.integrations.trl import {name}", namespace)
        assert namespace[name] is defined, name
    assert set(PUBLIC_NAMES) == set(dppo_trl.__all__)
    assert set(PUBLIC_NAMES) <= set(dir(dppo_trl))
    with pytest.raises(AttributeError, match=r"module 'dppo_ext.integrations.trl' has no attribute 'GRPOTrainer'"):
        _ = dppo_trl.GRPOTrainer


@pytest.mark.slow
def test_no_vllm_version_warning_for_the_pinned_vllm(tmp_path):
    """Importing the trainer (TRL's trainer imports its vLLM modules, which check vLLM's version five times) shows
    none of TRL's "supports vLLM 0.22-0.31" warnings for the vLLM release we test with, and leaves no filter
    behind: TRL's own check afterwards still warns, and inside our block another version still warns."""
    pytest.importorskip("vllm")
    code = textwrap.dedent("""
        import warnings
        from dppo_ext.integrations.trl import DPPOGRPOTrainer
        from dppo_ext.integrations.trl.versions import tested_vllm_warning_silenced
        from trl.import_utils import is_vllm_available
        print("LEFT", sum("TRL currently" in str(f[1]) for f in warnings.filters))
        is_vllm_available()
        with tested_vllm_warning_silenced():
            warnings.warn("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have version 0.33.0 "
                          "installed.", UserWarning)
    """)
    out = _run_python(code, tmp_path)
    assert "LEFT 0" in out.stdout, out.stdout
    assert "You have version 0.33.0" in out.stderr, "other vLLM versions must still warn"
    ours = f"You have version {dppo_trl.TESTED_VLLM}"
    shown = [line for line in out.stderr.splitlines() if ours in line]
    assert len(shown) == 1 and shown[0].startswith("<string>:"), out.stderr[-3000:]  # TRL's own check only


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("dppo_delta_low", math.nan, r"dppo_delta_low must be a finite number >= 0 or None .*got nan"),
        ("dppo_delta_high", math.nan, r"dppo_delta_high must be a finite number >= 0 or None .*got nan"),
        ("dppo_delta_high", math.inf, r"dppo_delta_high must be a finite number >= 0 or None .*got inf"),
        ("dppo_ratio_cap", math.nan, r"dppo_ratio_cap must be a number > 0, got nan"),
    ],
)
def test_config_rejects_nonfinite_thresholds(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("dppo_topk", 2.5, r"dppo_topk \(K, the rollout top-K log-probs per token\) must be an int >= 0, got 2.5"),
        ("dppo_topk", True, r"dppo_topk \(K, .*\) must be an int >= 0, got True"),
        ("dppo_topk", None, r"dppo_topk \(K, .*\) must be an int >= 0, got None"),
        (
            "dppo_chunk_size",
            2.5,
            r"dppo_chunk_size \(rows per fused-linear chunk\) must be an int >= 1 or None "
            r"\(automatic\), got 2.5",
        ),
        ("dppo_chunk_size", "64", r"dppo_chunk_size \(rows per fused-linear chunk\) must be an int >= 1 .*got '64'"),
        ("dppo_chunk_size", 64.0, r"dppo_chunk_size .* must be an int >= 1 .*got 64.0"),
        ("dppo_chunk_size", 0, r"dppo_chunk_size .* must be an int >= 1 .*got 0"),
        ("dppo_fused_linear", "False", r"dppo_fused_linear must be True or False, got 'False'"),
        ("dppo_sync_check", "False", r"dppo_sync_check must be True or False, got 'False'"),
        ("dppo_sync_check", 0, r"dppo_sync_check must be True or False, got 0"),
        ("dppo_sync_check", None, r"dppo_sync_check must be True or False, got None"),
        (
            "dppo_vllm_dtype",
            "fp32",
            r"dppo_vllm_dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), "
            r"got 'fp32'",
        ),
        ("dppo_vllm_dtype", ["float32"], r"dppo_vllm_dtype must be one of .*got \['float32'\]"),
        (
            "dppo_vllm_kv_cache_gib",
            1e-12,
            r"dppo_vllm_kv_cache_gib=1e-12 is 0.00107\d* bytes, which vLLM's whole-byte "
            r"size rounds down to 0 \(no KV cache at all\)",
        ),
        ("dppo_mode", 3, r"dppo_mode must be one of .*got 3"),
        ("dppo_ratio_cap", "10", r"dppo_ratio_cap must be a number > 0, got '10'"),
        ("dppo_delta_low", "0.1", r"dppo_delta_low must be a finite number >= 0 or None .*got '0.1'"),
        ("dppo_loss_agg_mode", 1, r"dppo_loss_agg_mode must be one of .*got 1"),
    ],
)
def test_config_refuses_wrong_types_at_construction(tmp_path, field, value, match):
    """Every dppo_* field is checked when the config is built, naming the field, what it got and what it takes:
    never truncated (2.5 -> 2), never a KV cache of 0 bytes, never an error only at the first loss call."""
    with pytest.raises(ValueError, match=match):
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **{field: value})


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(top_p=0.9), r"top_p=0.9 truncates the sampling distribution"),
        (dict(top_k=5), r"top_k=5 truncates the sampling distribution"),
        (dict(min_p=0.05), r"min_p=0.05 truncates the sampling distribution"),
        (dict(top_p=0.9, top_k=5, min_p=0.05, use_vllm=True), r"top_k=5, top_p=0.9, min_p=0.05 truncates"),
        (dict(generation_kwargs={"top_p": 0.8}), r"generation_kwargs\['top_p'\]=0.8 truncates"),
        (dict(top_p=1.5), r"top_p must be a number in \(0, 1\]"),
    ],
)
def test_config_refuses_truncated_sampling_with_the_fix(tmp_path, settings, match):
    """TRL samples with top_p / top_k / min_p; the DPPO loss scores pi over the whole vocabulary, so truncation
    is refused when the config is built, naming the setting, its value and the fix."""
    with pytest.raises(ValueError, match=match) as caught:
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **settings)
    if "truncates" in match:
        assert "top_p=1.0, top_k=0 and min_p=None (GRPOConfig's defaults)" in str(caught.value)
    DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, top_p=1.0, top_k=0, min_p=0.0)  # untruncated: accepted


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(dppo_logits_dtype="fp32"), r"dppo_logits_dtype must be None \(the model's dtype\) or 'float32'"),
        (dict(dppo_logits_dtype=torch.float32), r"dppo_logits_dtype must be None .*got torch.float32"),
        (
            dict(dppo_logits_dtype="float32", dppo_fused_linear=False),
            r"dppo_logits_dtype='float32' .* needs dppo_fused_linear=True",
        ),
    ],
)
def test_config_logits_dtype(tmp_path, settings, match):
    with pytest.raises(ValueError, match=match):
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, **settings)
    assert DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_logits_dtype="float32").dppo_logits_dtype


def test_config_kv_cache_bytes(tmp_path):
    """The KV-cache size the colocated engine gets, in whole bytes; the smallest accepted size is one byte."""
    assert (
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_vllm_kv_cache_gib=0.5).dppo_vllm_kv_cache_bytes
        == 2**29
    )
    assert DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True).dppo_vllm_kv_cache_bytes is None
    assert (
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_vllm_kv_cache_gib=2.0**-30).dppo_vllm_kv_cache_bytes
        == 1
    )


def test_bf16_default_is_float32_on_cpu(tmp_path, monkeypatch):
    """TRL's bf16 default (True unless fp16) would autocast a CPU trainer next to a float32 engine (pi/mu mismatch
    1e-4..3e-2, docs/trl.md): the DPPO config leaves bf16 off where the trainer runs on the CPU, follows TRL's rule
    on an accelerator, and keeps an explicit choice."""

    def config(**kw):
        return DPPOGRPOConfig(output_dir=str(tmp_path), **kw)

    assert config(use_cpu=True).bf16 is False
    assert config(use_cpu=True, bf16=True).bf16 is True
    if not torch.accelerator.is_available():
        assert config().bf16 is False  # no use_cpu needed on a CPU-only machine (TRL's True would stop here)
    if torch.cuda.is_available():
        assert config().bf16 is True and config(fp16=True).bf16 is False
        return
    from dppo_ext.integrations.trl import config as config_module

    # as on a GPU machine: TRL's bf16=True reaches transformers, whose own check then refuses it on this one
    monkeypatch.setattr(config_module, "_trains_on_cpu", lambda use_cpu: use_cpu)
    with pytest.raises(ValueError, match=r"bf16"):
        config()


def test_config_warns_about_trl_loss_fields_it_ignores(tmp_path):
    """Fields of TRL's own losses that DPPO does not read (loss_type and the ratio clips: test_trl_loss_fields)."""
    with pytest.warns(
        UserWarning,
        match=r"ignores TRL's own loss settings \{'importance_sampling_level': 'sequence', "
        r"'sapo_temperature_neg': 2.0, 'vllm_importance_sampling_clip_max': 5.0\}",
    ):
        DPPOGRPOConfig(
            output_dir=str(tmp_path),
            use_cpu=True,
            importance_sampling_level="sequence",
            sapo_temperature_neg=2.0,
            vllm_importance_sampling_clip_max=5.0,
        )
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True, dppo_mode="ratio", dppo_delta_high=0.3, loss_type="grpo")
    # TRL's defaults (and the DPPO fields) make DPPO warn about nothing. Other libraries may warn
    # about the environment here (accelerate: OMP_NUM_THREADS unset, the first time it starts).
    ours = [str(w.message) for w in caught if "dppo" in w.filename.lower() or "loss settings" in str(w.message)]
    assert not ours, ours


def test_add_dppo_head_rejects_a_model_without_lm_head(tmp_path):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        vocab_size=17,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    )
    args = DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(
        ValueError,
        match=r"add_dppo_head needs a causal LM with an LM head .*got LlamaModel.*"
        r"AutoModelForCausalLM",
    ):
        add_dppo_head(LlamaModel(config), args, 1.0)


def _doc_snippet() -> str:
    """The ```python block of docs/trl.md whose docs-test marker names the test below, exactly as written."""
    lines = (ROOT / "docs" / "trl.md").read_text().splitlines()
    starts = [
        i
        for i, line in enumerate(lines)
        if line.strip() == "```python" and "test_doc_snippet_runs_as_written" in lines[i - 1]
    ]
    assert len(starts) == 1, "docs/trl.md: expected one snippet marked for test_doc_snippet_runs_as_written"
    end = lines.index("```", starts[0] + 1)
    return "\n".join(lines[starts[0] + 1 : end])


@pytest.mark.vllm
@pytest.mark.slow
def test_doc_snippet_runs_as_written(tmp_path):
    """docs/trl.md's "in your own script" snippet, verbatim, in a fresh process on this CPU machine: it trains
    with colocated vLLM, and |pi - mu| after each weight sync is at float32 rounding level, as the doc says for its
    precision settings (trainer and engine in float32)."""
    pytest.importorskip("vllm")
    snippet = _doc_snippet()
    code = snippet + "\nimport json\nprint('LOG_HISTORY', json.dumps(trainer.state.log_history))\n"
    out = _run_python(code, tmp_path)
    history = json.loads(out.stdout.split("LOG_HISTORY", 1)[1])
    steps = [h for h in history if "dppo/mismatch_max" in h]
    assert len(steps) == 3 and all(math.isfinite(h["loss"]) for h in steps), history
    mismatch = [h["dppo/mismatch_max"] for h in steps]
    assert max(mismatch) < 1e-5, f"|pi - mu| after each weight sync: {mismatch}"


def _run_example(tmp_path: Path, *flags: str) -> tuple[dict, list[str]]:
    """examples/trl_dppo_grpo.py as a user runs it, in a process of its own: (its JSON summary, its step lines)."""
    summary = tmp_path / "summary.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "trl_dppo_grpo.py"),
            *flags,
            "--summary",
            str(summary),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=900,
        cwd=str(tmp_path),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(summary.read_text()), [line for line in out.stdout.splitlines() if line.startswith("step ")]


@pytest.mark.vllm
@pytest.mark.slow
def test_example_learns(tmp_path):
    """The example, shortened by its flags, with colocated vLLM rollouts: the held-out accuracy and the training
    reward rise, and |pi - mu| stays at float32 rounding level (the weights are pushed before every generation)."""
    pytest.importorskip("vllm")
    summary, steps = _run_example(tmp_path, *EXAMPLE_TEST_FLAGS)
    assert len(steps) == summary["steps"] == int(EXAMPLE_TEST_FLAGS[1])
    assert all("recompute_variant 0" in line for line in steps), steps
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
    assert summary["reward_last"] > summary["reward_first"], summary
    assert summary["mismatch_max"] < 1e-5, summary


@pytest.mark.slow
def test_example_script_runs_without_vllm(tmp_path):
    """``examples/trl_dppo_grpo.py --no-vllm`` runs, prints one line per step with the recompute variant flagged
    and reports both accuracies."""
    summary, steps = _run_example(
        tmp_path, "--no-vllm", "--steps", "2", "--warm-start-steps", "5", "--eval-problems", "8"
    )
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"], steps
    assert all("recompute_variant 1" in line for line in steps), steps
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0, summary

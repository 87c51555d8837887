"""verl's own FSDP2 engine trains a tiny local model with the plugin's loss modes (CPU, one gloo process).

The engine is verl's ``FSDPEngineWithLMHead`` built from verl's composed ``ppo_trainer`` config with a user's
overrides (verl_cpu.py lists the test-only setup: a CPU ``PlatformBase`` installed with verl's ``set_platform``,
the engine class built directly, sdpa attention; verl's code is not edited). For both of verl's layouts
(``use_remove_padding`` True: packed, padding-free; False: padded ``[B, S, V]`` logits), a batch of sequences with
different prompt and response lengths, two micro-batches and temperature 0.7:

* the top-K modes' gradients equal those of an independent reference: the same weights in a plain transformers
  model, full float32 log-softmax, the fork's top-K divergence against the rollout's mu and top-K, token-mean over
  the mini-batch;
* ``dppo_tv`` through the plugin gives verl's own ``dppo_tv`` gradients (the same engine, verl's ``ppo_loss``);
* ``train_batch`` (forward, in-place backward, optimizer step) runs and reports verl's metric names and the
  plugin's ``actor/dppo_*`` diagnostics.

The top-K cases run on the batch as each of verl's trainers builds it: the legacy one (``DataProto``, the top-K in
``non_tensor_batch``) and V1, verl's default (the samples' TransferQueue fields from ``AgentLoopOutput.as_dict()``,
the top-K as nested per-token tensors).

Skipped when verl is not installed.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("verl")

import verl_cpu  # noqa: E402

verl_cpu.use_cpu_platform()  # before verl's engine modules read the device name

from torch.distributed.tensor import DTensor  # noqa: E402
from verl.workers.utils.losses import ppo_loss as verl_ppo_loss  # noqa: E402

import dppo_ext.integrations.verl.plugin  # noqa: E402,F401
from dppo_ext.integrations.verl import diagnostics as verl_diagnostics  # noqa: E402
from dppo_ext.integrations.verl import loss as vloss  # noqa: E402
from dppo_ext.integrations.verl.rollout import RolloutTopK  # noqa: E402
from dppo_ext.models.tiny import build_tiny_model  # noqa: E402

TEMPERATURE = 0.7
K = 3
SETTINGS = [
    "actor_rollout_ref.actor.clip_ratio_low=0.05",
    "actor_rollout_ref.actor.clip_ratio_high=0.05",
    "actor_rollout_ref.actor.clip_ratio_c=4.0",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    verl_cpu.init_process_group()
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def engines(model_dir):
    """One engine per layout, shared by the gradient tests (they never step the optimizer); the engine does not
    depend on the loss mode, the actor config passed with the loss function does."""
    return {
        flag: verl_cpu.build_actor(
            verl_cpu.compose(verl_cpu.actor_overrides(model_dir, "dppo_topk_tv", use_remove_padding=flag))
        )[0]
        for flag in (True, False)
    }


def actor_config(model_dir, mode, use_remove_padding):
    from verl.utils.config import omega_conf_to_dataclass

    config = verl_cpu.compose(
        verl_cpu.actor_overrides(model_dir, mode, use_remove_padding=use_remove_padding) + SETTINGS
    )
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def reference_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)


def rollout_batch(model_dir, seed: int = 0) -> verl_cpu.RolloutBatch:
    """Sequences whose mu and top-K come from the model's own distribution at T, perturbed so that the trust
    region masks some tokens and keeps others."""
    g = torch.Generator().manual_seed(seed)
    model = reference_model(model_dir)
    vocab = model.config.vocab_size
    B, P, R = 4, 4, 5
    prompt_lens, response_lens = [4, 2, 3, 4], [5, 3, 1, 4]
    prompts = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    rollout = torch.zeros(B, R)
    samples = []
    for b in range(B):
        prompt = torch.cat([torch.tensor([1]), torch.randint(4, vocab, (prompt_lens[b] - 1,), generator=g)])
        response = torch.randint(4, vocab, (response_lens[b],), generator=g)
        with torch.no_grad():
            logits = model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1] / TEMPERATURE
        log_p = torch.log_softmax(logits + 0.5 * torch.randn(logits.shape, generator=g), -1)  # "the sampler"
        top = log_p.topk(K, dim=-1)
        ids, lps = top.indices.clone(), top.values.clone()
        for t, token in enumerate(response.tolist()):
            if token not in ids[t]:
                ids[t, -1], lps[t, -1] = token, log_p[t, token]
        prompts[b, P - len(prompt) :] = prompt
        prompt_mask[b, P - len(prompt) :] = 1
        responses[b, : len(response)] = response
        response_mask[b, : len(response)] = 1
        rollout[b, : len(response)] = log_p.gather(-1, response[:, None]).squeeze(-1)
        samples.append(RolloutTopK(ids.numpy().astype("int32"), lps.numpy()))
    advantages = torch.tensor([[1.0], [-0.5], [0.8], [-1.2]]).expand(B, R) * response_mask
    # verl's recomputed old-policy log-probs, which the top-K modes must not use (their anchor is mu)
    old = (rollout + 0.3 * torch.randn(rollout.shape, generator=g)).clamp(max=0) * response_mask
    return verl_cpu.RolloutBatch(prompts, prompt_mask, responses, response_mask, rollout, old, advantages, samples)


def reference_grads(model_dir, batch: verl_cpu.RolloutBatch, mode: str, low: float, high: float, cap: float):
    """Gradients of the fork's top-K DPPO, token-mean over all response tokens, on a plain transformers model."""
    model = reference_model(model_dir)
    total = batch.response_mask.sum()
    loss = 0.0
    for b in range(len(batch.responses)):
        prompt = batch.prompts[b][batch.prompt_mask[b].bool()]
        n = int(batch.response_mask[b].sum())
        response = batch.responses[b, :n]
        log_q = torch.log_softmax(
            model(torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE, -1
        )
        logp = log_q.gather(-1, response[:, None]).squeeze(-1)
        mu_log = batch.rollout_log_probs[b, :n]
        ids = torch.from_numpy(batch.topk[b].ids).long()
        p_log = torch.from_numpy(batch.topk[b].logprobs)
        p, q_log = p_log.exp(), log_q.gather(-1, ids)
        q = q_log.exp()
        p_rest, q_rest = (1 - p.sum(-1)).clamp(min=1e-12), (1 - q.sum(-1)).clamp(min=1e-12)
        if mode == "dppo_topk_tv":
            div = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
        else:
            div = (p * (p_log - q_log)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
        adv = batch.advantages[b, :n]
        pi, mu = logp.exp(), mu_log.exp()
        masked = torch.where(adv > 0, (div > high) & (pi > mu), (div > low) & (pi < mu))
        weight = torch.exp((logp - mu_log).clamp(max=20)).clamp(max=cap).detach()
        loss = loss + (-adv * weight * (~masked).float() * logp).sum() / total
    loss.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def engine_grads(engine, data, loss_function):
    """The parameter gradients of one forward/backward of ``data`` (read inside the engine's train mode, whose exit
    drops them)."""
    grads = {}
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward_batch(data, loss_function, forward_only=False)
        for name, p in engine.module.named_parameters():
            assert p.grad is not None, f"no gradient reached {name}"
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()
    return grads


def batch_for_engine(batch, use_remove_padding: bool, trainer: str = "v0"):
    """The actor's batch as verl's legacy trainer (v0: ``DataProto``, top-K in ``non_tensor_batch``) or its V1
    trainer (TransferQueue fields of ``AgentLoopOutput.as_dict()``, top-K as nested tensors) builds it."""
    build = verl_cpu.actor_batch if trainer == "v0" else verl_cpu.v1_actor_batch
    data = build(batch, temperature=TEMPERATURE)
    return verl_cpu.train_flags(data, use_remove_padding=use_remove_padding, micro_batch_size=2)


@pytest.mark.parametrize("trainer", ["v0", "v1"])
@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["padding-free", "padded"])
@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl"])
def test_topk_gradients_match_the_reference(model_dir, engines, mode, use_remove_padding, trainer):
    batch = rollout_batch(model_dir)
    config = actor_config(model_dir, mode, use_remove_padding)
    grads = engine_grads(
        engines[use_remove_padding],
        batch_for_engine(batch, use_remove_padding, trainer),
        functools.partial(vloss.ppo_loss, config=config),
    )
    expected = reference_grads(model_dir, batch, mode, 0.05, 0.05, 4.0)
    assert set(grads) == set(expected)
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["padding-free", "padded"])
def test_binary_tv_through_the_plugin_equals_verls_own(model_dir, engines, use_remove_padding):
    engine = engines[use_remove_padding]
    batch = rollout_batch(model_dir, seed=1)
    config = actor_config(model_dir, "dppo_tv", use_remove_padding)
    ours = engine_grads(
        engine, batch_for_engine(batch, use_remove_padding), functools.partial(vloss.ppo_loss, config=config)
    )
    verls = engine_grads(
        engine, batch_for_engine(batch, use_remove_padding), functools.partial(verl_ppo_loss, config=config)
    )
    for name in verls:
        torch.testing.assert_close(ours[name], verls[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in ours.values())


@pytest.mark.parametrize("trainer", ["v0", "v1"])
def test_train_batch_steps_and_reports_verls_metrics(model_dir, trainer):
    config = verl_cpu.compose(
        verl_cpu.actor_overrides(model_dir, "dppo_topk_kl", use_remove_padding=True)
        + SETTINGS
        + ["actor_rollout_ref.actor.entropy_coeff=0.01"]
    )
    engine, actor_config = verl_cpu.build_actor(config)
    before = {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in engine.module.named_parameters()
    }
    build = verl_cpu.actor_batch if trainer == "v0" else verl_cpu.v1_actor_batch
    data = build(rollout_batch(model_dir), temperature=TEMPERATURE, calculate_entropy=True)
    data = verl_cpu.train_flags(data, use_remove_padding=True, micro_batch_size=2)
    with engine.train_mode():
        output = engine.train_batch(data, loss_function=functools.partial(vloss.ppo_loss, config=actor_config))
    metrics = output["metrics"]
    assert {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/pg_clipfrac_lower",
        "actor/entropy_loss",
        "grad_norm",
    } <= set(metrics)
    assert set(verl_diagnostics.DIAGNOSTICS) <= set(metrics)
    assert all(torch.isfinite(torch.tensor(v)) for v in output["loss"])
    moved = [
        n
        for n, p in engine.module.named_parameters()
        if not torch.equal((p.full_tensor() if isinstance(p, DTensor) else p).detach(), before[n])
    ]
    assert moved, "the optimizer step changed no weight"


def test_an_fp32_head_hands_the_loss_float32_products_of_a_bf16_model(model_dir, monkeypatch):
    """policy_loss.dppo_logits_dtype=float32 on a bf16 actor: the logits the plugin's loss receives are the LM head's
    float32 products (the model's bf16 ones without it), in the update as in a forward-only pass, the gradient
    reaches every weight, and the head is left as it was after each micro-batch."""
    from verl.utils.config import omega_conf_to_dataclass

    from dppo_ext.integrations.verl.config import DPPO_POLICY_LOSS_TARGET

    overrides = verl_cpu.actor_overrides(model_dir, "dppo_topk_tv", use_remove_padding=True, bf16=True) + SETTINGS
    overrides += [f"actor_rollout_ref.actor.policy_loss._target_={DPPO_POLICY_LOSS_TARGET}"]
    engine, _ = verl_cpu.build_actor(verl_cpu.compose(overrides))
    wide = ["+actor_rollout_ref.actor.policy_loss.dppo_logits_dtype=float32"]
    configs = {
        name: omega_conf_to_dataclass(verl_cpu.compose(overrides + extra).actor_rollout_ref.actor)
        for name, extra in (("model", []), ("float32", wide))
    }
    seen = []
    original = vloss.logits_outputs

    def spy(config, data, student_logits):
        seen.append(student_logits.detach().clone())
        return original(config, data, student_logits)

    monkeypatch.setattr(vloss, "logits_outputs", spy)
    batch = rollout_batch(model_dir)
    hooks = list(engine.module.get_output_embeddings()._forward_hooks)  # FSDP2's own
    logits, grads = {}, {}
    for name, config in configs.items():
        seen.clear()
        grads[name] = engine_grads(
            engine, batch_for_engine(batch, True), functools.partial(vloss.ppo_loss, config=config)
        )
        logits[name] = torch.cat([x.reshape(-1, x.shape[-1]) for x in seen])
        head = engine.module.get_output_embeddings()
        assert list(head._forward_hooks) == hooks and "forward" not in vars(head)  # the head as it was, after each
    plain, wide_logits = logits["model"], logits["float32"]
    assert wide_logits.dtype == torch.float32
    rounded = plain.float() * TEMPERATURE  # the head's bf16 products, before verl divides by the temperature
    assert torch.equal(rounded.bfloat16().float(), rounded) or plain.dtype == torch.bfloat16
    # the same products, no longer rounded to bf16: within half a bf16 step of the rounded ones, most not equal
    step = torch.finfo(torch.bfloat16).eps * plain.float().abs().clamp(min=1e-3)
    assert ((wide_logits - plain.float()).abs() <= step).all()
    assert (wide_logits != plain.float()).float().mean() > 0.5
    for name, grad in grads["float32"].items():
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name

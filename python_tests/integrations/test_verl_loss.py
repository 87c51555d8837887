"""The engine-side loss of the verl plugin (dppo_ext.integrations.verl.loss) on verl's own micro-batches.

Each case builds a batch the way verl's trainer hands it to the actor (``DataProto`` -> ``to_tensordict`` ->
``left_right_2_no_padding``, prompts and responses of different lengths, so both kinds of padding occur), gives
the loss packed ``[1, N, V]`` logits as verl's FSDP engine does, and checks:

* the top-K modes against the paper fork's formula written here independently (full float32 log-softmax, top-K
  TV / KL with the rest bucket, the rollout's mu as anchor, weight ``min(pi / mu, C)``), aggregated with verl's
  ``agg_loss`` in each of verl's modes, loss and logits gradient, with and without the in-place backward;
* ``dppo_tv`` / ``dppo_kl`` against verl's own ``compute_policy_loss_dppo_tv`` / ``_kl`` run through verl's
  ``ppo_loss`` on the same logits: loss, gradient and verl's metrics;
* entropy bonus and KL loss through the op's entropy and log-probs, and that no ``[N, V]`` float32 tensor is
  produced from bfloat16 logits.

Skipped when verl is not installed (CI installs it in its own venv, .ci/run).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

pytest.importorskip("verl")

import verl_cpu  # noqa: E402  (needs verl)
from dppo_testing import bf16_rounding_bound  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from verl.trainer.ppo.core_algos import agg_loss  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss as verl_ppo_loss  # noqa: E402

import dppo_ext  # noqa: E402
import dppo_ext.integrations.verl.plugin  # noqa: E402,F401  (installs the hooks, as verl's entry point does)
from dppo_ext.integrations.verl import diagnostics as verl_diagnostics  # noqa: E402
from dppo_ext.integrations.verl import loss as vloss  # noqa: E402
from dppo_ext.integrations.verl.config import VERL_MODES  # noqa: E402
from dppo_ext.integrations.verl.rollout import RolloutTopK  # noqa: E402

V, K = 29, 4
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def make_batch(seed: int = 0, topk: bool = True, advantage_scale: float = 1.0) -> verl_cpu.RolloutBatch:
    """4 sequences: left-padded prompts of 3..5 tokens, right-padded responses of 2..6 tokens, mu near pi."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = 4, 5, 6
    prompt_lens, response_lens = [5, 3, 4, 5], [6, 2, 5, 3]
    prompts = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    response_mask = torch.zeros(B, R, dtype=torch.long)
    for b in range(B):
        prompts[b, P - prompt_lens[b] :] = torch.randint(4, V, (prompt_lens[b],), generator=g)
        prompt_mask[b, P - prompt_lens[b] :] = 1
        responses[b, : response_lens[b]] = torch.randint(4, V, (response_lens[b],), generator=g)
        response_mask[b, : response_lens[b]] = 1
    rollout = -torch.rand(B, R, generator=g) * 3 * response_mask
    old = (rollout + 0.3 * torch.randn(B, R, generator=g)).clamp(max=0) * response_mask
    advantages = (torch.randn(B, 1, generator=g) * advantage_scale).expand(B, R) * response_mask
    samples = None
    if topk:
        samples = []
        for b in range(B):
            n = response_lens[b]
            rows = []
            for token in responses[b, :n].tolist():
                others = [i for i in (torch.randperm(V - 4, generator=g) + 4).tolist() if i != token][: K - 1]
                # the sampled token ranks first, or vLLM ranked it below K and it was forced into the last slot
                rows.append([token, *others] if torch.rand(1, generator=g) < 0.7 else [*others, token])
            ids = torch.tensor(rows)
            lps = torch.log_softmax(torch.randn(n, V, generator=g), -1).gather(-1, ids).float()
            samples.append(RolloutTopK(ids.numpy().astype("int32"), lps.numpy()))
    return verl_cpu.RolloutBatch(prompts, prompt_mask, responses, response_mask, rollout, old, advantages, samples)


def micro_batch(batch: verl_cpu.RolloutBatch, config, *, temperature: float = 1.0, entropy: bool = False):
    """The whole batch as one micro-batch, with the keys verl's engine adds before calling the loss."""
    data = verl_cpu.actor_batch(batch, temperature=temperature, calculate_entropy=entropy)
    tu.assign_non_tensor(
        data, dp_size=1, batch_num_tokens=int(data["loss_mask"].sum()), **{vloss.ENTROPY_FLAG: entropy}
    )
    return data


def packed_logits(data, seed: int = 1, dtype=torch.float32) -> torch.Tensor:
    n = int(data["input_ids"].offsets()[-1])
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, n, V, generator=g) * 2).to(dtype)


def response_view(data, packed: torch.Tensor) -> torch.Tensor:
    """[B, R, *] response part of a packed [N, *] tensor (the response position t reads row start + t)."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(packed, data)


def fork_reference(data, logits: torch.Tensor, config, mode: str) -> torch.Tensor:
    """[B, R] per-token loss of the fork's top-K DPPO, written out: full float32 log-softmax, rollout anchor."""
    return fork_terms(data, logits, config, mode)["loss"]


def fork_terms(data, logits: torch.Tensor, config, mode: str) -> dict[str, torch.Tensor]:
    """The fork's top-K DPPO per token ([B, R] each): loss, masked, log pi, log mu, divergence, entropy."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    cap = config.clip_ratio_c
    padded = data.select("responses", "rollout_log_probs", "advantages", "response_mask").to_padded_tensor()
    work = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for a float64 reference
    log_q = response_view(data, torch.log_softmax(logits.squeeze(0).to(work), dim=-1))  # [B, R, V]
    tokens = padded["responses"]
    logp = log_q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    mu_log = padded["rollout_log_probs"]
    adv = padded["advantages"]
    ids = torch.zeros(*tokens.shape, K, dtype=torch.long)
    topk_lps = torch.zeros(*tokens.shape, K)
    for b, sample in enumerate(data["dppo_topk"]):
        n = len(sample)
        ids[b, :n] = torch.from_numpy(sample.ids).long()
        topk_lps[b, :n] = torch.from_numpy(sample.logprobs)
    p = topk_lps.exp()
    q_log = log_q.gather(-1, ids)
    q = q_log.exp()
    p_rest = (1 - p.sum(-1)).clamp(min=1e-12)
    q_rest = (1 - q.sum(-1)).clamp(min=1e-12)
    if mode == "dppo_topk_tv":
        div = 0.5 * ((p - q).abs().sum(-1) + (p_rest - q_rest).abs())
    else:
        div = (p * (topk_lps - q_log)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
    pi, mu = logp.exp(), mu_log.exp()
    masked = torch.where(adv > 0, (div > high) & (pi > mu), (div > low) & (pi < mu))
    weight = torch.exp((logp - mu_log).clamp(max=20)).clamp(max=cap)
    entropy = -(log_q.exp() * log_q).sum(-1)
    return {
        "loss": -adv * weight.detach() * (~masked).float() * logp,
        "masked": masked,
        "logp": logp,
        "mu_log": mu_log,
        "divergence": div,
        "entropy": entropy,
        "advantages": adv,
    }


def run_plugin(config, data, logits: torch.Tensor, inplace: bool):
    """Both calls of the plugin's loss as verl's engine makes them; returns (loss, metrics, grad of the logits)."""
    leaf = logits.clone().requires_grad_(True)
    source = leaf * 1.0 if inplace else leaf  # in-place needs logits produced by an op (as the LM head's output)
    outputs = vloss.ppo_loss(config, student_logits=source, data=data)
    for key, value in outputs.items():
        assert value.shape == source.shape[:2], key
    cu_seqlens = data["input_ids"].offsets()
    model_output = {k: torch.nested.nested_tensor_from_jagged(v.squeeze(0), cu_seqlens) for k, v in outputs.items()}
    loss, metrics = vloss.ppo_loss(config, model_output=model_output, data=data)
    loss.backward()
    if inplace:  # the gradient was written into the logits' buffer (the op allocated none)
        torch.testing.assert_close(source.detach(), leaf.grad, rtol=0, atol=0)
    return loss.detach(), metrics, leaf.grad


def metric_value(metric) -> float:
    return float(metric.aggregate()) if hasattr(metric, "aggregate") else float(metric)


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("inplace", [False, True], ids=["autograd", "inplace"])
def test_topk_modes_match_the_fork_formula(mode, agg, inplace):
    config = verl_cpu.actor_config_for(
        mode, loss_agg_mode=agg, clip_ratio_low=0.1, clip_ratio_high=0.12, clip_ratio_c=5.0
    )
    data = micro_batch(make_batch(), config)
    logits = packed_logits(data)
    loss, metrics, grad = run_plugin(config, data, logits, inplace)

    ref_leaf = logits.clone().requires_grad_(True)
    per_token = fork_reference(data, ref_leaf, config, mode)
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].bool()
    ref = agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=agg, **config.global_batch_info)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-4, atol=1e-6)
    # the case must exercise the trust region: some tokens masked, some kept
    clipfrac = metric_value(metrics["actor/pg_clipfrac"])
    assert 0.0 < clipfrac < 1.0
    assert set(metrics) >= {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}


@pytest.mark.parametrize("mode", ["dppo_topk_tv", "dppo_topk_kl"])
def test_dppo_diagnostics_reach_verls_metrics(mode):
    """actor/dppo_* against the fork's formula's own per-token terms (masked tokens by advantage sign, |pi - mu|,
    divergence, entropy), for a batch whose trust region masks tokens of both signs."""
    config = verl_cpu.actor_config_for(mode, clip_ratio_low=0.1, clip_ratio_high=0.12, clip_ratio_c=5.0)
    data = micro_batch(make_batch(seed=2), config)
    logits = packed_logits(data, seed=3)
    _, metrics, _ = run_plugin(config, data, logits, inplace=False)
    t = fork_terms(data, logits, config, mode)
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].bool()
    pos, neg = mask & (t["advantages"] > 0), mask & (t["advantages"] < 0)
    mismatch = (t["logp"].exp() - t["mu_log"].exp()).abs()
    delta = (t["logp"] - t["mu_log"])[mask].double()  # finite here: no -inf log-prob, |delta| far below 20
    r = delta.exp()
    expected = {
        "actor/dppo_masked_frac": t["masked"][mask].float().mean(),
        "actor/dppo_masked_frac_pos": t["masked"][pos].float().mean(),
        "actor/dppo_masked_frac_neg": t["masked"][neg].float().mean(),
        "actor/dppo_mismatch_mean": mismatch[mask].mean(),
        "actor/dppo_mismatch_max": mismatch[mask].max(),
        "actor/dppo_mismatch_k3": (r - 1 - delta).mean(),
        "actor/dppo_log_ratio_min": delta.min(),
        "actor/dppo_log_ratio_max": delta.max(),
        "actor/dppo_log_ratio_outlier_frac": (delta.abs() > math.log(2)).double().mean(),
        "actor/dppo_ess": r.sum() ** 2 / (r.numel() * (r * r).sum()),
        "actor/dppo_divergence_mean": t["divergence"][mask].mean(),
        "actor/dppo_entropy_mean": t["entropy"][mask].mean(),
        "actor/dppo_seq_masked_frac": torch.tensor(0.0),  # no sequence mask (test_mask_family_settings_reach_the_loss)
    }
    assert set(expected) == set(verl_diagnostics.DIAGNOSTICS) and set(expected) <= set(metrics)
    for name, value in expected.items():
        assert metric_value(metrics[name]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), name
    assert 0 < float(expected["actor/dppo_masked_frac_pos"]) and 0 < float(expected["actor/dppo_masked_frac_neg"])
    assert metrics["actor/dppo_mismatch_max"].aggregation.value == "max"
    assert metrics["actor/dppo_log_ratio_min"].aggregation.value == "min"


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_binary_modes_match_verls_own_loss(mode, agg):
    thresholds = {"dppo_tv": 0.08, "dppo_kl": 0.02}[mode]
    config = verl_cpu.actor_config_for(
        mode, loss_agg_mode=agg, clip_ratio_low=thresholds, clip_ratio_high=thresholds, clip_ratio_c=4.0
    )
    data = micro_batch(make_batch(topk=False), config)
    logits = packed_logits(data)
    loss, metrics, grad = run_plugin(config, data, logits, inplace=True)

    # verl's own path: the engine's log-probs of the next tokens, then verl's ppo_loss and its dppo_tv/dppo_kl
    ref_leaf = logits.clone().requires_grad_(True)
    labels = torch.roll(data["input_ids"].values(), shifts=-1)
    log_probs = torch.log_softmax(ref_leaf.squeeze(0), -1).gather(-1, labels[:, None]).squeeze(-1)
    nested = torch.nested.nested_tensor_from_jagged(log_probs, data["input_ids"].offsets())
    ref, ref_metrics = verl_ppo_loss(config, {"log_probs": nested}, data)
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-4, atol=1e-6)
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/pg_loss"):
        assert metric_value(metrics[name]) == pytest.approx(metric_value(ref_metrics[name]), rel=1e-5, abs=1e-6), name
    assert 0.0 < metric_value(metrics["actor/pg_clipfrac"]) < 1.0


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl", "dppo_topk_tv", "dppo_topk_kl"])
def test_bf16_gradients_are_float64s_rounded_once(mode):
    """From bf16 logits, the plugin's loss is float64's to float32 precision and its gradient is float64's
    gradient rounded once to bf16 (bound: :func:`bf16_rounding_bound`), in every mode, on a batch whose trust
    region masks some tokens. The float64 reference is verl's own loss (binary modes) or the fork's formula
    (top-K) on the same bf16 values upcast exactly. benchmarks/verl_bf16_accuracy.py measures verl's own bf16
    path against the same reference (docs/verl.md)."""
    binary = mode in ("dppo_tv", "dppo_kl")
    fields = {"clip_ratio_low": 0.08, "clip_ratio_high": 0.08} if mode == "dppo_tv" else {}
    config = verl_cpu.actor_config_for(mode, clip_ratio_c=4.0, **fields)
    data = micro_batch(make_batch(topk=not binary, seed=11), config)
    logits = packed_logits(data, seed=12, dtype=torch.bfloat16)
    loss, metrics, grad = run_plugin(config, data, logits, inplace=True)
    assert grad.dtype == torch.bfloat16
    assert 0.0 < metric_value(metrics["actor/pg_clipfrac"]) < 1.0

    exact_leaf = logits.double().requires_grad_(True)
    if binary:
        labels = torch.roll(data["input_ids"].values(), shifts=-1)
        log_probs = torch.log_softmax(exact_leaf.squeeze(0), -1).gather(-1, labels[:, None]).squeeze(-1)
        nested = torch.nested.nested_tensor_from_jagged(log_probs, data["input_ids"].offsets())
        exact, _ = verl_ppo_loss(config, {"log_probs": nested}, data)
    else:
        mask = data.select("response_mask").to_padded_tensor()["response_mask"].bool()
        per_token = fork_reference(data, exact_leaf, config, mode)
        exact = agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode="token-mean", **config.global_batch_info)
    exact.backward()
    assert exact.dtype == torch.float64 and exact_leaf.grad.abs().max() > 0
    assert float(loss) == pytest.approx(float(exact.detach()), rel=1e-6)
    error = (grad.double() - exact_leaf.grad).abs()
    bound = bf16_rounding_bound(exact_leaf.grad)
    assert (error <= bound).all(), f"{int((error > bound).sum())} elements beyond one bf16 rounding"


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_bf16_bound_rejects_verls_bf16_log_probs(mode):
    """The bound of the test above has power: verl's own loss on bf16 log-probs (its engine's path without
    flash-attn, ``logprobs_from_logits`` on the bf16 logits) breaks it on more than a fifth of the elements of
    the same batch's gradient."""
    from verl.utils.torch_functional import logprobs_from_logits

    fields = {"clip_ratio_low": 0.08, "clip_ratio_high": 0.08} if mode == "dppo_tv" else {}
    config = verl_cpu.actor_config_for(mode, clip_ratio_c=4.0, **fields)
    data = micro_batch(make_batch(topk=False, seed=11), config)
    logits = packed_logits(data, seed=12, dtype=torch.bfloat16)
    labels = torch.roll(data["input_ids"].values(), shifts=-1)
    grads = {}
    for name, leaf in (("bf16", logits.clone()), ("float64", logits.double())):
        leaf.requires_grad_(True)
        nested = torch.nested.nested_tensor_from_jagged(
            logprobs_from_logits(leaf.squeeze(0), labels), data["input_ids"].offsets()
        )
        verl_ppo_loss(config, {"log_probs": nested}, data)[0].backward()
        grads[name] = leaf.grad.double()
    beyond = (grads["bf16"] - grads["float64"]).abs() > bf16_rounding_bound(grads["float64"])
    assert beyond.double().mean() > 0.2


def test_entropy_bonus_and_kl_loss_use_the_ops_outputs():
    config = verl_cpu.actor_config_for(
        "dppo_topk_kl",
        entropy_coeff=0.03,
        use_kl_loss=True,
        kl_loss_coef=0.2,
        kl_loss_type="low_var_kl",
        clip_ratio_c=5.0,
    )
    data = micro_batch(make_batch(seed=3), config, entropy=True)
    ref_log_prob = (data["rollout_log_probs"] - 0.1).clamp(max=0)
    data["ref_log_prob"] = ref_log_prob
    logits = packed_logits(data, seed=4)
    loss, metrics, grad = run_plugin(config, data, logits, inplace=True)

    from verl.trainer.ppo.core_algos import kl_penalty

    ref_leaf = logits.clone().requires_grad_(True)
    mask = data.select("response_mask").to_padded_tensor()["response_mask"].bool()
    info = config.global_batch_info
    pg = agg_loss(
        loss_mat=fork_reference(data, ref_leaf, config, "dppo_topk_kl"),
        loss_mask=mask,
        loss_agg_mode="token-mean",
        **info,
    )
    log_q = response_view(data, torch.log_softmax(ref_leaf.squeeze(0), -1))
    entropy = -(log_q.exp() * log_q).sum(-1)
    logp = log_q.gather(-1, data["responses"].unsqueeze(-1)).squeeze(-1)
    kld = kl_penalty(logprob=logp, ref_logprob=ref_log_prob, kl_penalty="low_var_kl")
    ref = (
        pg
        - 0.03 * agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode="token-mean", **info)
        + 0.2 * agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode="token-mean", **info)
    )
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_leaf.grad, rtol=1e-4, atol=1e-6)
    assert {"actor/entropy_loss", "kl_loss", "kl_coef"} <= set(metrics)


def test_rollout_is_weights_scale_the_per_token_loss():
    config = verl_cpu.actor_config_for("dppo_topk_tv", clip_ratio_c=5.0, loss_agg_mode="token-sum")
    data = micro_batch(make_batch(seed=5), config)
    logits = packed_logits(data, seed=6)
    base, _, _ = run_plugin(config, data, logits, inplace=False)
    data["rollout_is_weights"] = torch.full_like(data["rollout_log_probs"], 0.25)
    scaled, _, _ = run_plugin(config, data, logits, inplace=False)
    torch.testing.assert_close(scaled, 0.25 * base)


class _RecordOutputs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype))
        return out


def test_no_float32_vocabulary_tensor_from_bf16_logits():
    config = verl_cpu.actor_config_for("dppo_topk_kl", clip_ratio_c=5.0, entropy_coeff=0.01)
    data = micro_batch(make_batch(seed=7), config, entropy=True)
    logits = packed_logits(data, seed=8, dtype=torch.bfloat16)
    with _RecordOutputs() as rec:
        loss, _, grad = run_plugin(config, data, logits, inplace=True)
    n = logits.shape[1]
    wide = [(op, shape, dtype) for op, shape, dtype in rec.outputs if shape[-1:] == (V,) and math.prod(shape) >= n * V]
    assert wide, "the recorder saw no vocabulary-wide tensor at all"
    assert not [w for w in wide if w[2] in (torch.float32, torch.float64)]
    assert torch.isfinite(loss) and grad.dtype == torch.bfloat16


def test_other_modes_go_to_verls_ppo_loss():
    config = verl_cpu.actor_config_for("vanilla")
    data = micro_batch(make_batch(topk=False), config)
    logits = packed_logits(data)
    labels = torch.roll(data["input_ids"].values(), shifts=-1)
    log_probs = torch.log_softmax(logits.squeeze(0), -1).gather(-1, labels[:, None]).squeeze(-1)
    nested = torch.nested.nested_tensor_from_jagged(log_probs, data["input_ids"].offsets())
    ours, _ = vloss.ppo_loss(config, model_output={"log_probs": nested}, data=data)
    theirs, _ = verl_ppo_loss(config, {"log_probs": nested}, data)
    assert torch.equal(ours, theirs)


def test_missing_topk_says_how_to_turn_it_on():
    config = verl_cpu.actor_config_for("dppo_topk_tv")
    data = micro_batch(make_batch(topk=False), config)
    with pytest.raises(RuntimeError, match=r"rollout\.custom\.dppo_topk=K"):
        vloss.ppo_loss(config, student_logits=packed_logits(data), data=data)


def test_misaligned_topk_is_refused():
    batch = make_batch()
    shifted = batch.topk[0]
    batch.topk[0] = RolloutTopK(shifted.ids[::-1].copy(), shifted.logprobs[::-1].copy())  # rows of other tokens
    config = verl_cpu.actor_config_for("dppo_topk_tv")
    data = micro_batch(batch, config)
    with pytest.raises(RuntimeError, match="not in the rollout's top-K row"):
        vloss.ppo_loss(config, student_logits=packed_logits(data), data=data)


def test_short_topk_names_single_turn():
    batch = make_batch()
    short = batch.topk[0]
    batch.topk[0] = RolloutTopK(short.ids[:2].copy(), short.logprobs[:2].copy())
    config = verl_cpu.actor_config_for("dppo_topk_kl")
    data = micro_batch(batch, config)
    with pytest.raises(RuntimeError, match="single-turn"):
        vloss.ppo_loss(config, student_logits=packed_logits(data), data=data)


def test_top_k_mode_without_the_engine_path_raises():
    config = verl_cpu.actor_config_for("dppo_topk_tv")
    data = micro_batch(make_batch(), config)
    nested = torch.nested.nested_tensor_from_jagged(
        torch.zeros(int(data["input_ids"].offsets()[-1])), data["input_ids"].offsets()
    )
    with pytest.raises(RuntimeError, match="FSDP engine"):
        vloss.ppo_loss(config, model_output={"log_probs": nested}, data=data)
    # dppo_tv keeps working there: verl's own loss
    binary = verl_cpu.actor_config_for("dppo_tv")
    loss, _ = vloss.ppo_loss(binary, model_output={"log_probs": nested}, data=data)
    assert torch.isfinite(loss)


def test_partial_matches_what_the_worker_builds():
    import verl.workers.engine_workers as engine_workers

    assert engine_workers.ppo_loss is vloss.ppo_loss
    fn = functools.partial(engine_workers.ppo_loss, config=verl_cpu.actor_config_for("dppo_topk_tv"))
    assert dppo_ext.integrations.verl.plugin._plugin_mode(fn) == "dppo_topk_tv"


def test_bf16_accuracy_benchmark_at_a_small_size(tmp_path):
    """benchmarks/verl_bf16_accuracy.py (docs/verl.md's table) runs and its plugin rows are correctly rounded."""
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "verl_bf16_accuracy.py"
    spec = importlib.util.spec_from_file_location("verl_bf16_accuracy", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "acc.json"
    bench.main(["--vocab", "64", "--seeds", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["vocab"], r["mode"]) for r in rows] == [(64, "dppo_tv"), (64, "dppo_kl")]
    for row in rows:
        assert row["plugin"]["max_rounding_steps"] <= 0.5 + 1e-3 and row["plugin"]["mask_flips"] == 0, row
        assert row["verl"]["max_rounding_steps"] > 1, row


def mask_family_config(mode: str, **dppo):
    """verl's actor config with DPPOPolicyLossConfig as the policy-loss class and ``policy_loss.<key>=<value>``."""
    from verl.utils.config import omega_conf_to_dataclass

    from dppo_ext.integrations.verl.config import DPPO_POLICY_LOSS_TARGET

    overrides = [
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.clip_ratio_low=0.1",
        "actor_rollout_ref.actor.clip_ratio_high=0.1",
        "actor_rollout_ref.actor.clip_ratio_c=4.0",
        f"actor_rollout_ref.actor.policy_loss._target_={DPPO_POLICY_LOSS_TARGET}",
    ]
    overrides += [f"+actor_rollout_ref.actor.policy_loss.{key}={value}" for key, value in dppo.items()]
    return omega_conf_to_dataclass(verl_cpu.compose(overrides).actor_rollout_ref.actor)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_topk_kl"])
def test_mask_family_settings_reach_the_loss(mode):
    """policy_loss.dppo_mask_direction / dppo_kl_tau / dppo_kl_mask_type / dppo_sequence_mask are the API's
    mask_direction, kl_tau, kl_mask_type and sequence_mask (each response one sequence): the plugin's loss and
    logits gradient equal dppo_ext.dppo_loss on the responses' logits with the same settings, and differ from the
    plugin's loss without them."""
    topk = VERL_MODES[mode].topk
    plain = mask_family_config(mode)
    data = micro_batch(make_batch(topk=topk, advantage_scale=2.0), plain)
    logits = packed_logits(data)
    padded = data.select("responses", "response_mask", "advantages", VERL_MODES[mode].anchor).to_padded_tensor()
    mask = padded["response_mask"].bool()
    mu = padded[VERL_MODES[mode].anchor]
    logp = torch.log_softmax(response_view(data, logits.squeeze(0)), -1).gather(-1, padded["responses"][..., None])
    k1_sum = ((mu - logp[..., 0]) * mask).sum(1)
    high = float(k1_sum.sort().values[1:3].mean())  # between the 2nd and 3rd: masks two of the four responses
    sequence_mask = dppo_ext.SequenceMask("k1", "sum", high=high)
    config = mask_family_config(
        mode,
        dppo_mask_direction="symmetric",
        dppo_kl_tau=0.05,
        dppo_kl_mask_type="unmasked",
        dppo_sequence_mask=f"{{statistic:k1,reduce:sum,high:{high!r}}}",
    )
    assert vloss.settings(config).masks.sequence_mask == sequence_mask
    loss, metrics, grad = run_plugin(config, data, logits, inplace=True)
    plain_loss, _, _ = run_plugin(plain, data, logits, inplace=True)

    leaf = logits.clone().requires_grad_(True)
    topk_ids = topk_logprobs = None
    if topk:
        ids, lps = vloss._topk_rows(data, padded["responses"].long(), mask)
        topk_ids, topk_logprobs = ids, lps
    want, want_metrics = dppo_ext.dppo_loss(
        response_view(data, leaf.squeeze(0)),
        padded["responses"].long(),
        mu,
        padded["advantages"],
        response_mask=mask,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        mode=VERL_MODES[mode].mode,
        mask_direction="symmetric",
        kl_tau=0.05,
        kl_mask_type="unmasked",
        sequence_mask=sequence_mask,
        delta_low=0.1,
        delta_high=0.1,
        ratio_cap=4.0,
    )
    want.backward()
    assert want_metrics["seq_masked_frac"] == pytest.approx(0.5)
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(loss, plain_loss, rtol=1e-3), "the settings must change this batch's loss"
    assert metric_value(metrics["actor/pg_clipfrac"]) >= 0.5  # the masked responses' tokens count as masked
    # the op's share of dropped sequences, logged beside verl's metrics (0 without a sequence mask)
    assert metric_value(metrics["actor/dppo_seq_masked_frac"]) == pytest.approx(float(want_metrics["seq_masked_frac"]))
    assert metric_value(run_plugin(plain, data, logits, inplace=True)[1]["actor/dppo_seq_masked_frac"]) == 0

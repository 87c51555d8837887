"""DPPO computed by dppo_ext from the logits inside verl's FSDP engine.

verl's engine calls the actor's loss function twice per micro-batch when the micro-batch says
``distillation_use_topk`` (the path verl's top-K distillation uses):

1. as a *logits processor*, ``loss_fn(student_logits=[1, N, V], data=micro_batch)``, right after the model's
   forward, with the logits of the micro-batch's N packed tokens (prompts and responses, already divided by the
   rollout temperature); it must return ``[1, N]`` tensors, which the engine turns into nested per-sequence
   tensors of ``model_output``;
2. as the loss, ``loss_fn(model_output=..., data=micro_batch)``.

:func:`ppo_loss` (installed as the actor's loss by :mod:`dppo_ext.integrations.verl.plugin`) does both for the
loss modes of :data:`VERL_MODES` and hands every other mode to verl's own ``ppo_loss``. Step 1 runs the fused
op (``dppo_ext.dppo_loss_per_row``) on the logits: no ``[N, V]`` float32 temporary, the gradient written into the
logits' buffer in backward (``inplace_backward``), prompt and padding rows skipped (token ``-100``). Step 2
aggregates the per-token loss with verl's ``agg_loss`` and the global batch info verl's engine sets, and reports
verl's metric names, as verl's ``ppo_loss`` with its ``dppo_tv`` / ``dppo_kl`` losses does.

Settings are verl's: ``clip_ratio_low`` / ``clip_ratio_high`` (fallback ``clip_ratio``) are the divergence
thresholds, ``clip_ratio_c`` caps the importance weight ``min(pi / mu, C)`` (verl's default 3.0; dppo_ext's own
default is 10, docs/verl.md), ``loss_agg_mode`` / ``loss_scale_factor`` aggregate, ``entropy_coeff`` and
``use_kl_loss`` / ``kl_loss_coef`` / ``kl_loss_type`` work on the op's entropy and log-probs (which carry gradients).

Anchors: the top-K modes use the paper's anchor, the rollout's log-probs ``rollout_log_probs`` (mu) in the trust
region test and in the weight, and the rollout's top-K (:mod:`dppo_ext.integrations.verl.rollout`). ``dppo_tv`` /
``dppo_kl`` keep verl's semantics exactly: ``old_log_probs`` in both places.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple, Optional

import torch
from tensordict import TensorDict
from torch import Tensor

import dppo_ext
from dppo_ext._autograd import check_inplace_backward
from dppo_ext.contract import IGNORE_INDEX, LOG_RATIO_CLAMP

from ._status import check_installed
from .config import VERL_MODES, MaskSettings, ModeSpec, check_mask_settings, thresholds
from .diagnostics import diagnostics, sequence_dropped
from .rollout import TOPK_CONFIG_KEY, TOPK_FIELD, TOPK_IDS_KEY, TOPK_LOGPROBS_KEY, RolloutTopK

logger = logging.getLogger(__name__)

__all__ = [
    "LOGIT_OUTPUTS",
    "VERL_MODES",
    "ModeSpec",
    "loss_mode",
    "logits_outputs",
    "policy_loss",
    "ppo_loss",
    "response_rows",
    "settings",
]


# The per-token outputs the logits processor returns (model_output keys), each [1, N] then nested.
LOGIT_OUTPUTS = ("dppo_loss", "dppo_logp", "dppo_mask", "dppo_entropy", "dppo_divergence", "dppo_seq_dropped")
# Micro-batch flag: the entropy the driver asked for (verl's calculate_entropy is turned off for these modes, the op
# computes the entropy instead of verl's full-vocabulary float32 one).
ENTROPY_FLAG = "dppo_calculate_entropy"
# verl's dual-clip default of clip_ratio_c, which also caps the DPPO weight unless set.
VERL_DEFAULT_RATIO_CAP = 3.0
_warned_cap = False


def loss_mode(config: Any) -> str:
    """The ``policy_loss.loss_mode`` of a verl actor config (verl's default ``vanilla``)."""
    return config.policy_loss.get("loss_mode", "vanilla")


class Settings(NamedTuple):
    spec: ModeSpec
    delta_low: float
    delta_high: float
    ratio_cap: float
    masks: MaskSettings  # policy_loss.dppo_* (DPPOPolicyLossConfig)


def settings(config: Any) -> Settings:
    """The op settings of a verl actor config whose loss mode is one of :data:`VERL_MODES`."""
    global _warned_cap
    spec = VERL_MODES[loss_mode(config)]
    low, high, cap = thresholds(config)
    if spec.topk and cap == VERL_DEFAULT_RATIO_CAP and not _warned_cap:
        _warned_cap = True
        logger.warning(
            "%s caps the importance weight min(pi/mu, C) at actor.clip_ratio_c=%s, verl's dual-clip PPO default; "
            "dppo_ext's default cap is 10 (the paper recommends a large cap, section 5.4): set "
            "actor_rollout_ref.actor.clip_ratio_c explicitly",
            loss_mode(config),
            cap,
        )
    return Settings(spec, low, high, cap, check_mask_settings(config.policy_loss))


def response_rows(data: TensorDict, num_rows: int) -> Tensor:
    """``[B, R]`` int64: the packed row (0 .. N-1) of each response position of the micro-batch, -1 past a response.

    Derived with verl's own ``no_padding_2_padding`` (the map verl uses to read the response part of any packed
    per-token output), applied to the row numbers, so both directions agree by construction.
    """
    from verl.workers.utils.padding import no_padding_2_padding

    device = data["input_ids"].values().device if data["input_ids"].is_nested else data["input_ids"].device
    numbers = torch.arange(1, num_rows + 1, device=device)
    return no_padding_2_padding(numbers, data).long() - 1


def _padded(data: TensorDict, *keys: str) -> TensorDict:
    return data.select(*keys).to_padded_tensor()


def _per_sample(value: Any) -> list[Tensor]:
    """The per-sample ``[T_i, K]`` rows of a nested (jagged) or dense ``[B, T, K]`` batch tensor."""
    return list(value.unbind()) if getattr(value, "is_nested", False) else list(value)


def _topk_samples(data: TensorDict) -> list[Optional[tuple[Tensor, Tensor]]]:
    """Each sequence's rollout top-K ``([T, K] ids, [T, K] log-probs)`` (None: the sequence has none).

    From the V1 trainer's tensors (:data:`TOPK_IDS_KEY` / :data:`TOPK_LOGPROBS_KEY`, nested per sample) or the legacy
    trainer's ``non_tensor_batch`` objects (:data:`TOPK_FIELD`, one :class:`RolloutTopK` per sample).
    """
    keys = set(data.keys())
    if TOPK_IDS_KEY in keys or TOPK_LOGPROBS_KEY in keys:
        if not {TOPK_IDS_KEY, TOPK_LOGPROBS_KEY} <= keys:
            raise RuntimeError(f"the actor's batch holds only one of {TOPK_IDS_KEY!r} and {TOPK_LOGPROBS_KEY!r}")
        return list(zip(_per_sample(data[TOPK_IDS_KEY]), _per_sample(data[TOPK_LOGPROBS_KEY])))
    if TOPK_FIELD not in keys:
        raise RuntimeError(
            f"the top-K DPPO modes need the rollout's top-K log-probs, which this batch does not carry (no "
            f"{TOPK_IDS_KEY!r} or {TOPK_FIELD!r} field): set actor_rollout_ref.rollout.custom.{TOPK_CONFIG_KEY}=K "
            "(K >= 1; vLLM's max_logprobs, 20 by default, bounds it) with verl's vLLM rollout, and keep dppo_ext "
            "installed in every process (the rollout servers load it through verl's plugin entry point)"
        )
    samples = []
    for b, sample in enumerate(data[TOPK_FIELD]):
        if isinstance(sample, RolloutTopK):
            samples.append((torch.from_numpy(sample.ids), torch.from_numpy(sample.logprobs)))
        elif sample is None:
            samples.append(None)
        else:
            raise RuntimeError(
                f"sequence {b}: {TOPK_FIELD} is a {type(sample).__name__}, not the RolloutTopK the "
                "plugin's vLLM server returns"
            )
    return samples


def _topk_rows(data: TensorDict, responses: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The rollout's top-K aligned with the response positions: ``([B, R, K] int64, [B, R, K] float32)``."""
    samples = _topk_samples(data)
    batch, length = responses.shape
    if len(samples) != batch:
        raise RuntimeError(f"the rollout's top-K holds {len(samples)} entries for a micro-batch of {batch} sequences")
    lengths = valid.sum(-1).tolist()
    last = [int(torch.nonzero(row).max()) + 1 if n else 0 for row, n in zip(valid.cpu(), lengths)]
    widths = {int(sample[0].shape[-1]) for b, sample in enumerate(samples) if sample is not None and last[b]}
    if len(widths) > 1:
        raise RuntimeError(f"the rollout's top-K rows have different K in one micro-batch: {sorted(widths)}")
    k = widths.pop() if widths else 1
    ids = torch.zeros((batch, length, k), dtype=torch.int64)
    logprobs = torch.zeros((batch, length, k), dtype=torch.float32)
    for b, sample in enumerate(samples):
        if not last[b]:
            continue
        if sample is None:
            raise RuntimeError(
                f"sequence {b} of the micro-batch has response tokens but no rollout top-K; was it "
                "generated by a patched vLLM server?"
            )
        sample_ids, sample_lps = sample
        if len(sample_ids) < last[b]:
            raise RuntimeError(
                f"sequence {b}: the rollout returned top-K rows for {len(sample_ids)} generated tokens, the response "
                f"has {last[b]} positions: the top-K modes support single-turn rollouts only (a multi-turn agent loop "
                "keeps the first turn's extra fields)"
            )
        n = min(len(sample_ids), length)
        ids[b, :n] = sample_ids[:n].to(torch.int64).cpu()
        logprobs[b, :n] = sample_lps[:n].to(torch.float32).cpu()
    ids_t = ids.to(responses.device)
    logprobs_t = logprobs.to(responses.device)
    member = (ids_t == responses.unsqueeze(-1)).any(-1) | ~valid
    if not bool(member.all()):
        b, t = (int(i) for i in torch.nonzero(~member)[0])
        raise RuntimeError(
            f"sequence {b}, response position {t}: the sampled token {int(responses[b, t])} is not in the rollout's "
            f"top-K row {ids_t[b, t].tolist()}; the rows are not aligned with the response (a multi-turn or "
            "re-tokenised response?)"
        )
    return ids_t, logprobs_t


def _can_write_grad_into(logits: Tensor) -> bool:
    """Whether the backward may write the gradient into ``logits`` (the engine's LM-head output: yes; a leaf, a
    tensor whose producer saved it, or no autograd: no, the op then allocates the gradient)."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return False
    try:
        check_inplace_backward(logits)
    except ValueError as exc:
        logger.debug("dppo_ext computes the logits gradient out of place: %s", exc)
        return False
    return True


def logits_outputs(config: Any, data: TensorDict, student_logits: Tensor) -> dict[str, Tensor]:
    """Step 1: the per-token DPPO outputs of the micro-batch from its logits.

    Args:
        config: the actor config (``loss_mode`` in :data:`VERL_MODES`).
        data: the micro-batch (verl's no-padding layout).
        student_logits: ``[1, N, V]`` the engine's logits, divided by the temperature.

    Returns:
        ``{name: [1, N]}`` for :data:`LOGIT_OUTPUTS`.
    """

    s = settings(config)
    logits = student_logits.squeeze(0)
    num_rows = logits.shape[0]
    keys = ["responses", "response_mask", "advantages", s.spec.anchor]
    missing = [key for key in keys if key not in data.keys()]
    if missing:
        raise RuntimeError(
            f"{loss_mode(config)} needs {missing} in the actor's batch; "
            + (
                "rollout_log_probs (mu) comes from the vLLM rollout: set actor_rollout_ref.rollout.custom."
                f"{TOPK_CONFIG_KEY}=K (or rollout.calculate_log_probs=True)"
                if "rollout_log_probs" in missing
                else "verl computes old_log_probs before the actor update"
            )
        )
    padded = _padded(data, *keys)
    responses = padded["responses"].long()
    rows = response_rows(data, num_rows)
    valid = padded["response_mask"].bool() & (rows >= 0)
    flat_rows = rows[valid]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    # each packed row's sequence (the sequence mask's unit), 0 for prompt and padding rows, which it does not read
    sequence_of = torch.arange(responses.shape[0], device=responses.device)[:, None].expand_as(responses)

    def scatter(values: Tensor, fill: float, dtype: torch.dtype) -> Tensor:
        out = torch.full((num_rows, *values.shape[2:]), fill, dtype=dtype, device=logits.device)
        out[flat_rows] = values[valid].to(dtype=dtype, device=logits.device)
        return out

    tokens = scatter(responses, IGNORE_INDEX, torch.long)
    mu = scatter(padded[s.spec.anchor], 0.0, acc)
    advantages = scatter(padded["advantages"], 0.0, acc)
    sequence_ids = scatter(sequence_of, 0, torch.long) if s.masks.sequence_mask is not None else None
    topk_ids = topk_logprobs = None
    if s.spec.topk:
        ids, lps = _topk_rows(data, responses, valid)
        topk_ids, topk_logprobs = scatter(ids, 0, torch.long), scatter(lps, 0.0, acc)
    # The entropy is computed in the op's pass over each row whether or not the loss uses it (the metric
    # actor/dppo_entropy_mean); it enters the loss only when verl asked for it (ENTROPY_FLAG).
    out = dppo_ext.dppo_loss_per_row(
        logits,
        tokens,
        mu,
        advantages,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        mode=s.spec.mode,
        mask_direction=s.masks.mask_direction,
        kl_tau=s.masks.kl_tau,
        kl_mask_type=s.masks.kl_mask_type,
        sequence_mask=s.masks.sequence_mask,
        sequence_ids=sequence_ids,
        temperature=1.0,
        delta_low=s.delta_low,
        delta_high=s.delta_high,
        ratio_cap=s.ratio_cap,
        compute_entropy=True,
        inplace_backward=_can_write_grad_into(logits),
    )
    seq_dropped = torch.zeros_like(out.logp.detach())
    if s.masks.sequence_mask is not None:
        seq_dropped = sequence_dropped(s.masks.sequence_mask, out.logp, mu, tokens, advantages, sequence_ids)
    return {
        "dppo_loss": out.loss[None],
        "dppo_logp": out.logp[None],
        "dppo_mask": out.mask[None],
        "dppo_entropy": out.entropy[None],
        "dppo_divergence": out.divergence[None],
        "dppo_seq_dropped": seq_dropped[None],
    }


def policy_loss(config: Any, model_output: dict, data: TensorDict) -> tuple[Tensor, dict[str, Any]]:
    """Step 2: verl's aggregation and metrics (those of verl's ``ppo_loss`` with ``dppo_tv``) of step 1's outputs."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric
    from verl.utils.torch_functional import masked_mean
    from verl.workers.utils.padding import no_padding_2_padding

    s = settings(config)
    per_token = {key: no_padding_2_padding(model_output[key], data) for key in LOGIT_OUTPUTS}
    config.global_batch_info["dp_size"] = data["dp_size"]
    config.global_batch_info["batch_num_tokens"] = data["batch_num_tokens"]
    config.global_batch_info["global_batch_size"] = data["global_batch_size"]
    config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    normalised = (
        data["dp_size"] > 1
        or data["batch_num_tokens"] is not None
        or data["global_batch_size"] is not None
        or config.loss_scale_factor is not None
    )
    metric_aggregation = AggregationType.SUM if normalised else AggregationType.MEAN

    fields = ["response_mask", "advantages", s.spec.anchor]
    fields += [
        key
        for key in ("rollout_is_weights", "ref_log_prob", "rollout_log_probs")
        if key in data.keys() and key not in fields
    ]
    padded = _padded(data, *fields)
    response_mask = padded["response_mask"].bool()
    anchor = padded[s.spec.anchor]
    log_prob = per_token["dppo_logp"]
    pg_losses = per_token["dppo_loss"]
    if "rollout_is_weights" in padded.keys():
        pg_losses = pg_losses * padded["rollout_is_weights"]
    pg_loss = agg_loss(
        loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **config.global_batch_info
    )

    with torch.no_grad():
        log_ratio = (log_prob.detach() - anchor).clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
        kept = per_token["dppo_mask"]
        pg_metrics = {
            "actor/pg_clipfrac": masked_mean(1.0 - kept, response_mask).item(),
            "actor/ppo_kl": masked_mean(-log_ratio, response_mask).item(),
            "actor/pg_clipfrac_lower": masked_mean(
                (log_ratio.exp() > s.ratio_cap).float() * kept, response_mask
            ).item(),
        }
    metrics = dict(Metric.from_dict(pg_metrics, aggregation=AggregationType.MEAN))
    metrics.update(diagnostics(per_token, padded, response_mask))
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=metric_aggregation)
    loss = pg_loss
    if tu.get_non_tensor_data(data=data, key=ENTROPY_FLAG, default=False):
        entropy_loss = agg_loss(
            loss_mat=per_token["dppo_entropy"],
            loss_mask=response_mask,
            loss_agg_mode=config.loss_agg_mode,
            **config.global_batch_info,
        )
        loss = loss - config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=metric_aggregation)
    if config.use_kl_loss:
        kld = kl_penalty(logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty=config.kl_loss_type)
        kl_loss = agg_loss(
            loss_mat=kld, loss_mask=response_mask, loss_agg_mode=config.loss_agg_mode, **config.global_batch_info
        )
        loss = loss + kl_loss * config.kl_loss_coef
        metrics["kl_loss"] = Metric(value=kl_loss, aggregation=metric_aggregation)
        metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics


def ppo_loss(
    config: Any,
    model_output: Optional[dict] = None,
    data: Optional[TensorDict] = None,
    dp_group=None,
    student_logits: Optional[Tensor] = None,
    data_format: str = "thd",
):
    """The actor loss the plugin installs in place of verl's ``ppo_loss`` (same call forms).

    Loss modes outside :data:`VERL_MODES` go to verl's ``ppo_loss`` unchanged. For the plugin's modes: called with
    ``student_logits``, step 1 (:func:`logits_outputs`); called with ``model_output``, step 2 (:func:`policy_loss`).
    When the engine did not run step 1 (an engine other than verl's FSDP one), ``dppo_tv`` / ``dppo_kl`` fall back
    to verl's own loss and the top-K modes raise.
    """
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    mode = loss_mode(config)
    if mode not in VERL_MODES:
        return verl_ppo_loss(config, model_output, data, dp_group)
    if data_format != "thd":
        raise RuntimeError(f"{mode}: dppo_ext computes the loss on verl's packed (thd) logits, got {data_format!r}")
    if student_logits is not None:
        return logits_outputs(config, data, student_logits)
    if all(key in model_output for key in LOGIT_OUTPUTS):
        return policy_loss(config, model_output, data)
    if not VERL_MODES[mode].topk:
        return verl_ppo_loss(config, model_output, data, dp_group)
    check_installed()
    raise RuntimeError(
        f"{mode} is computed by dppo_ext from the logits inside verl's FSDP engine (actor strategy fsdp or fsdp2), "
        "which did not hand them to the loss in this run; see docs/verl.md for the supported setups"
    )

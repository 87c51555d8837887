"""``DPPOGRPOTrainer``: TRL's ``GRPOTrainer`` whose policy loss is DPPO, with its metrics in TRL's logs.

What it changes against ``trl.GRPOTrainer`` (the package docstring has the whole picture): the loss of each
micro-batch (through the model's DPPO head, :mod:`.head`), the rollout log-probs it is anchored on (vLLM's, else
the recomputed old policy's), the top-K kept next to the completions for the top-K modes, the colocated engine's
dtype and weight sync (:mod:`.generation`), and the ``dppo/*`` metrics.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Optional

import torch

from ... import DPPOOutputs, aggregate_loss, dppo_metrics, micro_batch_scale
from ...contract import IGNORE_INDEX, NORM_AGG_MODES, SUM_AGG_MODES, TOPK_MODES
from ...models.lm_head import check_plain_logits
from ...rollout.vllm_parity import engine_private_model_classes, policy_attn_implementation
from .config import DPPOGRPOConfig
from .generation import (
    VLLMWeightSync,
    extra_llm_kwargs,
    kv_cache_env_lifted,
    pad_topk,
    split_vllm_logprobs,
)
from .head import DPPOForwardOutput, add_dppo_head, flat_float
from .versions import import_trl, tested_vllm_warning_silenced

import_trl()
with tested_vllm_warning_silenced():  # TRL's trainer imports its vLLM modules, which check vLLM's version
    from trl import GRPOTrainer  # noqa: E402
    from trl.extras.profiling import profiling_context  # noqa: E402
    from trl.generation import vllm_generation as trl_vllm_generation  # noqa: E402

__all__ = ["DPPOGRPOTrainer", "micro_batch_loss"]

logger = logging.getLogger(__name__)

# Metrics aggregated across processes by max (or min) instead of mean.
_MAX_METRICS = ("mismatch_max", "ratio_max", "log_ratio_max")
_MIN_METRICS = ("log_ratio_min",)


def micro_batch_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    num_items_in_batch: torch.Tensor,
    accumulation_steps: int,
    steps_per_generation: int,
    num_processes: int,
    max_completion_length: Optional[int],
) -> torch.Tensor:
    """The scalar loss of one micro-batch, scaled so that TRL's sum over the accumulation steps and DDP's mean over
    processes give ``loss_agg_mode`` over the optimizer step's batch (docs/aggregation.md).

    ``per_token_loss``, ``mask``: ``[B, T]``. ``token-mean`` divides by the completion tokens of the whole
    generation batch on all processes (TRL's ``num_items_in_batch``, as its ``dapo``), a generation batch feeding
    ``steps_per_generation`` optimizer steps; the sums (``token-sum``, ``token-sum-norm``) add up over
    micro-batches and processes; the sequence modes are averaged over the ``accumulation_steps`` micro-batches.
    The ``-norm`` modes divide by ``max_completion_length``. In evaluation both counts are 1.

    The weight of the micro-batch is ``dppo_ext.micro_batch_scale``, as in the reference trainer, with the
    generation batch on all processes as the batch; the sequence modes keep TRL's mean of the micro-batches' means.
    """
    horizon = max_completion_length if loss_agg_mode in NORM_AGG_MODES else None
    loss = aggregate_loss(per_token_loss, mask, loss_agg_mode, horizon)
    if loss_agg_mode not in SUM_AGG_MODES and loss_agg_mode != "token-mean":
        return loss / accumulation_steps  # TRL's grpo / dr_grpo: the mean of the micro-batches' means
    # token-mean: this micro-batch's share of the generation batch's tokens on all processes; the sums: 1
    scale = micro_batch_scale(loss_agg_mode, mask, num_items_in_batch, batch_sequences=1).to(loss.dtype)
    # DDP averages over the processes (undone here), and for token-mean one optimizer step holds
    # accumulation_steps of each process's steps_per_generation micro-batches of the generation batch.
    steps = steps_per_generation / accumulation_steps if loss_agg_mode == "token-mean" else 1
    return loss * scale * (num_processes * steps)


class DPPOGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss is DPPO through ``dppo_ext`` (docs/trl.md).

    Takes ``args=DPPOGRPOConfig(...)``; everything else is ``GRPOTrainer``'s. TRL's entropy bonus,
    ``top_entropy_quantile < 1`` (loss variants of TRL's own) are refused; TRL's ``off_policy_mask_threshold`` is
    ``dppo_sequence_mask`` here (``DPPOGRPOConfig``).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: Optional[DPPOGRPOConfig] = None, **kwargs: Any):
        if not isinstance(args, DPPOGRPOConfig):
            raise TypeError(f"DPPOGRPOTrainer needs args=DPPOGRPOConfig(...), got {type(args).__name__}")
        unsupported = {
            "entropy_coef": args.entropy_coef != 0.0,
            "use_adaptive_entropy": args.use_adaptive_entropy,
            "top_entropy_quantile": args.top_entropy_quantile < 1.0,
        }
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise ValueError(
                f"DPPOGRPOTrainer does not combine DPPO with TRL's {bad} (set them to their defaults: entropy_coef=0, "
                "use_adaptive_entropy=False, top_entropy_quantile=1.0)"
            )
        colocate = args.use_vllm and args.vllm_mode == "colocate"
        llm_kwargs: dict[str, Any] = {}
        if colocate and args.dppo_vllm_dtype != "auto":
            llm_kwargs["dtype"] = args.dppo_vllm_dtype
        if colocate and args.dppo_vllm_kv_cache_gib is not None:
            llm_kwargs["kv_cache_memory_bytes"] = args.dppo_vllm_kv_cache_bytes
        hf_config = _model_config(model)
        if hf_config is not None:
            check_plain_logits(hf_config, "DPPOGRPOTrainer")  # before TRL starts vLLM (a minute or more)
        if isinstance(model, str) and policy_attn_implementation(hf_config):
            # the policy must soft-cap attention logits as vLLM does (dppo_ext.rollout.vllm_parity)
            init_kwargs = dict(args.model_init_kwargs or {})
            init_kwargs.setdefault("attn_implementation", policy_attn_implementation(hf_config))
            args.model_init_kwargs = init_kwargs
        # TRL checks vLLM's version again when it starts the engine.
        with (
            extra_llm_kwargs(trl_vllm_generation, **llm_kwargs),
            kv_cache_env_lifted(llm_kwargs.get("kv_cache_memory_bytes")),
            tested_vllm_warning_silenced(),
            engine_private_model_classes(hf_config) if colocate and hf_config is not None else contextlib.nullcontext(),
        ):
            super().__init__(model, reward_funcs, args=args, **kwargs)
        self.dppo_weight_sync: Optional[VLLMWeightSync] = None
        if colocate and not args.vllm_enable_sleep_mode:
            engine_len = self.vllm_generation.llm.llm_engine.model_config.max_model_len
            self.dppo_weight_sync = VLLMWeightSync(
                self.vllm_generation,
                self.accelerator.unwrap_model(self.model),
                self._dppo_score,
                sync_check=args.dppo_sync_check,
                max_model_len=engine_len,
            )
            self.vllm_generation.sync_weights = self.dppo_weight_sync
        self._dppo_topk = args.dppo_topk if args.dppo_mode in TOPK_MODES else 0
        if self._dppo_topk:
            if self.tools or self.rollout_func is not None:
                raise ValueError(
                    "the top-K DPPO modes do not support tools or rollout_func (the sampler's top-K is "
                    "kept per generated position of a single turn); use binary_tv or binary_kl"
                )
            self.vllm_generation.logprobs = self._dppo_topk  # TRL asks for 0 (the sampled token only)
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_dppo_head(target, args, self.temperature)
        self._dppo_recompute_noted = False
        self._dppo_topk_pending: Optional[tuple[list, list]] = None

    def _dppo_score(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1] the policy's log-probs of ``ids[1:]`` (raw logits; the sync guard's trainer side)."""
        model = self.model
        training = model.training
        model.eval()
        try:
            with torch.no_grad(), self.accelerator.autocast():
                logits = model(input_ids=torch.tensor([ids], device=self.accelerator.device)).logits[0, :-1]
        finally:
            model.train(training)
        targets = torch.tensor(ids[1:], device=logits.device)
        return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's vLLM branch, keeping the top-K log-probs (top-K modes); otherwise TRL's method unchanged."""
        if not self._dppo_topk:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, logprob_token_ids = self.vllm_generation.generate(
            prompts=prompt_ids,
            images=images,
            num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"),
        )
        sampled, topk_ids, topk_logprobs = split_vllm_logprobs(
            completion_ids, logprobs, logprob_token_ids, self._dppo_topk
        )
        self._dppo_topk_pending = (topk_ids, topk_logprobs)
        return completion_ids, sampled

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self._dppo_topk_pending is not None:
            topk_ids, topk_logprobs = self._dppo_topk_pending
            self._dppo_topk_pending = None
            length, device = output["completion_ids"].size(1), output["completion_ids"].device
            output["dppo_topk_ids"] = pad_topk(topk_ids, length, self._dppo_topk, 0, torch.long, device)
            output["dppo_topk_logprobs"] = pad_topk(
                topk_logprobs, length, self._dppo_topk, -math.inf, torch.float32, device
            )
        if output.get("sampling_per_token_logps") is not None:
            return output
        if not self._dppo_recompute_noted:
            logger.warning(
                "DPPO 'recompute' variant: no rollout log-probs from vLLM (use_vllm=False), so the trust region is "
                "anchored on the old-policy log-probs recomputed by the trainer model, not on the sampler's"
            )
            self._dppo_recompute_noted = True
        if output.get("old_per_token_logps") is None:
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )
            output["old_per_token_logps"] = old
        return output

    def _dppo_rollout(self, inputs: dict[str, Any], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(rollout_logprobs [B, T], mask [B, T], recompute)``: vLLM's log-probs, else the old-policy ones.

        Tokens vLLM could not score (NaN) take the old-policy log-prob when TRL computed it, else leave the loss.
        """
        sampling = inputs.get("sampling_per_token_logps")
        old = inputs.get("old_per_token_logps")
        if sampling is None:
            return old.clamp(max=0.0), mask, True
        unscored = torch.isnan(sampling) & mask
        if unscored.any():
            if old is not None:
                sampling = torch.where(unscored, old, sampling)
            else:
                mask = mask & ~unscored
        return sampling.clamp(max=0.0), mask, False

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if inputs.get("pixel_values") is not None:
            raise ValueError("DPPOGRPOTrainer supports text-only models; got pixel_values in the batch")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask.bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        rollout, mask, recompute = self._dppo_rollout(inputs, mask)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = advantages.expand_as(completion_ids)
        batch = {
            "tokens": completion_ids.masked_fill(~mask, IGNORE_INDEX),
            "rollout_logprobs": torch.where(mask, rollout, torch.zeros_like(rollout)),
            "advantages": torch.where(mask, advantages, torch.zeros_like(advantages)),
        }
        if "dppo_topk_ids" in inputs:
            batch["topk_ids"] = inputs["dppo_topk_ids"]
            batch["topk_logprobs"] = inputs["dppo_topk_logprobs"]
        with self.accelerator.autocast():
            out = model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
                dppo_batch=batch,
            )
        per_token_loss = out.loss
        if self.beta != 0.0:
            ref_diff = inputs["ref_per_token_logps"] - out.logp
            per_token_kl = torch.exp(ref_diff) - ref_diff - 1
            per_token_loss = per_token_loss + self.beta * per_token_kl * mask
        mode = "train" if self.model.training else "eval"
        training = mode == "train"
        loss = micro_batch_loss(
            per_token_loss,
            mask,
            self.args.dppo_loss_agg_mode,
            num_items_in_batch=inputs["num_items_in_batch"],
            accumulation_steps=self.current_gradient_accumulation_steps if training else 1,
            steps_per_generation=self.args.steps_per_generation if training else 1,
            num_processes=self.accelerator.num_processes,
            max_completion_length=self.args.max_completion_length,
        )
        policy_loss = (out.loss * mask).sum() / mask.sum().clamp(min=1)
        self._dppo_log(out, batch, mask, policy_loss, recompute, mode, per_token_kl if self.beta != 0.0 else None)
        return loss

    def _dppo_log(
        self,
        out: DPPOForwardOutput,
        batch: dict[str, torch.Tensor],
        mask: torch.Tensor,
        policy_loss: torch.Tensor,
        recompute: bool,
        mode: str,
        per_token_kl: Optional[torch.Tensor],
    ) -> None:
        """Our metrics (``dppo/<name>``), reduced across processes, into TRL's metric buffer."""
        flat = DPPOOutputs(*(flat_float(t) for t in out.to_tuple()))
        metrics = dppo_metrics(
            flat, flat_float(batch["rollout_logprobs"]), flat_float(batch["advantages"]), mask.reshape(-1)
        )
        if per_token_kl is not None:
            metrics["kl"] = (per_token_kl * mask).sum() / mask.sum().clamp(min=1)
        names = list(metrics)
        local = torch.stack([metrics[n].detach().float() for n in names])
        gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, len(names))
        for i, name in enumerate(names):
            column = gathered[:, i]
            if name in _MAX_METRICS:
                value = column.max()
            elif name in _MIN_METRICS:
                value = column.min()
            elif name == "num_tokens":
                value = column.sum()
            else:
                value = column.mean()
            self._metrics[mode][f"dppo/{name}"].append(value.item())
        self._metrics[mode]["entropy"].append(self._metrics[mode]["dppo/entropy_mean"][-1])
        self._metrics[mode]["dppo/recompute_variant"].append(float(recompute))
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss.detach()).mean().item())


def _model_config(model: Any) -> Any:
    """The transformers config of ``model`` (a model or a model id / folder), or None when there is none."""
    if isinstance(model, str):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model)
    return getattr(model, "config", None)

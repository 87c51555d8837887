"""The DPPO head: a wrapper around a causal LM's ``forward`` that returns the per-token DPPO outputs.

The loss runs inside the model's ``forward``, so DDP, FSDP and DeepSpeed see an ordinary forward/backward. By
default it goes through :func:`dppo_ext.fused_linear_dppo_loss_per_row` from the last hidden states and the LM-head
weight, so no ``[B, T, V]`` logits tensor exists; with ``dppo_fused_linear=False`` the LM head runs as usual and
the logits op is applied to its output.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from ...contract import check_logits_dtype_setting
from ...fused_linear import fused_linear_dppo_loss_per_row
from ...loss import dppo_loss_per_row
from ...models.lm_head import check_plain_logits
from ...sequence_mask import SequenceMask
from .config import DPPOGRPOConfig
from .versions import import_trl

import_trl()
from transformers.utils import ModelOutput  # noqa: E402
from trl.trainer.utils import maybe_gather_lm_head_ctx  # noqa: E402  (after the version check)

__all__ = ["DPPOForwardOutput", "add_dppo_head", "flat_float"]


@dataclass
class DPPOForwardOutput(ModelOutput):
    """Per-token DPPO outputs of the patched forward, each ``[B, T]`` float32 (0 at padding)."""

    loss: Optional[torch.Tensor] = None
    logp: Optional[torch.Tensor] = None
    divergence: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None


def flat_float(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` as a contiguous 1-D float32 tensor (``None`` stays ``None``)."""
    return None if t is None else t.reshape(-1).float().contiguous()


def add_dppo_head(model: torch.nn.Module, args: DPPOGRPOConfig, temperature: float) -> None:
    """Wrap ``model.forward`` so that ``model(input_ids, attention_mask, dppo_batch=batch)`` returns DPPO outputs.

    ``batch`` is a dict of ``[B, T]`` tensors for the last ``T`` positions (the completion): ``tokens`` (int64,
    -100 at padding), ``rollout_logprobs``, ``advantages`` (float32), optionally ``anchor_logprobs`` and, for
    the top-K modes, ``topk_ids`` / ``topk_logprobs`` ``[B, T, K]``. The backbone runs on the whole sequence; the
    hidden states that predict the completion tokens go through the LM head and the DPPO op (fused, or via
    logits with ``args.dppo_fused_linear=False``). Without ``dppo_batch`` the previous forward runs unchanged
    (generation, TRL's own log-prob passes). Models that transform the LM head's output (logit soft-capping or
    scaling in their forward) are rejected: the loss would see different logits than the model's.
    """
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or not hasattr(model, "base_model"):
        raise ValueError(
            f"add_dppo_head needs a causal LM with an LM head (model.get_output_embeddings() with a weight, and "
            f"model.base_model), got {type(model).__name__} whose output embeddings are {type(head).__name__}; "
            f"load the model with AutoModelForCausalLM"
        )
    check_plain_logits(model.config, "DPPOGRPOTrainer")
    previous_forward = model.forward
    delta_low, delta_high = args.dppo_deltas
    sequence_mask = SequenceMask.from_config(args.dppo_sequence_mask, "dppo_sequence_mask")

    @functools.wraps(type(model).forward)
    def _forward(self, *f_args: Any, dppo_batch: Optional[dict[str, torch.Tensor]] = None, **kwargs: Any):
        if dppo_batch is None:
            return previous_forward(*f_args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*f_args, **kwargs).last_hidden_state
        tokens = dppo_batch["tokens"]
        batch, length = tokens.shape
        hidden = hidden[:, -length - 1 : -1]
        head = self.get_output_embeddings()
        topk_ids = dppo_batch.get("topk_ids")
        topk_logprobs = dppo_batch.get("topk_logprobs")
        op_kwargs = dict(
            topk_ids=None if topk_ids is None else topk_ids.reshape(batch * length, -1),
            topk_logprobs=None if topk_logprobs is None else topk_logprobs.reshape(batch * length, -1).float(),
            anchor_logprobs=flat_float(dppo_batch.get("anchor_logprobs")),
            mode=args.dppo_mode,
            mask_direction=args.dppo_mask_direction,
            kl_tau=args.dppo_kl_tau,
            kl_mask_type=args.dppo_kl_mask_type,
            sequence_mask=sequence_mask,
            # each completion one sequence (only read with a sequence mask)
            sequence_ids=torch.arange(batch, device=tokens.device).repeat_interleave(length),
            temperature=temperature,
            delta_low=delta_low,
            delta_high=delta_high,
            ratio_cap=args.dppo_ratio_cap,
            compute_entropy=True,
        )
        flat_tokens = tokens.reshape(-1)
        rollout = flat_float(dppo_batch["rollout_logprobs"])
        advantages = flat_float(dppo_batch["advantages"])
        if args.dppo_fused_linear:
            weight, bias = head.weight, head.bias
            if isinstance(weight, DTensor):  # FSDP2 shards: the fused matmul needs the whole head
                weight = weight.full_tensor()
                bias = bias.full_tensor() if bias is not None else None
            gather = functools.partial(maybe_gather_lm_head_ctx, weight, bias)
            # Under autocast the LM head would run in the autocast dtype: do the same, explicitly (the fused
            # function writes into preallocated buffers, which autocast does not handle).
            device_type = hidden.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
            with torch.autocast(device_type, enabled=False), gather():
                out = fused_linear_dppo_loss_per_row(
                    hidden.reshape(batch * length, -1).to(dtype),
                    weight.to(dtype),
                    flat_tokens,
                    rollout,
                    advantages,
                    bias=None if bias is None else bias.to(dtype),
                    chunk_size=args.dppo_chunk_size,
                    logits_dtype=check_logits_dtype_setting(args.dppo_logits_dtype),
                    weight_context=gather,
                    **op_kwargs,
                )
        else:
            logits = head(hidden)
            out = dppo_loss_per_row(logits.reshape(batch * length, -1), flat_tokens, rollout, advantages, **op_kwargs)
        return DPPOForwardOutput(*(t.view(batch, length) for t in out))

    model.forward = types.MethodType(_forward, model)

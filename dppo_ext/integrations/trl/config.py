"""``DPPOGRPOConfig``: TRL's ``GRPOConfig`` plus the DPPO settings, checked when the config is built.

How TRL's own loss fields map (docs/names.md): ``loss_type`` picks the aggregation where it is one; TRL's ratio
clips are an error that names the ``dppo_*`` field to use; the fields of TRL's other loss formulas get a warning.
Truncated sampling (``top_p`` < 1, ``top_k`` > 0, ``min_p`` > 0, here or in ``generation_kwargs``) is refused with
the fix: the loss scores pi over the whole vocabulary, the rollout's mu is of the truncated distribution.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ...contract import (
    AGG_MODES,
    DEFAULT_DELTAS,
    MODE_ALIASES,
    MODEL_DTYPES,
    MODES,
    NORM_AGG_MODES,
    TOPK_MODES,
    canonical_mode,
    check_logits_dtype_setting,
    check_settings,
    refuse_truncated_sampling,
    resolve_deltas,
)
from ...sequence_mask import SequenceMask, check_kl_settings
from .versions import import_trl

import_trl()
from trl import GRPOConfig  # noqa: E402  (after the version check)

__all__ = ["DPPOGRPOConfig", "VLLM_DTYPES"]

# dtypes the colocated vLLM engine may be asked for (dppo_vllm_dtype): vLLM's "auto" or a model dtype.
VLLM_DTYPES = ("auto", *MODEL_DTYPES)
# Bytes per GiB of dppo_vllm_kv_cache_gib (vLLM takes the KV-cache size as an int number of bytes).
GIB = 2**30
# TRL's loss_type -> our loss_agg_mode, for the loss types that are an aggregation (docs/aggregation.md).
_TRL_DEFAULT_LOSS_TYPE = "dapo"
_TRL_LOSS_TYPE_AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
# GRPOConfig fields of TRL's own policy losses that the DPPO loss does not read (loss_type is mapped to an
# aggregation and the ratio clips epsilon / epsilon_high / delta are refused, see _check_trl_loss_fields); setting
# one to a non-default value gets a warning. (vllm_importance_sampling_correction is not listed: both of its values
# give the same DPPO loss, whose weight min(pi / mu, C) already corrects against mu.)
_IGNORED_TRL_LOSS_FIELDS = (
    "importance_sampling_level",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
)


@dataclass
class DPPOGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the DPPO settings.

    TRL's own loss fields: ``loss_type`` picks the aggregation when ``dppo_loss_agg_mode`` is not given
    (``dapo`` -> ``token-mean``, ``grpo`` -> ``seq-mean-token-mean``, ``dr_grpo`` -> ``seq-mean-token-sum-norm``,
    docs/aggregation.md); the others are loss formulas of their own and are rejected. ``epsilon``,
    ``epsilon_high`` and ``delta`` are ratio clips, a different quantity from DPPO's divergence thresholds: setting
    them is an error that names the ``dppo_*`` field to use (docs/names.md).

    Attributes:
        dppo_mode: ``binary_tv`` | ``binary_kl`` | ``topk_tv`` | ``topk_kl`` | ``ratio`` | ``none``
            (docs/contract.md), or an alias such as verl's ``dppo_tv`` / ``dppo_kl`` (stored as ours). The top-K
            modes need ``use_vllm=True`` and ``dppo_topk > 0``.
        dppo_topk: K, the number of rollout top-K log-probs per token requested from vLLM (top-K modes).
        dppo_delta_low, dppo_delta_high: trust-region thresholds; ``None`` -> ``dppo_ext.DEFAULT_DELTAS[mode]``.
        dppo_ratio_cap: cap C of the importance weight ``min(pi / mu, C)``.
        dppo_mask_direction: ``"advantage"`` (the paper's) or ``"symmetric"`` (IPO with ``binary_tv``, IcePop with
            ``ratio``: ``dppo_delta_low, dppo_delta_high = dppo_ext.icepop_deltas(low, high)``); docs/contract.md.
        dppo_kl_tau, dppo_kl_mask_type: prime-rl's ``kl_tau * (log pi - log mu)^2`` on the response tokens
            ``dppo_kl_mask_type`` picks (``all``, ``unmasked``, ``masked``); 0: off.
        dppo_sequence_mask: a sequence-level mask (docs/contract.md, "Sequence masks"): the fields of
            ``dppo_ext.SequenceMask`` as a dict (``{"statistic": "k1", "reduce": "sum", "high": ..., "low": ...,
            "negative_advantages_only": False}``; a ``SequenceMask`` or the dict as JSON also do), stored as that
            dict; each completion is one sequence; None: off. TRL's own ``vllm_importance_sampling_mode=
            "sequence_mask"`` band is ``SequenceMask.from_trl(...).to_config()`` and its ``off_policy_mask_threshold``
            ``SequenceMask.off_policy(t).to_config()`` (docs/names.md).
        dppo_loss_agg_mode: ``None`` (from ``loss_type``, default ``token-mean``), ``token-mean`` (over all
            completion tokens of the generation batch on all processes, like TRL's ``dapo``), ``token-sum`` /
            ``token-sum-norm`` (sums over the optimizer step's micro-batches and processes) or a sequence mode of
            ``dppo_ext.AGG_MODES`` (per micro-batch, averaged). The ``-norm`` modes divide by
            ``max_completion_length`` (as TRL's ``dr_grpo``).
        dppo_fused_linear: compute the loss from hidden states + LM-head weight (no logits tensor).
        dppo_chunk_size: rows per fused-linear chunk; ``None`` chooses from the sizes.
        dppo_logits_dtype: ``None`` (the LM head's logits in the model's dtype) or ``"float32"``: with a bf16/fp16
            model the fused LM head computes and keeps its logits in float32 without a float32 copy of the weight
            (``fused_linear_dppo_loss(logits_dtype=torch.float32)``; needs ``dppo_fused_linear=True``).
        dppo_vllm_dtype: dtype of the colocated vLLM engine (``vllm_mode="colocate"``); ``auto`` is vLLM's choice,
            which runs a float32 checkpoint in bfloat16 or float16, so ``|pi - mu|`` then includes that rounding.
        dppo_sync_check: after every weight sync into the colocated vLLM engine, score the first sequence of the
            latest generation in vLLM and with the policy, and raise when their log-probs differ by more than the
            dtypes explain (a stale weight or LM head; ``dppo_ext.rollout.sync_guard.SyncGuard``).
        dppo_vllm_kv_cache_gib: KV-cache size of the colocated vLLM engine in GiB; ``None``: vLLM sizes it from
            ``vllm_gpu_memory_utilization``, which on CPU is a share of the machine's RAM (0.3 by TRL's default)
            that must be free when the engine starts, or it refuses to start.
        bf16: TRL's bf16 autocast of the trainer. ``None`` (default): TRL's rule (``True`` unless ``fp16``) where the
            trainer runs on an accelerator, ``False`` where it runs on the CPU (``use_cpu=True`` or no accelerator):
            a bf16 trainer next to a float32 engine makes pi and mu differ by the bf16 rounding (docs/trl.md,
            "Precision"), and TRL's ``True`` stops a CPU-only machine unless ``use_cpu=True`` is set.
    """

    dppo_mode: str = field(
        default="binary_tv",
        metadata={"help": f"DPPO mode: one of {MODES} or an alias (verl's dppo_tv/dppo_kl): {tuple(MODE_ALIASES)}."},
    )
    dppo_topk: int = field(default=0, metadata={"help": "K: rollout top-K log-probs per token (top-K modes)."})
    dppo_delta_low: Optional[float] = field(
        default=None, metadata={"help": "Lower threshold (A <= 0 side); None: the mode's default."}
    )
    dppo_delta_high: Optional[float] = field(
        default=None, metadata={"help": "Upper threshold (A > 0 side); None: the mode's default."}
    )
    dppo_ratio_cap: float = field(default=10.0, metadata={"help": "Cap C of the importance weight min(pi/mu, C)."})
    dppo_mask_direction: str = field(
        default="advantage",
        metadata={"help": "Mask direction: advantage (the paper's) or symmetric (IPO, IcePop)."},
    )
    dppo_kl_tau: float = field(default=0.0, metadata={"help": "kl_tau * (log pi - log mu)^2 on the loss; 0: off."})
    dppo_kl_mask_type: str = field(
        default="all", metadata={"help": "Tokens of the kl_tau penalty: all, unmasked (kept) or masked."}
    )
    dppo_sequence_mask: Optional[Union[dict, str]] = field(
        default=None,
        metadata={
            "help": "Sequence-level mask: the dppo_ext.SequenceMask fields as a dict or JSON, e.g. "
            '\'{"statistic": "k1", "reduce": "sum", "low": -1.0986, "high": null}\' (TRL\'s sequence_mask with '
            "clip_max 3); None: off."
        },
    )
    dppo_loss_agg_mode: Optional[str] = field(
        default=None, metadata={"help": f"One of {AGG_MODES}; None: from TRL's loss_type (dapo -> token-mean)."}
    )
    dppo_fused_linear: bool = field(
        default=True, metadata={"help": "Fused LM head + loss (no [B, T, V] logits); False: the logits path."}
    )
    dppo_chunk_size: Optional[int] = field(
        default=None, metadata={"help": "Rows per fused-linear chunk; None: automatic."}
    )
    dppo_logits_dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": "None: the fused LM head's logits in the model's dtype; float32: in float32 from bf16/fp16 "
            "hidden states and weight (an fp32 LM head, no fp32 weight copy)."
        },
    )
    dppo_vllm_dtype: str = field(
        default="auto",
        metadata={
            "help": "dtype of the colocated vLLM engine: auto (vLLM's choice; it runs a float32 checkpoint in "
            "bfloat16/float16), float32, bfloat16 or float16."
        },
    )
    dppo_sync_check: bool = field(
        default=True,
        metadata={
            "help": "After every weight sync into the colocated vLLM engine, check that vLLM's log-probs of the "
            "latest generation's first sequence equal the policy's; False skips it."
        },
    )
    dppo_vllm_kv_cache_gib: Optional[float] = field(
        default=None,
        metadata={
            "help": "KV-cache size of the colocated vLLM engine in GiB; None: from vllm_gpu_memory_utilization "
            "(on CPU a share of the RAM that must be free at start)."
        },
    )

    bf16: Optional[bool] = field(
        default=None,
        metadata={
            "help": "bf16 (mixed) precision autocast of the trainer. None: True on a GPU (TRL's default, unless "
            "fp16), False on the CPU (use_cpu=True or no accelerator), where bf16 rounding would show "
            "up as pi/mu mismatch."
        },
    )

    def __post_init__(self) -> None:
        self._check_dppo_field_types()  # before anything compares or computes with them
        self._warn_ignored_trl_fields()  # before GRPOConfig's own __post_init__ rewrites any of them
        if self.bf16 is None:
            self.bf16 = not self.fp16 and not _trains_on_cpu(self.use_cpu)
        super().__post_init__()
        check_settings(
            self.dppo_mode,
            self.temperature,
            self.dppo_delta_low,
            self.dppo_delta_high,
            self.dppo_ratio_cap,
            prefix="dppo_",
            mask_direction=self.dppo_mask_direction,
        )
        check_kl_settings(self.dppo_kl_tau, self.dppo_kl_mask_type, prefix="dppo_")
        mask = SequenceMask.from_config(self.dppo_sequence_mask, "dppo_sequence_mask")
        self.dppo_sequence_mask = None if mask is None else mask.to_config()
        if self.off_policy_mask_threshold is not None:
            threshold = self.off_policy_mask_threshold
            raise ValueError(
                f"off_policy_mask_threshold={threshold!r} is TRL's off-policy sequence mask; DPPOGRPOConfig takes it "
                f"as dppo_sequence_mask=dppo_ext.SequenceMask.off_policy({threshold!r}).to_config() (the same mask, "
                "one setting for every sequence mask): set that and leave off_policy_mask_threshold=None"
            )
        self.dppo_mode = canonical_mode(self.dppo_mode)
        if self.dppo_mode in TOPK_MODES and (not self.use_vllm or self.dppo_topk < 1):
            raise ValueError(
                f"dppo_mode={self.dppo_mode!r} needs the rollout's top-K log-probs: set use_vllm=True and "
                f"dppo_topk=K >= 1 (got use_vllm={self.use_vllm}, dppo_topk={self.dppo_topk})"
            )
        self._check_trl_loss_fields()
        self._refuse_truncated_sampling()
        if self.dppo_loss_agg_mode not in AGG_MODES:
            raise ValueError(f"dppo_loss_agg_mode must be one of {AGG_MODES}, got {self.dppo_loss_agg_mode!r}")
        if self.dppo_loss_agg_mode in NORM_AGG_MODES and not (self.max_completion_length or 0) > 0:
            raise ValueError(
                f"dppo_loss_agg_mode={self.dppo_loss_agg_mode!r} divides by max_completion_length, which must be a "
                f"positive int, got {self.max_completion_length!r}"
            )

    def _check_dppo_field_types(self) -> None:
        """The ``dppo_*`` fields whose type decides their meaning: a float K or chunk size, a string flag (``"False"``
        is truthy) or a KV-cache size that rounds to no byte would otherwise fail deep in the trainer or mean
        something else. (Mode, thresholds, cap and aggregation are checked by value in ``__post_init__``.)"""
        _check_int("dppo_topk", self.dppo_topk, minimum=0, meaning="K, the rollout top-K log-probs per token")
        _check_int(
            "dppo_chunk_size", self.dppo_chunk_size, minimum=1, meaning="rows per fused-linear chunk", none="automatic"
        )
        for name in ("dppo_fused_linear", "dppo_sync_check"):
            _check_bool(name, getattr(self, name))
        check_logits_dtype_setting(self.dppo_logits_dtype, "dppo_logits_dtype")
        if self.dppo_logits_dtype is not None and not self.dppo_fused_linear:
            raise ValueError(
                f"dppo_logits_dtype={self.dppo_logits_dtype!r} sets the fused LM head's logits dtype: it needs "
                "dppo_fused_linear=True (got False); the logits path uses the model's own LM head"
            )
        if not (isinstance(self.dppo_vllm_dtype, str) and self.dppo_vllm_dtype in VLLM_DTYPES):
            raise ValueError(f"dppo_vllm_dtype must be one of {VLLM_DTYPES}, got {self.dppo_vllm_dtype!r}")
        gib = self.dppo_vllm_kv_cache_gib
        if gib is not None and (
            isinstance(gib, bool) or not isinstance(gib, (int, float)) or not (math.isfinite(gib) and gib > 0)
        ):
            raise ValueError(
                f"dppo_vllm_kv_cache_gib must be a finite number of GiB > 0 or None (vLLM's sizing), got {gib!r}"
            )
        if gib is not None and self.dppo_vllm_kv_cache_bytes < 1:
            raise ValueError(
                f"dppo_vllm_kv_cache_gib={gib!r} is {gib * GIB!r} bytes, which vLLM's whole-byte size "
                f"rounds down to 0 (no KV cache at all); give a size that holds the KV cache of at least "
                f"one sequence (e.g. 0.5 GiB) or None (vLLM's sizing)"
            )

    @property
    def dppo_vllm_kv_cache_bytes(self) -> Optional[int]:
        """``dppo_vllm_kv_cache_gib`` in whole bytes (vLLM's ``kv_cache_memory_bytes``), or None."""
        gib = self.dppo_vllm_kv_cache_gib
        return None if gib is None else int(gib * GIB)

    def _check_trl_loss_fields(self) -> None:
        """Resolve ``dppo_loss_agg_mode`` from TRL's ``loss_type``; reject TRL's ratio clips (docs/names.md)."""
        if self.loss_type != _TRL_DEFAULT_LOSS_TYPE and self.dppo_loss_agg_mode is not None:
            raise ValueError(
                f"set either loss_type (TRL's name) or dppo_loss_agg_mode, not both: got loss_type={self.loss_type!r} "
                f"and dppo_loss_agg_mode={self.dppo_loss_agg_mode!r}"
            )
        if self.dppo_loss_agg_mode is None:
            if self.loss_type not in _TRL_LOSS_TYPE_AGG:
                raise ValueError(
                    f"loss_type={self.loss_type!r} is a TRL loss formula of its own, not an aggregation DPPO can use; "
                    f"set dppo_loss_agg_mode to one of {AGG_MODES} (loss_type maps only {dict(_TRL_LOSS_TYPE_AGG)})"
                )
            self.dppo_loss_agg_mode = _TRL_LOSS_TYPE_AGG[self.loss_type]
        ratio_clips = {
            "epsilon": (self.epsilon, 0.2),
            "epsilon_high": (self.epsilon_high, None),
            "delta": (self.delta, None),
        }
        changed = {name: value for name, (value, default) in ratio_clips.items() if value != default}
        if changed:
            raise ValueError(
                f"DPPOGRPOTrainer does not read TRL's ratio-clip fields {changed}: DPPO's thresholds bound a "
                f"divergence (binary_tv default {DEFAULT_DELTAS['binary_tv']}), not the ratio pi/pi_old. Set "
                f"dppo_delta_low / dppo_delta_high (for dppo_mode='ratio' these are the same clip as epsilon / "
                f"epsilon_high) and leave epsilon, epsilon_high and delta at TRL's defaults (0.2, None, None)"
            )

    def _refuse_truncated_sampling(self) -> None:
        """TRL's ``top_p`` / ``top_k`` / ``min_p`` (and the same keys in ``generation_kwargs``, which TRL passes to
        the sampler over them) must sample from the whole distribution (``dppo_ext.contract``)."""
        extra = self.generation_kwargs if isinstance(self.generation_kwargs, dict) else {}
        for where, values in (("", vars(self)), ("generation_kwargs", extra)):
            names = {key: f"{where}[{key!r}]" if where else key for key in ("top_k", "top_p", "min_p")}
            if where and not any(key in values for key in names):
                continue
            top_k, top_p, min_p = (values.get(key) for key in ("top_k", "top_p", "min_p"))
            refuse_truncated_sampling(
                top_k,
                1.0 if top_p is None else top_p,
                min_p,
                names=names,
                fix="top_p=1.0, top_k=0 and min_p=None (GRPOConfig's defaults), none of them in generation_kwargs",
            )

    def _warn_ignored_trl_fields(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        changed = {
            name: getattr(self, name)
            for name in _IGNORED_TRL_LOSS_FIELDS
            if name in defaults and getattr(self, name) != defaults[name]
        }
        if changed:
            warnings.warn(
                f"DPPOGRPOConfig: the DPPO loss ignores TRL's own loss settings {changed}; set the DPPO ones instead "
                f"(dppo_mode, dppo_delta_low, dppo_delta_high, dppo_ratio_cap, dppo_loss_agg_mode)",
                UserWarning,
                stacklevel=4,
            )

    @property
    def dppo_deltas(self) -> tuple[float, float]:
        """``(delta_low, delta_high)`` with the mode's defaults filled in."""
        return resolve_deltas(self.dppo_mode, self.dppo_delta_low, self.dppo_delta_high)


def _check_int(name: str, value: object, *, minimum: int, meaning: str, none: Optional[str] = None) -> None:
    """``value`` must be an int >= ``minimum`` (a bool or a float such as 2.5 or 64.0 is refused: no silent
    truncation), or None where ``none`` says what None means."""
    if value is None and none is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an int >= {minimum}" + ("" if none is None else f" or None ({none})")
        raise ValueError(f"{name} ({meaning}) must be {expected}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    """The one check of every boolean ``dppo_*`` switch: ``True`` or ``False`` only (a string such as ``"False"``
    is truthy in Python, 1 or None are no answer: each is refused, never read as on)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _trains_on_cpu(use_cpu: bool) -> bool:
    """Whether the trainer will run on the CPU: ``use_cpu=True``, or no accelerator in this process."""
    return bool(use_cpu) or not torch.accelerator.is_available()

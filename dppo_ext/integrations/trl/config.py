"""``DPPOGRPOConfig``: TRL's ``GRPOConfig`` plus the DPPO settings, checked when the config is built.

How TRL's own loss fields map (docs/names.md): ``loss_type`` picks the aggregation where it is one; TRL's ratio
clips are an error that names the ``dppo_*`` field to use; the fields of TRL's other loss formulas get a warning.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Optional

from ...contract import (
    AGG_MODES,
    DEFAULT_DELTAS,
    MODE_ALIASES,
    MODES,
    NORM_AGG_MODES,
    TOPK_MODES,
    canonical_mode,
    check_settings,
    resolve_deltas,
)
from .versions import import_trl

import_trl()
from trl import GRPOConfig  # noqa: E402  (after the version check)

__all__ = ["DPPOGRPOConfig", "VLLM_DTYPES"]

# dtypes the colocated vLLM engine may be asked for (dppo_vllm_dtype).
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
# TRL's loss_type -> our loss_agg_mode, for the loss types that are an aggregation (docs/aggregation.md).
_TRL_DEFAULT_LOSS_TYPE = "dapo"
_TRL_LOSS_TYPE_AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
# GRPOConfig fields of TRL's own policy losses that the DPPO loss does not read (loss_type is mapped to an
# aggregation and the ratio clips epsilon / epsilon_high / delta are refused, see _check_trl_loss_fields); setting
# one to a non-default value gets a warning. (vllm_importance_sampling_correction is not listed: both of its values
# give the same DPPO loss, whose weight min(pi / mu, C) already corrects against mu.)
_IGNORED_TRL_LOSS_FIELDS = (
    "importance_sampling_level", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
    "vespo_k_neg", "vespo_lambda_neg", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
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
        dppo_loss_agg_mode: ``None`` (from ``loss_type``, default ``token-mean``), ``token-mean`` (over all
            completion tokens of the generation batch on all processes, like TRL's ``dapo``), ``token-sum`` /
            ``token-sum-norm`` (sums over the optimizer step's micro-batches and processes) or a sequence mode of
            ``dppo_ext.AGG_MODES`` (per micro-batch, averaged). The ``-norm`` modes divide by
            ``max_completion_length`` (as TRL's ``dr_grpo``).
        dppo_fused_linear: compute the loss from hidden states + LM-head weight (no logits tensor).
        dppo_chunk_size: rows per fused-linear chunk; ``None`` chooses from the sizes.
        dppo_vllm_dtype: dtype of the colocated vLLM engine (``vllm_mode="colocate"``); ``auto`` is vLLM's choice,
            which runs a float32 checkpoint in bfloat16 or float16, so ``|pi - mu|`` then includes that rounding.
        dppo_sync_check: after every weight sync into the colocated vLLM engine, score the first sequence of the
            latest generation in vLLM and with the policy, and raise when their log-probs differ by more than the
            dtypes explain (a stale weight or LM head; ``dppo_ext.rollout.weight_sync.SyncGuard``).
        dppo_vllm_kv_cache_gib: KV-cache size of the colocated vLLM engine in GiB; ``None``: vLLM sizes it from
            ``vllm_gpu_memory_utilization``, which on CPU is a share of the machine's RAM (0.3 by TRL's default)
            that must be free when the engine starts, or it refuses to start.
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
    dppo_loss_agg_mode: Optional[str] = field(
        default=None, metadata={"help": f"One of {AGG_MODES}; None: from TRL's loss_type (dapo -> token-mean)."}
    )
    dppo_fused_linear: bool = field(
        default=True, metadata={"help": "Fused LM head + loss (no [B, T, V] logits); False: the logits path."}
    )
    dppo_chunk_size: Optional[int] = field(
        default=None, metadata={"help": "Rows per fused-linear chunk; None: automatic."}
    )
    dppo_vllm_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the colocated vLLM engine: auto (vLLM's choice; it runs a float32 checkpoint in "
                          "bfloat16/float16), float32, bfloat16 or float16."},
    )
    dppo_sync_check: bool = field(
        default=True,
        metadata={"help": "After every weight sync into the colocated vLLM engine, check that vLLM's log-probs of the "
                          "latest generation's first sequence equal the policy's; False skips it."},
    )
    dppo_vllm_kv_cache_gib: Optional[float] = field(
        default=None,
        metadata={"help": "KV-cache size of the colocated vLLM engine in GiB; None: from vllm_gpu_memory_utilization "
                          "(on CPU a share of the RAM that must be free at start)."},
    )

    def __post_init__(self) -> None:
        self._warn_ignored_trl_fields()  # before GRPOConfig's own __post_init__ rewrites any of them
        super().__post_init__()
        check_settings(self.dppo_mode, self.temperature, self.dppo_delta_low, self.dppo_delta_high,
                       self.dppo_ratio_cap, prefix="dppo_")
        self.dppo_mode = canonical_mode(self.dppo_mode)
        if self.dppo_topk < 0:
            raise ValueError(f"dppo_topk must be >= 0, got {self.dppo_topk}")
        if self.dppo_mode in TOPK_MODES and (not self.use_vllm or self.dppo_topk < 1):
            raise ValueError(
                f"dppo_mode={self.dppo_mode!r} needs the rollout's top-K log-probs: set use_vllm=True and "
                f"dppo_topk=K >= 1 (got use_vllm={self.use_vllm}, dppo_topk={self.dppo_topk})"
            )
        self._check_trl_loss_fields()
        if self.dppo_loss_agg_mode not in AGG_MODES:
            raise ValueError(f"dppo_loss_agg_mode must be one of {AGG_MODES}, got {self.dppo_loss_agg_mode!r}")
        if self.dppo_loss_agg_mode in NORM_AGG_MODES and not (self.max_completion_length or 0) > 0:
            raise ValueError(
                f"dppo_loss_agg_mode={self.dppo_loss_agg_mode!r} divides by max_completion_length, which must be a "
                f"positive int, got {self.max_completion_length!r}")
        if self.dppo_chunk_size is not None and self.dppo_chunk_size < 1:
            raise ValueError(f"dppo_chunk_size must be a positive int or None, got {self.dppo_chunk_size}")
        if self.dppo_vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"dppo_vllm_dtype must be one of {VLLM_DTYPES}, got {self.dppo_vllm_dtype!r}")
        gib = self.dppo_vllm_kv_cache_gib
        if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float))
                                or not (math.isfinite(gib) and gib > 0)):
            raise ValueError(f"dppo_vllm_kv_cache_gib must be a finite number of GiB > 0 or None (vLLM's sizing), "
                             f"got {gib!r}")

    def _check_trl_loss_fields(self) -> None:
        """Resolve ``dppo_loss_agg_mode`` from TRL's ``loss_type``; reject TRL's ratio clips (docs/names.md)."""
        if self.loss_type != _TRL_DEFAULT_LOSS_TYPE and self.dppo_loss_agg_mode is not None:
            raise ValueError(
                f"set either loss_type (TRL's name) or dppo_loss_agg_mode, not both: got loss_type={self.loss_type!r} "
                f"and dppo_loss_agg_mode={self.dppo_loss_agg_mode!r}")
        if self.dppo_loss_agg_mode is None:
            if self.loss_type not in _TRL_LOSS_TYPE_AGG:
                raise ValueError(
                    f"loss_type={self.loss_type!r} is a TRL loss formula of its own, not an aggregation DPPO can use; "
                    f"set dppo_loss_agg_mode to one of {AGG_MODES} (loss_type maps only {dict(_TRL_LOSS_TYPE_AGG)})")
            self.dppo_loss_agg_mode = _TRL_LOSS_TYPE_AGG[self.loss_type]
        ratio_clips = {"epsilon": (self.epsilon, 0.2), "epsilon_high": (self.epsilon_high, None),
                       "delta": (self.delta, None)}
        changed = {name: value for name, (value, default) in ratio_clips.items() if value != default}
        if changed:
            raise ValueError(
                f"DPPOGRPOTrainer does not read TRL's ratio-clip fields {changed}: DPPO's thresholds bound a "
                f"divergence (binary_tv default {DEFAULT_DELTAS['binary_tv']}), not the ratio pi/pi_old. Set "
                f"dppo_delta_low / dppo_delta_high (for dppo_mode='ratio' these are the same clip as epsilon / "
                f"epsilon_high) and leave epsilon, epsilon_high and delta at TRL's defaults (0.2, None, None)")

    def _warn_ignored_trl_fields(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        changed = {name: getattr(self, name) for name in _IGNORED_TRL_LOSS_FIELDS
                   if name in defaults and getattr(self, name) != defaults[name]}
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

"""The constants, defaults and setting rules of docs/contract.md (and the mode names of docs/names.md), in one place.

Every entry point that computes the loss (``dppo_loss_per_row``, ``dppo_loss``, ``DPPOLoss``, the fused-linear
and vocabulary-parallel functions, the TRL integration) and the readable reference take their modes, the ignore
index, the per-mode default thresholds and the numeric constants of the contract from here, so a threshold left at
``None`` means the same thing everywhere. Pure Python: no compiled code is imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Optional

import torch

__all__ = [
    "AGG_MODES",
    "DEFAULT_AGG_MODE",
    "DEFAULT_DELTAS",
    "DEFAULT_MASK_DIRECTION",
    "DEFAULT_MODE",
    "DEFAULT_RATIO_CAP",
    "IGNORE_INDEX",
    "LOGITS_DTYPES",
    "LOGITS_DTYPE_SETTINGS",
    "LOG_RATIO_CLAMP",
    "MASK_DIRECTIONS",
    "MASS_FLOOR",
    "MAX_LOGIT_NOISE",
    "MODEL_DTYPES",
    "MODES",
    "MODE_ALIASES",
    "NORM_AGG_MODES",
    "ROLLOUT_WEIGHT_BITS",
    "SUM_AGG_MODES",
    "TOPK_MODES",
    "accumulation_dtype",
    "canonical_mode",
    "check_aggregation",
    "check_logits_dtype_setting",
    "check_mask_direction",
    "check_settings",
    "check_token_ids",
    "icepop_deltas",
    "refuse_truncated_sampling",
    "resolve_deltas",
    "sampling_truncation",
]

MODES = ("binary_tv", "binary_kl", "topk_tv", "topk_kl", "ratio", "none")
TOPK_MODES = ("topk_tv", "topk_kl")
# Other projects' names for our modes, accepted wherever a mode is (docs/names.md): verl's
# ``policy_loss.loss_mode`` and the paper's verl fork (sail-sg/Stable-RL, also our trainer's --loss).
MODE_ALIASES = {
    "dppo_tv": "binary_tv",
    "dppo_kl": "binary_kl",
    "dppo_binary_tv": "binary_tv",
    "dppo_binary_kl": "binary_kl",
    "dppo_topk_tv": "topk_tv",
    "dppo_topk_kl": "topk_kl",
}
# Which side of the trust region the mask tests (docs/contract.md, "Mask"): "advantage" (the paper's DPPO: the side
# the advantage pushes towards) or "symmetric" (both sides whatever the advantage: prime-rl's IPO with binary_tv,
# IcePop with ratio). csrc/dppo_math.h's MaskDirection.
MASK_DIRECTIONS = ("advantage", "symmetric")
DEFAULT_MASK_DIRECTION = "advantage"
# Loss aggregation (docs/aggregation.md). The names and formulas are current verl's ``agg_loss``
# (verl-project/verl, verl/trainer/ppo/core_algos.py, since its PR 5417), plus ``token-sum-norm``: the
# formula the paper's verl fork (sail-sg/Stable-RL) runs under the name ``seq-mean-token-sum-norm``.
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "token-sum-norm",
)
# Modes divided by a horizon: ``loss_scale_factor``, default the padded length T = mask.shape[-1].
NORM_AGG_MODES = ("seq-mean-token-sum-norm", "token-sum-norm")
# Modes that add up over a split of the batch (no mean over tokens or sequences).
SUM_AGG_MODES = ("token-sum", "token-sum-norm")
# A token id (or label) of -100 marks a padding row: the op skips it (every output and its gradient are 0), as
# torch.nn.functional.cross_entropy skips its ignore_index; response_mask == 0 becomes this token.
IGNORE_INDEX = -100
# (delta_low, delta_high) when a threshold is None. TV thresholds bound a probability difference, KL ones a
# divergence in nats (the paper's Binary-TV 0.15 / Binary-KL 0.05 scale), ratio ones the PPO/DAPO clip.
DEFAULT_DELTAS = {
    "binary_tv": (0.15, 0.15),
    "topk_tv": (0.15, 0.15),
    "binary_kl": (0.05, 0.05),
    "topk_kl": (0.05, 0.05),
    "ratio": (0.2, 0.28),
    "none": (0.0, 0.0),
}
# The entry points' defaults for the other settings.
DEFAULT_MODE = "binary_tv"
DEFAULT_RATIO_CAP = 10.0  # cap C of the importance weight min(pi / mu, C)
DEFAULT_AGG_MODE = "token-mean"
# Log-ratios log(pi / mu) are clamped here before exp, so that a ratio never overflows: the importance weight
# min(exp(min(logp - m, 20)), C), the ratio_max metric, and (on both sides) verl's ppo_kl metric. The verl /
# Stable-RL convention; csrc/dppo_math.h's log_ratio_clamp.
LOG_RATIO_CLAMP = 20.0
# Probability masses are floored here before a log (Stable-RL's top-K clamp; csrc/dppo_math.h's mass_floor).
MASS_FLOOR = 1e-12
# The logits dtypes the ops take. Every per-row float input and output is in the accumulation dtype.
LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# The model and rollout dtypes, by the name a setting gives (the trainer's --dtype / --rollout-dtype, the rollout
# engines' dtype, TRL's dppo_vllm_dtype, which also takes vLLM's "auto").
MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The LM head's logits dtype by the name a config gives (TRL's dppo_logits_dtype, verl's policy_loss.dppo_logits_dtype,
# the trainer's --logits-dtype); None, not listed: the model's own dtype. "float32" from a bfloat16 / float16 model:
# the products accumulated and kept in float32 (fused_linear_dppo_loss(logits_dtype=torch.float32)).
LOGITS_DTYPE_SETTINGS = {"float32": torch.float32}
# The largest sigma of the rollout logit noise (dppo_ext.rollout.noise): far beyond it the noise alone decides every
# token (mu is a random one-hot whatever the logits), and sigma * eps (|eps| < 7 in practice) stays finite in
# float16 logits (max 65504), so a sampler never sees inf - inf.
MAX_LOGIT_NOISE = 1e3
# The widths the rollout weights can be fake-quantised to (dppo_ext.rollout.quantize): symmetric integers in
# [-(2^(b-1) - 1), 2^(b-1) - 1], so one bit would hold only 0 and 8 bits is where int8 deployment stops.
ROLLOUT_WEIGHT_BITS = (2, 3, 4, 5, 6, 7, 8)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of every per-row input and output for logits of ``dtype``: float32, float64 for float64 logits
    (so that gradcheck runs end to end in double)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def canonical_mode(mode: str, name: str = "mode") -> str:
    """``mode`` as one of ``MODES`` (an alias of ``MODE_ALIASES`` is translated); ValueError otherwise.

    ``name`` is the argument's name in the message.
    """
    if isinstance(mode, str):
        if mode in MODES:
            return mode
        if mode in MODE_ALIASES:
            return MODE_ALIASES[mode]
    raise ValueError(f"{name} must be one of {MODES} (or an alias: {tuple(MODE_ALIASES)}), got {mode!r}")


def check_logits_dtype_setting(value: object, name: str = "logits_dtype") -> Optional[torch.dtype]:
    """The ``torch.dtype`` of a config's logits dtype setting ``value`` (None: the model's dtype); ValueError naming
    ``name`` for anything but None or a key of ``LOGITS_DTYPE_SETTINGS``."""
    if value is None:
        return None
    if isinstance(value, str) and value in LOGITS_DTYPE_SETTINGS:
        return LOGITS_DTYPE_SETTINGS[value]
    raise ValueError(
        f"{name} must be None (the model's dtype) or {' or '.join(map(repr, LOGITS_DTYPE_SETTINGS))} (the LM head's "
        f"logits in that dtype from a bfloat16 / float16 model), got {value!r}"
    )


def check_mask_direction(mask_direction: object, name: str = "mask_direction") -> str:
    """``mask_direction`` when it is one of ``MASK_DIRECTIONS``; ValueError naming ``name`` otherwise."""
    if isinstance(mask_direction, str) and mask_direction in MASK_DIRECTIONS:
        return mask_direction
    raise ValueError(
        f"{name} must be one of {MASK_DIRECTIONS} ('advantage': mask the side the advantage pushes towards, the "
        f"paper's DPPO; 'symmetric': mask both sides, IPO / IcePop), got {mask_direction!r}"
    )


def icepop_deltas(low: float, high: float) -> tuple[float, float]:
    """IcePop's ratio band ``[low, high]`` (a token is kept when ``low <= pi / mu <= high``, as prime-rl's
    ``mask_ratio_low`` / ``mask_ratio_high``, NeMo-RL's and OpenRLHF's icepop bounds give it) as our
    ``(delta_low, delta_high) = (1 - low, high - 1)`` for ``mode="ratio", mask_direction="symmetric"``
    (docs/names.md). ValueError unless ``0 <= low <= 1 <= high`` (finite numbers)."""
    if not (_is_number(low) and _is_number(high) and math.isfinite(high) and 0 <= low <= 1 <= high):
        raise ValueError(
            f"an IcePop band [low, high] must satisfy 0 <= low <= 1 <= high (finite numbers), got low={low!r}, "
            f"high={high!r}"
        )
    return 1.0 - low, high - 1.0


def resolve_deltas(mode: str, delta_low: Optional[float], delta_high: Optional[float]) -> tuple[float, float]:
    """``(delta_low, delta_high)`` with ``None`` replaced by ``DEFAULT_DELTAS[mode]`` (aliases accepted)."""
    low, high = DEFAULT_DELTAS[canonical_mode(mode)]
    return (low if delta_low is None else delta_low, high if delta_high is None else delta_high)


def check_aggregation(loss_agg_mode: str, loss_scale_factor: Optional[float] = None) -> None:
    """Raise ``ValueError`` unless ``loss_agg_mode`` is one of ``AGG_MODES`` and ``loss_scale_factor`` fits it."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {loss_agg_mode!r}")
    if loss_scale_factor is not None:
        if loss_agg_mode not in NORM_AGG_MODES:
            raise ValueError(
                f"loss_scale_factor is only used by the loss_agg_mode values {NORM_AGG_MODES}, got "
                f"loss_scale_factor={loss_scale_factor!r} with loss_agg_mode={loss_agg_mode!r}"
            )
        if not (math.isfinite(loss_scale_factor) and loss_scale_factor > 0):  # inf would silently zero the loss
            raise ValueError(f"loss_scale_factor must be > 0 or None, got {loss_scale_factor!r} (a finite number)")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_settings(
    mode: str,
    temperature: float,
    delta_low: Optional[float],
    delta_high: Optional[float],
    ratio_cap: float,
    *,
    prefix: str = "",
    temperature_name: str = "temperature",
    mask_direction: str = DEFAULT_MASK_DIRECTION,
) -> None:
    """The scalar settings' rules of the op (csrc/checks.h), for settings given before any tensor exists.

    ``prefix`` is prepended to the names of mode, thresholds and cap in the messages (``"dppo_"`` for the TRL
    config fields); ``temperature_name`` is the temperature's name.
    """
    canonical_mode(mode, f"{prefix}mode")
    check_mask_direction(mask_direction, f"{prefix}mask_direction")
    if not _is_number(temperature) or not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"{temperature_name} must be a finite number > 0, got {temperature!r}")
    for name, value in (("delta_low", delta_low), ("delta_high", delta_high)):
        if value is None:
            continue
        if not _is_number(value) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{prefix}{name} must be a finite number >= 0 or None (the mode's default), got {value!r}")
    if not _is_number(ratio_cap) or not ratio_cap > 0:
        raise ValueError(f"{prefix}ratio_cap must be a number > 0, got {ratio_cap!r}")


def check_token_ids(name: str, ids: Optional[torch.Tensor]) -> None:
    """Token ids must be an integer tensor: ``.long()`` would silently truncate fractional float ids."""
    if ids is None:
        return
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(
            f"{name} must hold integer token ids (an integer dtype such as torch.int64), got dtype {ids.dtype}; "
            f"convert ids you know to be whole numbers with {name}.long()"
        )


# Sampling truncation (docs/contract.md, "Truncated sampling"). vLLM's SamplingParams sample from the whole
# distribution at top_k -1 or 0 (None in TRL's min_p), top_p 1 and min_p 0; any other value samples from the
# distribution truncated to a kept set and renormalised, and vLLM's processed log-probs mu are then those of the
# truncated distribution. The loss replays it given each position's kept set (``kept_ids``): the reference trainer
# and dppo_ext.rollout.vllm_rollout_tensors return them; an integration whose rollout cannot return them refuses
# truncation at config time, with the fix (refuse_truncated_sampling).


def sampling_truncation(
    top_k: Optional[int], top_p: float, min_p: Optional[float], *, names: Optional[Mapping[str, str]] = None
) -> dict[str, object]:
    """The sampling settings among ``top_k`` / ``top_p`` / ``min_p`` that truncate the distribution, by name (empty
    when none does), each value checked first: ``top_k`` an int >= -1 (-1, 0 or None: off), ``top_p`` a number in
    (0, 1] (1: off), ``min_p`` a number in [0, 1] (0 or None: off). ``names`` maps ``top_k`` / ``top_p`` / ``min_p``
    to the names a message should use (e.g. a config path); ValueError naming the setting otherwise."""
    names = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", **(names or {})}
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < -1):
        raise ValueError(f"{names['top_k']} must be an int >= -1 (-1 or 0: no top-k truncation), got {top_k!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"{names['top_p']} must be a number in (0, 1] (1: no top-p truncation), got {top_p!r}")
    if min_p is not None and (not _is_number(min_p) or not 0 <= min_p <= 1):
        raise ValueError(f"{names['min_p']} must be a number in [0, 1] (0: no min-p truncation), got {min_p!r}")
    truncating = {"top_k": top_k is not None and top_k > 0, "top_p": top_p < 1, "min_p": bool(min_p)}
    values = {"top_k": top_k, "top_p": top_p, "min_p": min_p}
    return {names[key]: values[key] for key, on in truncating.items() if on}


def refuse_truncated_sampling(
    top_k: Optional[int],
    top_p: float,
    min_p: Optional[float],
    *,
    names: Optional[Mapping[str, str]] = None,
    fix: Optional[str] = None,
) -> None:
    """Raise ``ValueError`` when ``top_k`` / ``top_p`` / ``min_p`` truncate the sampling distribution (see
    :func:`sampling_truncation`, which also checks their ranges). The message names each truncating setting and its
    value, says why the loss would be wrong, and gives ``fix`` (default: top_p=1, top_k=-1 (or 0) and min_p=0,
    spelled with ``names``)."""
    truncating = sampling_truncation(top_k, top_p, min_p, names=names)
    if not truncating:
        return
    if fix is None:
        spelled = {"top_k": "top_k", "top_p": "top_p", "min_p": "min_p", **(names or {})}
        fix = f"{spelled['top_p']}=1, {spelled['top_k']}=-1 (or 0) and {spelled['min_p']}=0"
    settings = ", ".join(f"{name}={value!r}" for name, value in truncating.items())
    raise ValueError(
        f"{settings} truncates the sampling distribution: vLLM's log-probs mu are then those of the truncated, "
        "renormalised distribution while the DPPO loss scores pi over the whole vocabulary, so every ratio pi/mu is "
        "off by the kept set's mass and DPPO masks tokens the policy never moved. This rollout does not return the "
        "kept sets the loss would replay (docs/contract.md, 'Truncated sampling'): sample from the whole distribution "
        f"with {fix}"
    )

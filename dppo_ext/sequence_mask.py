"""What the entry points compose on the op's per-row outputs: sequence-level masks and the squared-log-ratio penalty
(docs/contract.md, "Sequence masks" and "Log-ratio penalty").

Both are per-row work on ``[N]`` tensors the op already returns (``logp``) or was given (the rollout's ``m``): no
``[N, V]`` memory, nothing compiled, and exact in any dtype's accumulation type. With ``delta = clamp(logp - m, -20,
20)`` (0 where both are ``-inf``, as the mismatch metrics):

- :class:`SequenceMask`: a per-token statistic (``k1 = -delta``, ``k2 = delta^2 / 2``, ``k3 = exp(delta) - 1 - delta``,
  ``tv = |pi - mu|``) reduced by ``sum`` / ``mean`` / ``max`` over each sequence's response tokens; a sequence whose
  value leaves ``[low, high]`` is masked (every token's loss times 0, a constant for autograd), optionally only its
  tokens with a negative advantage (DeepSeek-V3.2's off-policy sequence mask).
- ``kl_tau``: ``kl_tau * delta^2`` added to the loss of the response tokens ``kl_mask_type`` selects (prime-rl's
  ``kl_tau``; differentiable through ``logp``: ``d/dlogp = 2 * kl_tau * delta`` inside the clamp, 0 outside).

Packed rows name their sequences by ``sequence_ids [N]`` (non-negative ints) or ``cu_seqlens [S + 1]``; ``[B, T]``
rows are one sequence per ``b``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .contract import LOG_RATIO_CLAMP

__all__ = [
    "KL_MASK_TYPES",
    "SEQUENCE_MASK_FIELDS",
    "SEQUENCE_REDUCTIONS",
    "SEQUENCE_STATISTICS",
    "SequenceMask",
    "check_kl_settings",
    "lead_sequences",
    "log_ratio",
    "sequence_index",
    "sequence_keep",
    "token_statistic",
]

SEQUENCE_STATISTICS = ("k1", "k2", "k3", "tv")
SEQUENCE_REDUCTIONS = ("sum", "mean", "max")
# SequenceMask's fields, the keys of its config form (SequenceMask.from_config).
SEQUENCE_MASK_FIELDS = ("statistic", "reduce", "high", "low", "negative_advantages_only")
# Which response tokens the squared-log-ratio penalty covers (prime-rl's kl_mask_type): every one, the ones the masks
# keep, or the ones they drop.
KL_MASK_TYPES = ("all", "unmasked", "masked")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SequenceMask:
    """A sequence-level mask: ``statistic`` per response token, reduced by ``reduce`` over each sequence; the
    sequence is masked when the value is above ``high`` or below ``low`` (strict: a value equal to a bound is kept;
    ``None``: no bound on that side). ``negative_advantages_only``: only the tokens with ``A < 0`` of a masked sequence
    are masked (DeepSeek-V3.2's off-policy sequence mask keeps every token with ``A >= 0``).

    The frameworks' own options map onto it with :meth:`from_verl`, :meth:`from_trl` and :meth:`off_policy`
    (docs/names.md).
    """

    statistic: str
    reduce: str
    high: Optional[float] = None
    low: Optional[float] = None
    negative_advantages_only: bool = False

    def __post_init__(self) -> None:
        if self.statistic not in SEQUENCE_STATISTICS:
            raise ValueError(f"SequenceMask statistic must be one of {SEQUENCE_STATISTICS}, got {self.statistic!r}")
        if self.reduce not in SEQUENCE_REDUCTIONS:
            raise ValueError(f"SequenceMask reduce must be one of {SEQUENCE_REDUCTIONS}, got {self.reduce!r}")
        for name in ("high", "low"):
            value = getattr(self, name)
            if value is not None and not _number(value):
                raise ValueError(f"SequenceMask {name} must be a finite number or None, got {value!r}")
        if self.high is None and self.low is None:
            raise ValueError("SequenceMask needs a bound: high (mask above it), low (mask below it) or both")
        if self.high is not None and self.low is not None and self.low > self.high:
            raise ValueError(f"SequenceMask low must be <= high, got low={self.low!r}, high={self.high!r}")
        if not isinstance(self.negative_advantages_only, bool):
            raise TypeError(
                f"SequenceMask negative_advantages_only must be a bool, got {self.negative_advantages_only!r}"
            )

    @classmethod
    def from_config(cls, value: object, name: str = "sequence_mask") -> Optional[SequenceMask]:
        """The sequence mask a config setting ``name`` gives (TRL's ``dppo_sequence_mask``, verl's
        ``policy_loss.dppo_sequence_mask``): None (no sequence mask), a :class:`SequenceMask`, a mapping of its fields
        (``statistic``, ``reduce``, ``high``, ``low``, ``negative_advantages_only``) or that mapping as JSON (a
        command line). ValueError naming ``name``, the value and what is expected otherwise."""
        if value is None or isinstance(value, SequenceMask):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{name} must be None, a dppo_ext.SequenceMask, a dict of its fields or that dict as JSON, got the "
                    f"string {value!r} ({err.msg})"
                ) from err
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{name} must be None, a dppo_ext.SequenceMask or a dict of its fields {SEQUENCE_MASK_FIELDS}, got "
                f"{value!r} ({type(value).__name__})"
            )
        unknown = sorted(str(key) for key in value if key not in SEQUENCE_MASK_FIELDS)
        if unknown or "statistic" not in value or "reduce" not in value:
            raise ValueError(
                f"{name} takes the fields {SEQUENCE_MASK_FIELDS} (statistic and reduce required), got "
                f"{dict(value)!r}" + (f": unknown {unknown}" if unknown else "")
            )
        try:
            return cls(**{str(key): value[key] for key in value})
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: {err}") from err

    def to_config(self) -> dict:
        """The fields as a plain dict, the form :meth:`from_config` reads and a JSON config stores."""
        return dataclasses.asdict(self)

    @classmethod
    def from_verl(cls, rollout_rs: str, rollout_rs_threshold: float | str) -> SequenceMask:
        """verl's rollout-correction rejection option ``seq_{sum,mean}_k{1,2,3}`` / ``seq_max_k{2,3}`` with its
        ``rollout_rs_threshold``: for ``k1`` a ratio band ``"lower_upper"`` (or ``upper``, lower ``1 / upper``) on
        ``exp(statistic)``, else an upper bound on the statistic. One option (verl chains several with commas: pass
        each to its own call; our entry points take one sequence mask)."""
        parts = rollout_rs.split("_") if isinstance(rollout_rs, str) else []
        if (
            len(parts) != 3
            or parts[0] != "seq"
            or parts[1] not in SEQUENCE_REDUCTIONS
            or parts[2] not in ("k1", "k2", "k3")
        ):
            raise ValueError(
                f"rollout_rs must be one of verl's sequence options seq_{{sum,mean,max}}_k{{1,2,3}}, got {rollout_rs!r}"
            )
        _, reduce, statistic = parts
        if reduce == "max" and statistic == "k1":
            raise ValueError("rollout_rs 'seq_max_k1' is not a verl option (k1 is signed: its max bounds nothing)")
        spec = str(rollout_rs_threshold).strip()
        try:
            if statistic == "k1":
                upper = float(spec.split("_", 1)[-1])
                lower = float(spec.split("_", 1)[0]) if "_" in spec else 1.0 / upper
                if lower <= 0 or upper <= 0:
                    raise ValueError
                return cls("k1", reduce, high=math.log(upper), low=math.log(lower))
            return cls(statistic, reduce, high=float(spec))
        except ValueError as err:
            raise ValueError(
                f"rollout_rs_threshold for {rollout_rs!r} must be a positive number (k1: or a 'lower_upper' ratio "
                f"band), got {rollout_rs_threshold!r}"
            ) from err

    @classmethod
    def from_trl(
        cls, vllm_importance_sampling_mode: str, clip_min: Optional[float], clip_max: Optional[float]
    ) -> SequenceMask:
        """TRL GRPOTrainer's ``vllm_importance_sampling_mode="sequence_mask"`` with
        ``vllm_importance_sampling_clip_min`` / ``_clip_max``: a sequence is masked when ``exp(sum of delta)`` leaves
        ``[clip_min, clip_max]``, i.e. the sum of ``k1 = -delta`` leaves ``[-log clip_max, -log clip_min]``."""
        if vllm_importance_sampling_mode != "sequence_mask":
            raise ValueError(
                "only vllm_importance_sampling_mode='sequence_mask' is a sequence mask (the *_truncate modes clip a "
                f"weight, 'token_mask' is mode='ratio' with mask_direction='symmetric'), got "
                f"{vllm_importance_sampling_mode!r}"
            )
        return cls.ratio_band(
            "sum", clip_min, clip_max, names=("vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
        )

    @classmethod
    def ratio_band(
        cls, reduce: str, low: Optional[float], high: Optional[float], names: tuple[str, str] = ("low", "high")
    ) -> SequenceMask:
        """A band ``[low, high]`` on the sequence ratio ``exp(reduce of delta)`` (``None``: open on that side), as
        ``k1 = -delta`` bounds ``[-log high, -log low]``: ``reduce="sum"`` is TRL's ``sequence_mask`` (the product of
        the token ratios), ``"mean"`` OpenRLHF's ``seq-mask-tis`` (their geometric mean)."""
        for name, value in zip(names, (low, high)):
            if value is not None and not (_number(value) and value > 0):
                raise ValueError(f"{name} must be a number > 0 or None, got {value!r}")
        return cls(
            "k1", reduce, high=None if low is None else -math.log(low), low=None if high is None else -math.log(high)
        )

    @classmethod
    def off_policy(cls, off_policy_mask_threshold: float) -> SequenceMask:
        """TRL's ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask): the tokens with ``A < 0``
        of a sequence whose mean ``k1`` is above the threshold."""
        return cls("k1", "mean", high=off_policy_mask_threshold, negative_advantages_only=True)


def check_kl_settings(kl_tau: object, kl_mask_type: object, prefix: str = "") -> None:
    """``kl_tau`` a finite number >= 0 and ``kl_mask_type`` one of ``KL_MASK_TYPES``; ValueError naming each (with
    ``prefix``, e.g. ``"dppo_"`` for the TRL config's fields)."""
    if not (_number(kl_tau) and kl_tau >= 0):
        raise ValueError(f"{prefix}kl_tau must be a finite number >= 0 (0: no penalty), got {kl_tau!r}")
    if kl_mask_type not in KL_MASK_TYPES:
        raise ValueError(f"{prefix}kl_mask_type must be one of {KL_MASK_TYPES}, got {kl_mask_type!r}")


def check_sequence_mask(sequence_mask: object) -> None:
    if sequence_mask is not None and not isinstance(sequence_mask, SequenceMask):
        raise TypeError(
            f"sequence_mask must be a dppo_ext.SequenceMask or None, got a {type(sequence_mask).__name__}; build one "
            "with SequenceMask(statistic, reduce, high=..., low=...) or SequenceMask.from_verl / from_trl"
        )


def log_ratio(logp: Tensor, rollout_logprobs: Tensor, valid: Tensor) -> Tensor:
    """``delta = clamp(logp - m, -20, 20)`` on response rows (0 where both are ``-inf`` and on padding rows, whose
    ``m`` may hold anything), differentiable through ``logp`` without a NaN reaching its gradient."""
    m = torch.where(valid, rollout_logprobs, torch.zeros_like(rollout_logprobs))
    both = torch.isneginf(logp.detach()) & torch.isneginf(m)
    safe_logp = torch.where(both, torch.zeros_like(logp), logp)
    safe_m = torch.where(both, torch.zeros_like(m), m)
    return torch.where(valid, (safe_logp - safe_m).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), torch.zeros_like(logp))


def token_statistic(statistic: str, delta: Tensor, logp: Tensor, rollout_logprobs: Tensor, valid: Tensor) -> Tensor:
    """The per-token statistic of a :class:`SequenceMask` (detached), 0 on padding rows."""
    delta = delta.detach()
    if statistic == "k1":
        value = -delta
    elif statistic == "k2":
        value = 0.5 * delta * delta
    elif statistic == "k3":
        value = torch.expm1(delta) - delta
    else:
        m = torch.where(valid, rollout_logprobs, torch.zeros_like(rollout_logprobs))
        value = (logp.detach().exp() - m.exp()).abs()
    return torch.where(valid, value, torch.zeros_like(value))


def sequence_index(
    n: int, device: torch.device, sequence_ids: Optional[Tensor], cu_seqlens: Optional[Tensor]
) -> tuple[Tensor, int]:
    """``(index [N] int64, S)``: each row's sequence in ``[0, S)``, from ``sequence_ids [N]`` or ``cu_seqlens [S + 1]``
    (``0 = c_0 <= c_1 <= ... <= c_S = N``); neither: one sequence. ValueError naming the argument otherwise. Reads
    the ids' maximum (one host sync where they live on a GPU)."""
    if sequence_ids is not None and cu_seqlens is not None:
        raise ValueError("give sequence_ids or cu_seqlens, not both (each names every row's sequence)")
    if sequence_ids is not None:
        if sequence_ids.is_floating_point() or sequence_ids.dtype == torch.bool or sequence_ids.shape != (n,):
            raise ValueError(
                f"sequence_ids must be an integer tensor of shape ({n},) (one sequence id per row), got dtype "
                f"{sequence_ids.dtype} and shape {tuple(sequence_ids.shape)}"
            )
        ids = sequence_ids.long()
        if n and int(ids.min()) < 0:
            raise ValueError(f"sequence_ids must be >= 0, got a minimum of {int(ids.min())}")
        return ids, int(ids.max()) + 1 if n else 0
    if cu_seqlens is not None:
        cu = cu_seqlens.long() if not cu_seqlens.is_floating_point() else None
        if (
            cu is None
            or cu.dim() != 1
            or cu.numel() < 1
            or int(cu[0]) != 0
            or int(cu[-1]) != n
            or (cu.diff() < 0).any()
        ):
            raise ValueError(
                f"cu_seqlens must be a non-decreasing integer tensor [S + 1] from 0 to N={n} (the rows where each "
                f"sequence starts, then N), got {cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else cu_seqlens.shape}"
            )
        rows = torch.arange(n, device=cu.device)
        return torch.searchsorted(cu[1:], rows, right=True), cu.numel() - 1
    return torch.zeros(n, dtype=torch.long, device=device), 1


def lead_sequences(lead: torch.Size, device: torch.device) -> tuple[Tensor, int]:
    """``(index [N], S)`` of an aggregating entry point's ``[*lead]`` rows: each row along the last dim is one sequence
    (``[B, T]``: ``S = B``); a 1-D lead is one sequence."""
    if len(lead) < 2:
        return torch.zeros(lead.numel(), dtype=torch.long, device=device), 1
    count = lead[:-1].numel()
    return torch.arange(count, device=device).repeat_interleave(lead[-1]), count


def sequence_keep(
    mask: SequenceMask, stat: Tensor, valid: Tensor, advantages: Tensor, index: Tensor, num_sequences: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(keep [N], value [S], dropped [S])``: 1 for the rows the sequence mask keeps (0 for the masked ones; padding
    rows 1), each sequence's reduced statistic (0 for a sequence without a response token) and whether it is masked
    (never an empty one). O(N) scatters."""
    acc = stat.dtype
    weights = valid.to(acc)
    counts = torch.zeros(num_sequences, dtype=acc, device=stat.device).index_add_(0, index, weights)
    if mask.reduce == "max":
        filled = torch.where(valid, stat, torch.full_like(stat, -math.inf))
        top = torch.full((num_sequences,), -math.inf, dtype=acc, device=stat.device)
        value = top.scatter_reduce(0, index, filled, reduce="amax")
    else:
        value = torch.zeros(num_sequences, dtype=acc, device=stat.device).index_add_(0, index, stat * weights)
        if mask.reduce == "mean":
            value = value / counts.clamp(min=1)
    value = torch.where(counts > 0, value, torch.zeros_like(value))
    dropped = torch.zeros_like(counts, dtype=torch.bool)
    if mask.high is not None:
        dropped |= value > mask.high
    if mask.low is not None:
        dropped |= value < mask.low
    dropped &= counts > 0
    row_dropped = dropped[index] & valid
    if mask.negative_advantages_only:
        row_dropped &= advantages < 0
    return (~row_dropped).to(acc), value, dropped

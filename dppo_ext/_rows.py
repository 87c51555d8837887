"""What one loss call carries from its entry point down to the op: the settings and the per-row tensors.

- ``LossSettings``: the call's scalar settings, resolved and checked once (mode made canonical, ``None``
  thresholds replaced by ``DEFAULT_DELTAS[mode]``, the aggregation checked) and passed as one object through every
  layer, the autograd Functions included.
- ``RowInputs`` / ``DPPOOutputs``: the op's per-row inputs and outputs, each ``[N]`` (top-K ``[N, K]``).
- ``prepare_rows``: an aggregating entry point's ``[*lead, ...]`` tensors checked against the rows' shape, the
  advantages broadcast, and everything flattened to ``N = lead.numel()`` rows (a row outside ``response_mask``
  gets the token ``IGNORE_INDEX``, which the op skips).
- ``LossModule``: the ``nn.Module`` base of ``DPPOLoss`` and ``FusedLinearDPPOLoss`` (settings checked at
  construction, passed to the loss function on every call).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, nn

from .contract import (
    DEFAULT_AGG_MODE,
    DEFAULT_MASK_DIRECTION,
    IGNORE_INDEX,
    TOPK_MODES,
    canonical_mode,
    check_aggregation,
    check_mask_direction,
    check_settings,
    check_token_ids,
    resolve_deltas,
)
from .sequence_mask import SequenceMask, check_kl_settings, check_sequence_mask

__all__ = [
    "DPPOOutputs",
    "LossModule",
    "LossSettings",
    "RowInputs",
    "broadcast_advantages",
    "check_row_counts",
    "check_row_shapes",
    "check_temperature",
    "check_tensors",
    "check_topk_shapes",
    "prepare_rows",
]


# How the shape messages name the leading dims of an entry point's main tensor.
_LEAD_DIMS = {"logits": "the logits' leading dims", "hidden": "hidden's leading dims"}


@dataclass(frozen=True)
class LossSettings:
    """The scalar settings of one loss call, resolved once by :meth:`resolve`."""

    mode: str  # one of MODES (an alias already translated)
    temperature: float
    delta_low: float
    delta_high: float
    ratio_cap: float
    compute_entropy: bool
    loss_agg_mode: str = DEFAULT_AGG_MODE
    loss_scale_factor: Optional[float] = None
    mask_direction: str = DEFAULT_MASK_DIRECTION
    kl_tau: float = 0.0
    kl_mask_type: str = "all"
    sequence_mask: Optional[SequenceMask] = None

    @classmethod
    def resolve(
        cls,
        mode: str,
        temperature: float,
        delta_low: Optional[float],
        delta_high: Optional[float],
        ratio_cap: float,
        compute_entropy: bool,
        loss_agg_mode: str = DEFAULT_AGG_MODE,
        loss_scale_factor: Optional[float] = None,
        *,
        mask_direction: str = DEFAULT_MASK_DIRECTION,
        kl_tau: float = 0.0,
        kl_mask_type: str = "all",
        sequence_mask: Optional[SequenceMask] = None,
    ) -> LossSettings:
        """The settings of an entry point's call: ``mode`` made canonical, then the aggregation checked (a per-row
        entry point passes none and gets the default, which it never uses; ``None`` from a user is refused, as
        :func:`~dppo_ext.aggregate_loss` refuses it), then ``None`` thresholds replaced by ``DEFAULT_DELTAS[mode]``;
        ValueError for an unknown mode, mask direction or aggregation. The other values are kept as given, so that
        the entry point's tensor checks run before :meth:`op_args` converts them to the schema's types."""
        mode = canonical_mode(mode)
        mask_direction = check_mask_direction(mask_direction)
        check_kl_settings(kl_tau, kl_mask_type)
        check_sequence_mask(sequence_mask)
        temperature = check_temperature(temperature)
        check_aggregation(loss_agg_mode, loss_scale_factor)
        delta_low, delta_high = resolve_deltas(mode, delta_low, delta_high)
        return cls(
            mode,
            temperature,
            delta_low,
            delta_high,
            ratio_cap,
            compute_entropy,
            loss_agg_mode,
            loss_scale_factor,
            mask_direction,
            float(kl_tau),
            kl_mask_type,
            sequence_mask,
        )

    @property
    def composes(self) -> bool:
        """Whether the entry point composes a sequence mask or the log-ratio penalty on the op's per-row outputs
        (``dppo_ext.aggregation.compose_rows``): the per-row loss is then not the op's alone."""
        return self.sequence_mask is not None or self.kl_tau != 0

    @property
    def uses_topk(self) -> bool:
        """Whether the mode reads the rollout's top-K (``topk_ids``, ``topk_logprobs``)."""
        return self.mode in TOPK_MODES

    def op_args(self) -> tuple[str, float, float, float, float, bool]:
        """The settings in ``torch.ops.dppo.dppo_loss_forward``'s schema order and types (``str mode, float
        temperature, float delta_low, float delta_high, float ratio_cap, bool compute_entropy``)."""
        return (
            self.mode,
            float(self.temperature),
            float(self.delta_low),
            float(self.delta_high),
            float(self.ratio_cap),
            bool(self.compute_entropy),
        )

    def stats_args(self) -> tuple[float, bool]:
        """``(temperature, compute_entropy)``, the settings of ``dppo_vocab_parallel_stats`` (after ``vocab_start``)."""
        return float(self.temperature), bool(self.compute_entropy)

    def epilogue_args(self) -> tuple[str, float, float, float, bool]:
        """The settings in ``dppo_vocab_parallel_epilogue``'s schema order (no temperature: the statistics are
        already scaled)."""
        mode, _temperature, *rest = self.op_args()
        return (mode, *rest)


class DPPOOutputs(NamedTuple):
    """Per-row outputs of the op, each ``[N]`` in float32 (float64 for float64 logits)."""

    loss: Tensor
    logp: Tensor
    divergence: Tensor
    mask: Tensor
    weight: Tensor
    entropy: Tensor
    lse: Tensor


class RowInputs(NamedTuple):
    """The op's per-row inputs: ``tokens [N]`` int64, ``rollout_logprobs``, ``advantages`` ``[N]`` and
    ``anchor_logprobs [N]?`` in the accumulation dtype, ``topk_ids [N, K]?`` int64, ``topk_logprobs [N, K]?`` (the
    first six, :attr:`op_inputs`, in the schema's order after the logits), and ``kept_ids [N, S]?`` int64 (sampling
    replay; the schema's last argument)."""

    tokens: Tensor
    rollout_logprobs: Tensor
    advantages: Tensor
    topk_ids: Optional[Tensor] = None
    topk_logprobs: Optional[Tensor] = None
    anchor_logprobs: Optional[Tensor] = None
    kept_ids: Optional[Tensor] = None

    @property
    def op_inputs(self) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
        """The six per-row inputs that follow the logits in ``dppo_loss_forward``'s (and the vocabulary-parallel
        epilogue's) schema; ``kept_ids`` goes last, after the settings."""
        return (
            self.tokens,
            self.rollout_logprobs,
            self.advantages,
            self.topk_ids,
            self.topk_logprobs,
            self.anchor_logprobs,
        )

    @classmethod
    def of(
        cls,
        tokens: Tensor,
        rollout_logprobs: Tensor,
        advantages: Tensor,
        topk_ids: Optional[Tensor] = None,
        topk_logprobs: Optional[Tensor] = None,
        anchor_logprobs: Optional[Tensor] = None,
        kept_ids: Optional[Tensor] = None,
    ) -> RowInputs:
        """The rows of a per-row entry point, each checked to be a tensor (or None where optional)."""
        rows = cls(tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, kept_ids)
        check_tensors(**rows._asdict())
        return rows

    def narrow(self, rows: slice) -> RowInputs:
        """The given rows of every input (views)."""
        return RowInputs(*(None if t is None else t[rows] for t in self))


def check_tensors(**tensors: object) -> None:
    """Every given argument must be a ``torch.Tensor`` (None passes: the optional ones). A list or array would
    otherwise fail deep inside with an error that names no argument."""
    for name, t in tensors.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got a {type(t).__name__}; convert it first with "
                f"torch.as_tensor({name}) (on the device of the logits or hidden states)"
            )


def check_temperature(temperature: object, name: str = "temperature") -> object:
    """``temperature`` as a Python number when it is a 0-d tensor (the op's ``float temperature``); refused: a
    tensor that requires grad (the op treats the temperature as a constant, so its ``.grad`` would silently stay
    None) and a tensor of more than one element (one temperature divides every row's logits)."""
    if not isinstance(temperature, Tensor):
        return temperature
    if temperature.requires_grad:
        raise ValueError(
            f"{name} is a tensor that requires grad, but the loss treats the temperature as a constant: its gradient "
            f"would silently stay None. Pass a Python float (or {name}.detach()) if it is not meant to be learned."
        )
    if temperature.numel() != 1:
        raise ValueError(
            f"{name} must be one number (the rollout's sampling temperature, the same for every row), got a tensor "
            f"of shape {tuple(temperature.shape)}; per-row temperatures are not supported: divide the logits by "
            "them yourself and pass temperature=1.0"
        )
    return temperature.item()


def check_row_counts(n: int, rows: RowInputs) -> None:
    """Every per-row input of ``rows`` must have ``N = n`` rows (the logits' or hidden states' rows)."""
    for name, t in rows._asdict().items():
        if t is not None and (t.dim() == 0 or t.shape[0] != n):
            raise ValueError(f"{name} must have N={n} rows (one per row of the logits), got shape {tuple(t.shape)}")


def broadcast_advantages(advantages: Tensor, lead: torch.Size, layout: str) -> Tensor:
    """Advantages as ``lead`` (the rows' shape): per token as given, or per sequence (``[B]``, or TRL's
    ``[B, 1]``) expanded over the ``T`` tokens of ``[B, T]`` rows."""
    if advantages.shape == lead:
        return advantages
    if len(lead) == 2 and advantages.shape in (lead[:1], torch.Size((lead[0], 1))):
        return advantages.reshape(lead[0], 1).expand(lead)
    raise ValueError(
        f"advantages must have shape {tuple(lead)} (per token) or {tuple(lead[:1])} or {(lead[0], 1)} (per sequence, "
        f"for [B, T, *] {layout}), got {tuple(advantages.shape)}"
    )


def check_row_shapes(lead: torch.Size, dims: str, **tensors: Optional[Tensor]) -> None:
    """Every given tensor (None passes) must have the rows' shape ``lead``, which ``dims`` names in the message."""
    for name, t in tensors.items():
        if t is not None and t.shape != lead:
            raise ValueError(f"{name} must have shape {tuple(lead)} ({dims}), got {tuple(t.shape)}")


def check_topk_shapes(lead: torch.Size, topk_ids: Optional[Tensor], topk_logprobs: Optional[Tensor]) -> None:
    for name, t in (("topk_ids", topk_ids), ("topk_logprobs", topk_logprobs)):
        if t is not None and t.shape[:-1] != lead:
            raise ValueError(f"{name} must have shape {tuple(lead)} + (K,), got {tuple(t.shape)}")


def check_kept_shape(lead: torch.Size, kept_ids: Optional[Tensor]) -> None:
    """``kept_ids`` (None passes) must be ``[*lead, S]``: one kept set per row."""
    if kept_ids is not None and (kept_ids.dim() != len(lead) + 1 or kept_ids.shape[:-1] != lead):
        raise ValueError(
            f"kept_ids must have shape {tuple(lead)} + (S,) (the ids the rollout's truncation kept at each position, "
            f"-1 padding), got {tuple(kept_ids.shape)}"
        )


def prepare_rows(
    lead: torch.Size,
    layout: str,
    acc: torch.dtype,
    device: torch.device,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Optional[Tensor],
    topk_ids: Optional[Tensor],
    topk_logprobs: Optional[Tensor],
    anchor_logprobs: Optional[Tensor],
    kept_ids: Optional[Tensor] = None,
) -> tuple[Tensor, RowInputs]:
    """``(valid, rows)`` of an aggregating entry point whose ``layout`` tensor (``"logits"``, ``"hidden"``) has the
    leading dims ``lead``: the inputs checked against ``lead`` (token ids must be integers), per-sequence advantages
    broadcast, then everything flattened to ``N = lead.numel()`` rows, floats in ``acc``. ``valid`` (``[*lead]``
    bool) marks the response tokens; a row outside ``response_mask`` gets the token ``IGNORE_INDEX``."""
    check_tensors(
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        advantages=advantages,
        response_mask=response_mask,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        anchor_logprobs=anchor_logprobs,
        kept_ids=kept_ids,
    )
    check_row_shapes(
        lead,
        _LEAD_DIMS[layout],
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
        anchor_logprobs=anchor_logprobs,
    )
    check_token_ids("tokens", tokens)
    check_token_ids("topk_ids", topk_ids)
    check_token_ids("kept_ids", kept_ids)
    advantages = broadcast_advantages(advantages, lead, layout)
    check_topk_shapes(lead, topk_ids, topk_logprobs)
    check_kept_shape(lead, kept_ids)
    valid = torch.ones(lead, dtype=torch.bool, device=device) if response_mask is None else response_mask.bool()
    flat_tokens = torch.where(valid, tokens.long(), torch.full_like(tokens, IGNORE_INDEX, dtype=torch.long))
    n = lead.numel()

    def flat(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
        return None if t is None else t.reshape(n, *t.shape[len(lead) :]).to(dtype)

    return valid, RowInputs(
        flat_tokens.reshape(n),
        flat(rollout_logprobs, acc),
        flat(advantages, acc),
        flat(topk_ids, torch.long),
        flat(topk_logprobs, acc),
        flat(anchor_logprobs, acc),
        flat(kept_ids, torch.long),
    )


class LossModule(nn.Module):
    """The settings that ``DPPOLoss`` and ``FusedLinearDPPOLoss`` share, held as one :class:`LossSettings`
    (``self.settings``, resolved once at construction: the canonical mode, the mode's default thresholds in place of
    ``None``) and passed to the loss function by :meth:`loss_kwargs`. Each setting also reads as an attribute
    (``crit.delta_low``: the value the loss uses) and can be set as one (checked, then resolved again).
    ``flags``: the subclass's own bool settings, checked here."""

    def __init__(
        self,
        *,
        vocab_parallel_group: Optional[torch.distributed.ProcessGroup],
        vocab_offsets: Optional[Sequence[int]],
        flags: Optional[dict[str, bool]] = None,
        **settings,
    ) -> None:
        super().__init__()
        for name, flag in (flags or {}).items():
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.settings = _module_settings(**settings)
        self._given = settings  # as given: a later change of the mode resolves None thresholds to its defaults
        self.vocab_parallel_group = vocab_parallel_group
        self.vocab_offsets = vocab_offsets

    def _set_setting(self, name: str, value) -> None:
        given = {**self._given, name: value}
        self.settings = _module_settings(**given)
        self._given = given

    def loss_kwargs(self) -> dict:
        """The settings as keyword arguments of ``dppo_loss`` / ``fused_linear_dppo_loss``."""
        return {
            **{f.name: getattr(self.settings, f.name) for f in fields(LossSettings)},
            "vocab_parallel_group": self.vocab_parallel_group,
            "vocab_offsets": self.vocab_offsets,
        }

    def extra_repr(self) -> str:
        s = self.settings
        return (
            f"mode={s.mode!r}, mask_direction={s.mask_direction!r}, temperature={s.temperature}, "
            f"delta_low={s.delta_low}, delta_high={s.delta_high}, ratio_cap={s.ratio_cap}, "
            f"loss_agg_mode={s.loss_agg_mode!r}, loss_scale_factor={s.loss_scale_factor}"
        )


def _module_settings(**settings) -> LossSettings:
    """A module's settings (``LossSettings.resolve``'s arguments, by name) checked by the op's rules first (a finite
    temperature > 0, a known mode and mask direction, thresholds None or finite and >= 0, ratio_cap > 0, a bool
    compute_entropy), then resolved, which checks the penalty, the sequence mask and the aggregation."""
    temperature = check_temperature(settings["temperature"])
    check_settings(
        settings["mode"],
        temperature,
        settings["delta_low"],
        settings["delta_high"],
        settings["ratio_cap"],
        mask_direction=settings["mask_direction"],
    )
    if not isinstance(settings["compute_entropy"], bool):
        raise TypeError(f"compute_entropy must be a bool, got {settings['compute_entropy']!r}")
    return LossSettings.resolve(**{**settings, "temperature": temperature})


def _setting_attribute(name: str) -> property:
    def get(self: LossModule):
        return getattr(self.settings, name)

    def set_(self: LossModule, value) -> None:
        self._set_setting(name, value)

    return property(get, set_, doc=f"The ``{name}`` the loss uses (``self.settings.{name}``).")


# every field of LossSettings reads and writes as an attribute of the module forms (``crit.temperature = 0.7``)
for _field in fields(LossSettings):
    setattr(LossModule, _field.name, _setting_attribute(_field.name))
del _field

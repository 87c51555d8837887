"""The trainer's ``--loss`` choices: each one a thin configuration of the same ``dppo_loss`` op.

Every loss below computes, per response token, ``l = -A * w * M * log pi`` with the weight
``w = min(pi / mu, C)`` and the mask ``M`` both constants for autograd (docs/contract.md). They
differ only in what the mask tests (``mode``), which distribution anchors that test (the rollout
engine's ``mu``, or ``pi_old``: log-probs the trainer recomputes with its own weights once per
rollout batch, before that batch's first optimizer step), the thresholds and the cap C. One loss,
``pg_pi_old``, also takes its weight against ``pi_old`` (``w = pi / pi_old``): it ignores the
rollout mismatch, the negative control of the staleness experiment (experiments/sanity/results/staleness/).

What each loss masks, what anchors the mask, what weights the gradient and which reference it
follows: ``LOSSES`` below, the single source (other stacks' names for each: docs/names.md).

In it, "moving away": A > 0 and pi above the anchor, or A <= 0 and pi below it. "Uncapped" means the
op's own bound only: the log-ratio is clamped at 20 before ``exp``. ``--delta-low`` /
``--delta-high`` / ``--ratio-cap`` override a loss's values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from dppo_ext.contract import DEFAULT_MASK_DIRECTION, MODE_ALIASES, TOPK_MODES, icepop_deltas
from dppo_ext.sequence_mask import SequenceMask

__all__ = ["LOSSES", "LOSS_ALIASES", "LossSpec", "canonical_loss"]

TIS_CAP = 10.0
# CISPO as MiniMax-M1 (arXiv 2506.13585, section 3.1) runs it: the weight clipped at 1 + eps_high with no lower bound;
# eps_high = 0.28 (DAPO's clip-higher, the default upper clip range of Trinity-RFT's cispo loss).
CISPO_CAP = 1.28
# prime-rl's IPO loss (PrimeIntellect-ai/prime-rl, IPOLossConfig at 559b44772e47): |pi - mu| > ipo_threshold masks
# whatever the advantage's sign, plus kl_tau * (log pi - log mu)^2 on every response token.
IPO_THRESHOLD, IPO_KL_TAU = 0.1, 1e-3
# IcePop's band [0.5, 5.0] on pi / mu (OpenRLHF's default is_correction_threshold, its icepop type).
ICEPOP_BAND = (0.5, 5.0)
# The sequence-masked DPPO: Binary-TV with TRL GRPOTrainer's default sequence mask (vllm_importance_sampling_mode
# "sequence_mask", clip_max 3.0: a sequence whose product of ratios pi / mu exceeds 3 is dropped).
SEQ_MASK = SequenceMask.from_trl("sequence_mask", None, 3.0)


@dataclass(frozen=True)
class LossSpec:
    """One ``--loss``: the op's ``mode``, the mask's anchor, default thresholds and weight cap.

    Attributes:
        mode: ``dppo_loss`` mode.
        anchor: ``rollout`` (the mask tests against mu) or ``recompute`` (against pi_old, passed
            to the op as ``anchor_logprobs``).
        delta_low, delta_high: default thresholds (None: the op's per-mode default).
        ratio_cap: default cap C of the weight; ``math.inf`` = uncapped.
        source: which reference implementation this configuration follows.
        weight: ``rollout`` (``w = pi / mu``) or ``recompute`` (``w = pi / pi_old``: the op is fed pi_old in
            place of mu, so the weight ignores the rollout mismatch; only with ``mode="none"``).
        mask_direction, kl_tau, sequence_mask: the op's settings of the same names (docs/contract.md).
    """

    mode: str
    anchor: str = "rollout"
    delta_low: Optional[float] = None
    delta_high: Optional[float] = None
    ratio_cap: float = TIS_CAP
    source: str = ""
    weight: str = "rollout"
    mask_direction: str = DEFAULT_MASK_DIRECTION
    kl_tau: float = 0.0
    sequence_mask: Optional[SequenceMask] = None

    def __post_init__(self) -> None:
        if self.weight not in ("rollout", "recompute"):
            raise ValueError(f"LossSpec weight must be 'rollout' or 'recompute', got {self.weight!r}")
        if self.weight == "recompute" and self.mode != "none":
            raise ValueError(
                f"LossSpec weight='recompute' needs mode='none' (a mask against mu would still see the "
                f"mismatch), got mode={self.mode!r}"
            )

    @property
    def uses_topk(self) -> bool:
        """True when the mode needs the rollout's top-K log-probs."""
        return self.mode in TOPK_MODES

    @property
    def recomputes(self) -> bool:
        """True when the trainer must recompute pi_old for this loss (its mask's anchor or its weight)."""
        return self.anchor == "recompute" or self.weight == "recompute"


LOSSES: dict[str, LossSpec] = {
    "pg_is": LossSpec("none", ratio_cap=math.inf, source="PG-IS: Stable-RL pg_no_mask without the cap"),
    "cispo": LossSpec("none", source="CISPO / PG-TIS: Stable-RL pg_no_mask (weight capped at 10)"),
    "cispo_clip": LossSpec("none", ratio_cap=CISPO_CAP, source="CISPO: MiniMax-M1, weight capped at 1 + 0.28"),
    "pg_pi_old": LossSpec(
        "none",
        ratio_cap=math.inf,
        weight="recompute",
        source="PG weighted by pi / pi_old: ignores the rollout mismatch (negative control)",
    ),
    "grpo_clip": LossSpec("ratio", delta_low=0.2, delta_high=0.2, source="GRPO: Stable-RL ppo, symmetric clip"),
    "grpo_clip_higher": LossSpec("ratio", delta_low=0.2, delta_high=0.28, source="GRPO clip-higher: Stable-RL ppo"),
    "minirl": LossSpec(
        "ratio",
        anchor="recompute",
        delta_low=0.2,
        delta_high=0.28,
        ratio_cap=math.inf,
        source="MiniRL: Stable-RL ppo_recompute without the cap",
    ),
    "minirl_tis": LossSpec(
        "ratio", anchor="recompute", delta_low=0.2, delta_high=0.28, source="MiniRL-TIS: Stable-RL ppo_recompute"
    ),
    "dppo_binary_tv": LossSpec("binary_tv", source="Stable-RL dppo_binary_tv"),
    "dppo_binary_kl": LossSpec("binary_kl", source="Stable-RL dppo_binary_kl"),
    "dppo_topk_tv": LossSpec("topk_tv", source="Stable-RL dppo_topk_tv"),
    "dppo_topk_kl": LossSpec("topk_kl", source="Stable-RL dppo_topk_kl"),
    "ipo": LossSpec(
        "binary_tv",
        delta_low=IPO_THRESHOLD,
        delta_high=IPO_THRESHOLD,
        ratio_cap=math.inf,
        mask_direction="symmetric",
        kl_tau=IPO_KL_TAU,
        source="IPO: prime-rl's ipo loss (symmetric |pi - mu| > 0.1 mask, kl_tau 1e-3, weight pi / mu uncapped)",
    ),
    "icepop": LossSpec(
        "ratio",
        delta_low=icepop_deltas(*ICEPOP_BAND)[0],
        delta_high=icepop_deltas(*ICEPOP_BAND)[1],
        mask_direction="symmetric",
        source="IcePop: pi / mu outside [0.5, 5] masked in both directions (OpenRLHF icepop's default band)",
    ),
    "dppo_binary_tv_seq_mask": LossSpec(
        "binary_tv",
        sequence_mask=SEQ_MASK,
        source="DPPO Binary-TV with TRL's default sequence mask (product of pi / mu over the response > 3: dropped)",
    ),
}

# --loss names that are another name of a loss above: verl's names of the modes (dppo_ext.contract.MODE_ALIASES,
# dppo_tv -> binary_tv) for the loss of that mode (dppo_binary_tv). A resumed run treats them as the same loss.
LOSS_ALIASES = {
    alias: f"dppo_{mode}" for alias, mode in MODE_ALIASES.items() if alias not in LOSSES and f"dppo_{mode}" in LOSSES
}
LOSSES.update({alias: replace(LOSSES[name], source=f"verl {alias} = {name}") for alias, name in LOSS_ALIASES.items()})


def canonical_loss(name: str) -> str:
    """``name`` with a verl alias replaced by our ``--loss`` name (``dppo_tv`` -> ``dppo_binary_tv``)."""
    return LOSS_ALIASES.get(name, name)

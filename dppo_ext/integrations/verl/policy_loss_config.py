"""``DPPOPolicyLossConfig``: verl's ``PolicyLossConfig`` plus the DPPO mask family's settings.

verl builds ``actor_rollout_ref.actor.policy_loss`` from its ``_target_`` class and refuses keys that class lacks,
so the settings below need this class as the target::

    actor_rollout_ref.actor.policy_loss._target_=dppo_ext.integrations.verl.policy_loss_config.DPPOPolicyLossConfig
    +actor_rollout_ref.actor.policy_loss.dppo_mask_direction=symmetric

The names and meanings are the TRL config's (``DPPOGRPOConfig``) and the API's (docs/names.md); the plugin's
config check (:func:`dppo_ext.integrations.verl.config.validate`) checks them in verl's driver before Ray starts,
and this class checks them again where a worker builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from verl.workers.config.actor import PolicyLossConfig

from .config import check_mask_settings

__all__ = ["DPPOPolicyLossConfig"]


@dataclass
class DPPOPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss settings plus DPPO's (read for the plugin's loss modes only).

    Args:
        dppo_mask_direction: ``"advantage"`` (the paper's) or ``"symmetric"`` (IPO's both-sided trust region).
        dppo_kl_tau, dppo_kl_mask_type: ``kl_tau * (log pi - log mu)^2`` on the response tokens ``dppo_kl_mask_type``
            selects (``all``, ``unmasked``, ``masked``); 0: off.
        dppo_sequence_mask: ``dppo_ext.SequenceMask``'s fields (``statistic``, ``reduce``, ``high``, ``low``,
            ``negative_advantages_only``); each response one sequence; None: off.
        dppo_logits_dtype: None (the model's dtype) or ``"float32"``: the actor's LM head returns float32 products
            for the plugin's loss modes (docs/verl.md, "Limits").
    """

    dppo_mask_direction: str = "advantage"
    dppo_kl_tau: float = 0.0
    dppo_kl_mask_type: str = "all"
    dppo_sequence_mask: Optional[dict[str, Any]] = None
    dppo_logits_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_mask_settings(self)

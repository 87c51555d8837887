"""The plugin's settings checked on verl's whole config, before Ray or any worker starts.

verl's ``main_ppo`` calls ``verl.utils.config.validate_config(config, ...)`` on the composed hydra config in the
driver, before ``ray.init``; the plugin wraps that function (:mod:`dppo_ext.integrations.verl.plugin`) so that
:func:`validate` runs there too, for the V1 trainer and the legacy one alike. Without it a mistyped mode, a bad K or
a missing threshold passed verl's own checks and failed at the first actor update, or inside the rollout server,
minutes into a run.

No verl or compiled-code import on purpose: the config is read through ``.get`` and attribute access, which both
an omegaconf ``DictConfig`` and a plain mapping tree answer. (:mod:`dppo_ext.contract`, for the sampling rule and
dppo_ext's own mode names, loads no compiled code.)

What the rollout must report for the DPPO modes (:func:`check_rollout_distribution`): mu of ``logits / T`` over the
whole vocabulary. ``rollout.logprobs_mode`` must be ``processed_logprobs`` (``raw_logprobs`` is the same thing at
temperature 1 only; logits modes are never log-probs), and where the loss's mu is the rollout's log-probs (the top-K
modes, and any mode under ``algorithm.rollout_correction.bypass_mode``) ``rollout.top_p`` / ``rollout.top_k`` (and a
``min_p``) must not truncate: vLLM's mu is then of the truncated distribution, and verl's rollout does not return
the kept sets the loss would replay (``kept_ids``). (The binary modes outside bypass mode anchor on the actor's
recomputed ``old_log_probs``, a full-vocabulary distribution like pi: truncated sampling leaves their trust region
exact.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

from dppo_ext.contract import check_logits_dtype_setting, check_mask_direction, refuse_truncated_sampling
from dppo_ext.sequence_mask import SequenceMask, check_kl_settings

logger = logging.getLogger(__name__)

__all__ = [
    "DPPO_POLICY_LOSS_TARGET",
    "VERL_MODES",
    "MaskSettings",
    "ModeSpec",
    "Thresholds",
    "check_mask_settings",
    "check_rollout_distribution",
    "check_topk",
    "thresholds",
    "validate",
]

# actor_rollout_ref.rollout.custom.<TOPK_CONFIG_KEY> = K turns the rollout's top-K log-probs on.
TOPK_CONFIG_KEY = "dppo_topk"
# vLLM's default max_logprobs: the largest K a server returns unless engine_kwargs.vllm.max_logprobs raises it.
VLLM_DEFAULT_MAX_LOGPROBS = 20
ACTOR = "actor_rollout_ref.actor"
POLICY_LOSS = f"{ACTOR}.policy_loss"
# The policy_loss class that takes the DPPO settings (verl's PolicyLossConfig refuses keys it lacks).
DPPO_POLICY_LOSS_TARGET = "dppo_ext.integrations.verl.policy_loss_config.DPPOPolicyLossConfig"
ROLLOUT = "actor_rollout_ref.rollout"


class ModeSpec(NamedTuple):
    """How dppo_ext computes one verl loss mode."""

    mode: str  # dppo_ext's mode (docs/contract.md)
    anchor: str  # the batch key of the log-probs used as mu (trust region and weight)
    topk: bool  # needs the rollout's top-K


# verl policy_loss.loss_mode -> dppo_ext's computation.
VERL_MODES = {
    "dppo_topk_tv": ModeSpec("topk_tv", "rollout_log_probs", True),
    "dppo_topk_kl": ModeSpec("topk_kl", "rollout_log_probs", True),
    "dppo_tv": ModeSpec("binary_tv", "old_log_probs", False),
    "dppo_kl": ModeSpec("binary_kl", "old_log_probs", False),
}


class Thresholds(NamedTuple):
    delta_low: float
    delta_high: float
    ratio_cap: float


class MaskSettings(NamedTuple):
    """The mask family's settings of ``policy_loss`` (the API's names without the ``dppo_`` prefix)."""

    mask_direction: str = "advantage"
    kl_tau: float = 0.0
    kl_mask_type: str = "all"
    sequence_mask: Optional[SequenceMask] = None
    logits_dtype: Optional[str] = None  # "float32": the actor's LM head runs in float32 for these modes


# policy_loss key -> its default: the settings DPPOPolicyLossConfig adds to verl's PolicyLossConfig.
DPPO_POLICY_LOSS_KEYS = {
    "dppo_mask_direction": "advantage",
    "dppo_kl_tau": 0.0,
    "dppo_kl_mask_type": "all",
    "dppo_sequence_mask": None,
    "dppo_logits_dtype": None,
}


def check_mask_settings(policy_loss: Any) -> MaskSettings:
    """The DPPO settings of a verl ``policy_loss`` config (a ``DPPOPolicyLossConfig``, its hydra node or a mapping),
    each checked; ValueError naming the setting, its value and what is expected."""

    def value(key: str) -> Any:
        return _get(policy_loss, key, DPPO_POLICY_LOSS_KEYS[key])

    direction = check_mask_direction(value("dppo_mask_direction"), f"{POLICY_LOSS}.dppo_mask_direction")
    check_kl_settings(value("dppo_kl_tau"), value("dppo_kl_mask_type"), prefix=f"{POLICY_LOSS}.dppo_")
    sequence_mask = SequenceMask.from_config(value("dppo_sequence_mask"), f"{POLICY_LOSS}.dppo_sequence_mask")
    logits_dtype = check_logits_dtype_setting(value("dppo_logits_dtype"), f"{POLICY_LOSS}.dppo_logits_dtype")
    return MaskSettings(
        direction,
        float(value("dppo_kl_tau")),
        value("dppo_kl_mask_type"),
        sequence_mask,
        None if logits_dtype is None else value("dppo_logits_dtype"),
    )


def _get(node: Any, key: str, default: Any = None) -> Any:
    if node is None:
        return default
    if isinstance(node, Mapping) or hasattr(node, "get"):
        return node.get(key, default)
    return getattr(node, key, default)


def _has(node: Any, key: str) -> bool:
    """Whether a config node (a mapping or a dataclass config) holds ``key``."""
    missing = object()
    return _get(node, key, missing) is not missing


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def thresholds(actor: Any) -> Thresholds:
    """``(delta_low, delta_high, ratio_cap)`` of a verl actor config, each checked, with verl's fallbacks.

    ``clip_ratio_low`` / ``clip_ratio_high`` fall back to ``clip_ratio`` (as verl's DPPO losses read them);
    ``clip_ratio_c`` is the cap of the weight ``min(pi / mu, C)``. Raises ``ValueError`` naming the setting.
    """
    fallback = _get(actor, "clip_ratio")
    deltas = []
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = _get(actor, name)
        source = f"{ACTOR}.{name}"
        if value is None:
            value, source = fallback, f"{ACTOR}.clip_ratio (the fallback of {ACTOR}.{name}, which is None)"
            if value is None:
                raise ValueError(
                    f"{ACTOR}.{name} is None and so is its fallback {ACTOR}.clip_ratio: the DPPO loss modes need a "
                    f"divergence threshold; set {ACTOR}.{name} (a probability difference for the TV modes, e.g. "
                    "0.15; nats for the KL modes, e.g. 0.05)"
                )
        if not _is_number(value) or not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{source} must be a finite number >= 0 (a DPPO divergence threshold), got {value!r}")
        deltas.append(float(value))
    cap = _get(actor, "clip_ratio_c", 3.0)
    if not _is_number(cap) or math.isnan(cap) or not cap > 0:
        raise ValueError(
            f"{ACTOR}.clip_ratio_c must be a number > 0 (the cap C of the DPPO weight min(pi / mu, C)), got {cap!r}"
        )
    return Thresholds(deltas[0], deltas[1], float(cap))


def check_topk(value: Any, max_logprobs: Optional[int] = None) -> int:
    """K of ``rollout.custom.dppo_topk`` (0: not set), checked: an int >= 1 and at most vLLM's ``max_logprobs``."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{ROLLOUT}.custom.{TOPK_CONFIG_KEY} must be an int >= 1 (the K of the top-K DPPO modes), got {value!r}"
        )
    if max_logprobs is not None and value > max_logprobs:
        raise ValueError(
            f"{ROLLOUT}.custom.{TOPK_CONFIG_KEY}={value} is more than vLLM returns (max_logprobs={max_logprobs}): "
            f"lower K or raise it with +{ROLLOUT}.engine_kwargs.vllm.max_logprobs={value}"
        )
    return value


def check_rollout_distribution(rollout: Any, mode: str, mu_is_rollout: bool) -> None:
    """The rollout's log-probs and sampling for DPPO mode ``mode`` (see the module docstring); ``mu_is_rollout``: the
    loss's mu is the rollout's log-probs. Raises ``ValueError`` naming the setting, its value and the fix."""
    logprobs_mode = _get(rollout, "logprobs_mode", "processed_logprobs")
    temperature = _get(rollout, "temperature", 1.0)
    if logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
        raise ValueError(
            f"{ROLLOUT}.logprobs_mode={logprobs_mode!r} does not report log-probs: mu of {ACTOR}.policy_loss."
            f"loss_mode={mode} must be vLLM's log-softmax of logits / T; set {ROLLOUT}.logprobs_mode=processed_logprobs"
        )
    if logprobs_mode == "raw_logprobs" and temperature != 1.0:
        raise ValueError(
            f"{ROLLOUT}.logprobs_mode=raw_logprobs at {ROLLOUT}.temperature={temperature}: mu (and the top-K) are "
            f"then log-probs of the raw logits, not of logits / T, which the actor scores, so every token of "
            f"loss_mode={mode} looks mismatched; set {ROLLOUT}.logprobs_mode=processed_logprobs (raw_logprobs "
            "equals it at temperature 1 only)"
        )
    if mu_is_rollout:
        names = {key: f"{ROLLOUT}.{key}" for key in ("top_k", "top_p", "min_p")}
        top_p = _get(rollout, "top_p", 1.0)
        refuse_truncated_sampling(
            _get(rollout, "top_k", -1), 1.0 if top_p is None else top_p, _get(rollout, "min_p"), names=names
        )


def _max_logprobs(rollout: Any) -> Optional[int]:
    """``engine_kwargs.vllm.max_logprobs`` checked: vLLM's default when unset, None for -1 (vLLM's "no cap")."""
    value = _get(_get(_get(rollout, "engine_kwargs"), "vllm"), "max_logprobs")
    if value is None:
        return VLLM_DEFAULT_MAX_LOGPROBS
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(
            f"{ROLLOUT}.engine_kwargs.vllm.max_logprobs must be an int >= 0 (the most log-probs vLLM returns per "
            f"token) or -1 (no cap), got {value!r}"
        )
    return None if value == -1 else value


def validate(config: Any) -> None:
    """Check the plugin's settings in verl's composed ``ppo_trainer`` config; raise ``ValueError`` naming the first
    wrong one. Configs that use none of the plugin's modes and no ``custom.dppo_topk`` pass untouched."""
    arr = _get(config, "actor_rollout_ref")
    actor, rollout = _get(arr, "actor"), _get(arr, "rollout")
    mode = _get(_get(actor, "policy_loss"), "loss_mode", "vanilla")
    custom = _get(rollout, "custom")
    k = check_topk(_get(custom, TOPK_CONFIG_KEY), _max_logprobs(rollout)) if custom else 0
    policy_loss = _get(actor, "policy_loss")
    dppo_keys = [key for key in DPPO_POLICY_LOSS_KEYS if _has(policy_loss, key)]
    if mode not in VERL_MODES:
        ours = _verl_name_of_ours(mode)
        if ours is not None:
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={mode!r} is dppo_ext's name, not a verl loss mode: "
                + (
                    f"in verl the plugin computes it as loss_mode={ours}"
                    if ours
                    else f"the verl plugin does not provide it (it provides {tuple(VERL_MODES)})"
                )
                + " (docs/names.md, 'Modes')"
            )
        if isinstance(mode, str) and mode.strip().lower().replace("-", "_") in VERL_MODES:
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={mode!r} is not a loss mode (names are case- and "
                f"spelling-exact): did you mean {mode.strip().lower().replace('-', '_')!r}?"
            )
        if isinstance(mode, str) and mode.lower().startswith("dppo") and mode not in _verl_registry():
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={mode!r} is not a DPPO loss mode; dppo_ext's verl plugin "
                f"provides {tuple(VERL_MODES)}"
            )
        if k:
            logger.warning(
                "%s.custom.%s=%d is set but %s.policy_loss.loss_mode=%r does not read the top-K",
                ROLLOUT,
                TOPK_CONFIG_KEY,
                k,
                ACTOR,
                mode,
            )
        changed = [key for key in dppo_keys if _get(policy_loss, key) != DPPO_POLICY_LOSS_KEYS[key]]
        if changed:
            logger.warning(
                "%s.%s: read by the plugin's loss modes only, not by loss_mode=%r", POLICY_LOSS, changed, mode
            )
        return
    target = _get(policy_loss, "_target_")
    if dppo_keys and isinstance(target, str) and target and target != DPPO_POLICY_LOSS_TARGET:
        raise ValueError(
            f"{POLICY_LOSS} sets {dppo_keys}, which verl's {target} refuses when a worker builds "
            f"it: set {POLICY_LOSS}._target_={DPPO_POLICY_LOSS_TARGET} (verl's policy-loss settings plus DPPO's)"
        )
    check_mask_settings(policy_loss)
    spec = VERL_MODES[mode]
    thresholds(actor)
    strategy = _get(actor, "strategy")
    if strategy not in ("fsdp", "fsdp2"):
        message = (
            f"{ACTOR}.policy_loss.loss_mode={mode} is computed by dppo_ext inside verl's FSDP engine "
            f"({ACTOR}.strategy=fsdp or fsdp2), got strategy={strategy!r}"
        )
        if spec.topk:
            raise ValueError(message)
        logger.warning("%s; verl's own %s runs instead", message, mode)
    for flag, what in (
        (
            _get(_get(arr, "model"), "use_fused_kernels", False),
            "actor_rollout_ref.model.use_fused_kernels=True (the fused kernels never form the logits)",
        ),
        ((_get(actor, "ulysses_sequence_parallel_size", 1) or 1) > 1, f"{ACTOR}.ulysses_sequence_parallel_size > 1"),
    ):
        if flag:
            raise ValueError(f"{ACTOR}.policy_loss.loss_mode={mode} (dppo_ext) does not support {what}")
    bypass = bool(_get(_get(_get(config, "algorithm"), "rollout_correction"), "bypass_mode", False))
    use_v1 = bool(_get(_get(config, "trainer"), "use_v1", True))
    if bypass and not use_v1:
        raise ValueError(
            f"algorithm.rollout_correction.bypass_mode=True with the legacy trainer (trainer.use_v1=False) replaces "
            f"{ACTOR}.policy_loss.loss_mode={mode} by verl's own 'bypass_mode' loss (rollout_corr_helper."
            "apply_bypass_mode), so the DPPO loss would never run: use the V1 trainer (trainer.use_v1=True, verl's "
            "default), where bypass mode keeps the loss mode, or turn bypass_mode off"
        )
    if spec.topk:
        if not k:
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={mode} needs the rollout's top-K log-probs: set "
                f"+{ROLLOUT}.custom.{TOPK_CONFIG_KEY}=K (K >= 1, at most vLLM's max_logprobs, "
                f"{'no cap' if _max_logprobs(rollout) is None else _max_logprobs(rollout)})"
            )
        name = _get(rollout, "name")
        if name != "vllm":
            raise ValueError(
                f"{ACTOR}.policy_loss.loss_mode={mode} needs verl's vLLM rollout ({ROLLOUT}.name=vllm), "
                f"whose server the plugin makes return the top-K; got name={name!r}"
            )
    check_rollout_distribution(rollout, mode, spec.anchor == "rollout_log_probs" or bypass)


def _verl_name_of_ours(mode: Any) -> Optional[str]:
    """For one of dppo_ext's own mode names or aliases (``binary_tv``, ``dppo_binary_kl``, ``ratio``, ...): the verl
    loss mode that computes it ("" where the plugin has none); None for any other name.

    dppo_ext's names live in :mod:`dppo_ext.contract`, which imports torch; verl's driver has torch loaded already,
    and this runs only for a name that is not one of the plugin's verl modes."""
    if not isinstance(mode, str):
        return None
    from dppo_ext.contract import MODE_ALIASES, MODES

    if mode not in MODES and mode not in MODE_ALIASES:
        return None
    canonical = MODE_ALIASES.get(mode, mode)
    return next((name for name, spec in VERL_MODES.items() if spec.mode == canonical), "")


def _verl_registry() -> frozenset[str]:
    """The policy losses verl knows (empty where verl is not importable)."""
    try:
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
    except ImportError:
        return frozenset()
    return frozenset(POLICY_LOSS_REGISTRY)

"""The LM head of a transformers causal LM, as a loss that applies it to the last hidden states sees it.

A loss that computes the logits itself (the fused LM head of the TRL integration, the reference trainer's float32
logits) applies ``hidden @ weight^T (+ bias)`` and nothing else; a model whose forward also soft-caps or rescales that
output would then be trained on other logits than the ones it samples with. :func:`check_plain_logits` refuses it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOGIT_TRANSFORMS", "check_plain_logits"]

# Config fields with which a model's forward rescales or soft-caps the LM head's output (as TRL lists them).
LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "output_multiplier",
    "lm_head_multiplier",
    "logits_scaling",
)


def check_plain_logits(config: Any, user: str, fix: str = "") -> None:
    """Refuse a model whose forward soft-caps or rescales the LM head's output (``config``: its transformers config);
    ``user`` names who computes the logits from the hidden states, ``fix`` (optional) what to do instead."""
    text_config = config.get_text_config()
    transforms = {name: getattr(text_config, name, None) for name in LOGIT_TRANSFORMS}
    transforms = {name: value for name, value in transforms.items() if value is not None and value != 1.0}
    if transforms:
        raise ValueError(
            f"{user} does not support models that transform the LM head's logits in their forward (config has "
            f"{transforms}); the DPPO loss is computed from the plain LM-head output" + (f": {fix}" if fix else "")
        )

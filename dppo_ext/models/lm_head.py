"""The LM head of a transformers causal LM, as a loss that applies it to the last hidden states sees it.

A loss that computes the logits itself (the fused LM head of the TRL integration) applies ``hidden @ weight^T
(+ bias)`` and nothing else; a model whose forward also soft-caps or rescales that output would then be trained on
other logits than the ones it samples with. :func:`check_plain_logits` refuses it. :func:`widened_head` runs a
16-bit model's own head in float32 (the reference trainer's ``--logits-dtype float32``, verl's
``policy_loss.dppo_logits_dtype``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["LOGIT_TRANSFORMS", "check_plain_logits", "widened_head"]

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


@contextlib.contextmanager
def widened_head(model: Any, dtype: Any) -> Iterator[None]:
    """While the block runs, ``model``'s LM head (``get_output_embeddings()``) computes its products in ``dtype``
    (``torch.float32`` for a bfloat16 / float16 model): the operands widened, the products accumulated and kept in
    ``dtype`` (the weight widened once per call; autocast off for the product, which verl's bf16 forward would
    otherwise narrow again), what the model does after its head applied to them as before. The head's ``forward``
    is replaced, not wrapped in a hook: the 16-bit product is never computed, and hooks on the head (FSDP2's, whose
    post-forward reshards the weight and hooks its backward onto the output) see the widened call as the head's own.
    The gradient reaches the 16-bit weight and hidden states through the casts."""
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()

    def widened(hidden: torch.Tensor) -> torch.Tensor:
        bias = None if getattr(head, "bias", None) is None else head.bias.to(dtype)
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            return F.linear(hidden.to(dtype), head.weight.to(dtype), bias)

    had_own = "forward" in vars(head)
    previous = vars(head).get("forward")
    head.forward = widened
    try:
        yield
    finally:
        if had_own:
            head.forward = previous
        else:
            del head.forward

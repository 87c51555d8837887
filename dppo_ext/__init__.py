"""dppo_ext: a fused, memory-light DPPO loss for LLM reinforcement learning.

    from dppo_ext import dppo_loss, fused_linear_dppo_loss
    loss, metrics = dppo_loss(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    loss, metrics = fused_linear_dppo_loss(hidden, lm_head.weight, tokens, rollout_logprobs, advantages,
                                           response_mask=mask)  # the same, without the [N, V] logits

The ops are registered as ``torch.ops.dppo.*`` by the native library ``dppo_ext._C``; the math
contract is in docs/contract.md, other projects' names for our settings in docs/names.md.

The names below that need the library load it on first use (module ``__getattr__``), so the
pure-Python parts (``dppo_ext.reference``, the tasks, the models) import without it, and
a missing or mismatched library is reported by ``dppo_ext._native`` with the command that
rebuilds it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# Public name -> the submodule that defines it. Importing any of these loads dppo_ext._C.
_LAZY = {
    "cuda_compiled": "_native",
    "FusedLinearDPPOLoss": "fused_linear",
    "fused_linear_dppo_loss": "fused_linear",
    "fused_linear_dppo_loss_per_row": "fused_linear",
    "AGG_MODES": "loss",
    "DEFAULT_DELTAS": "loss",
    "DPPOLoss": "loss",
    "aggregate_loss": "loss",
    "dppo_loss": "loss",
    "dppo_metrics": "loss",
    "MODE_ALIASES": "ops",
    "MODES": "ops",
    "DPPOOutputs": "ops",
    "dppo_loss_backward": "ops",
    "dppo_loss_forward": "ops",
    "dppo_loss_forward_vocab_parallel": "vocab_parallel",
}

__all__ = ["__version__", *sorted(_LAZY)]

if TYPE_CHECKING:
    from ._native import cuda_compiled
    from .fused_linear import FusedLinearDPPOLoss, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row
    from .loss import AGG_MODES, DEFAULT_DELTAS, DPPOLoss, aggregate_loss, dppo_loss, dppo_metrics
    from .ops import MODE_ALIASES, MODES, DPPOOutputs, dppo_loss_backward, dppo_loss_forward
    from .vocab_parallel import dppo_loss_forward_vocab_parallel


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

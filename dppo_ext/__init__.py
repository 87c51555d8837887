"""dppo_ext: a fused, memory-light DPPO loss for LLM reinforcement learning.

    from dppo_ext import dppo_loss, fused_linear_dppo_loss
    loss, metrics = dppo_loss(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    loss, metrics = fused_linear_dppo_loss(hidden, lm_head.weight, tokens, rollout_logprobs, advantages,
                                           response_mask=mask)  # the same, without the [N, V] logits

The ops are registered as ``torch.ops.dppo.*`` by the native library ``dppo_ext._C``; the math
contract is in docs/contract.md, other projects' names for our settings in docs/names.md.

The constants (``MODES``, ``MASK_DIRECTIONS``, ``AGG_MODES``, ``DEFAULT_DELTAS``, ``MODE_ALIASES``),
``icepop_deltas``, ``SequenceMask`` and the aggregation helpers are pure Python. The names that need the library load
it on first use (module ``__getattr__``), so the pure-Python parts (``dppo_ext.reference``, the tasks, the models)
import without it, and a missing or mismatched library is reported by ``dppo_ext._native`` with the command that
rebuilds it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# torch first: dppo_ext._C links against torch's libraries, so that `import dppo_ext._C` finds them loaded.
import torch  # noqa: F401

from ._rows import DPPOOutputs
from ._version import __version__
from .aggregation import aggregate_loss, dppo_metrics, micro_batch_scale
from .contract import AGG_MODES, DEFAULT_DELTAS, MASK_DIRECTIONS, MODE_ALIASES, MODES, icepop_deltas
from .sequence_mask import SequenceMask

# The names that need dppo_ext._C: public name -> the submodule that defines it, imported on first use
# (``__getattr__``). Type checkers read the same names from the ``if TYPE_CHECKING:`` block below;
# python_tests/repo/test_public_api.py checks that the two agree.
_LAZY = {
    "cpu_cached_bytes": "_native",
    "cpu_capability": "_native",
    "cuda_compiled": "_native",
    "empty_cpu_cache": "_native",
    "DPPOLoss": "modules",
    "dppo_loss": "loss",
    "dppo_loss_per_row": "loss",
    "FusedLinearDPPOLoss": "modules",
    "fused_linear_dppo_loss": "fused_linear",
    "fused_linear_dppo_loss_per_row": "fused_linear",
}
if TYPE_CHECKING:
    from ._native import cpu_cached_bytes, cpu_capability, cuda_compiled, empty_cpu_cache
    from .fused_linear import fused_linear_dppo_loss, fused_linear_dppo_loss_per_row
    from .loss import dppo_loss, dppo_loss_per_row
    from .modules import DPPOLoss, FusedLinearDPPOLoss

__all__ = sorted(
    [
        "__version__",
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "DPPOOutputs",
        "MASK_DIRECTIONS",
        "MODES",
        "MODE_ALIASES",
        "SequenceMask",
        "aggregate_loss",
        "dppo_metrics",
        "icepop_deltas",
        "micro_batch_scale",
        *_LAZY,
    ]
)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

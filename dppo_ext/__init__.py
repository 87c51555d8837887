"""dppo_ext: a fused, memory-light DPPO loss for LLM reinforcement learning.

    from dppo_ext import dppo_loss, fused_linear_dppo_loss
    loss, metrics = dppo_loss(logits, tokens, rollout_logprobs, advantages, response_mask=mask)
    loss, metrics = fused_linear_dppo_loss(hidden, lm_head.weight, tokens, rollout_logprobs, advantages,
                                           response_mask=mask)  # the same, without the [N, V] logits

The ops are registered as ``torch.ops.dppo.*`` by the native library ``dppo_ext._C``; the math
contract is in docs/contract.md, other projects' names for our settings in docs/names.md.
"""

import torch  # noqa: F401  (loads libtorch/libc10, which the native library links against)

try:
    from . import _C  # noqa: F401  (loads the library: registers torch.ops.dppo.*)
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"dppo_ext's native library dppo_ext._C could not be loaded ({exc}). Build it from the repository "
        "root with: pip install --no-build-isolation --no-deps -e .  (it must be built against the torch "
        "that is installed now)") from exc

from ._C import __version__, cuda_compiled  # noqa: E402
from .fused_linear import FusedLinearDPPOLoss, fused_linear_dppo_loss, fused_linear_dppo_loss_per_row  # noqa: E402
from .loss import AGG_MODES, DEFAULT_DELTAS, DPPOLoss, aggregate_loss, dppo_loss, dppo_metrics  # noqa: E402
from .ops import MODE_ALIASES, MODES, DPPOOutputs, dppo_loss_backward, dppo_loss_forward  # noqa: E402
from .vocab_parallel import dppo_loss_forward_vocab_parallel  # noqa: E402

__all__ = [
    "AGG_MODES", "DEFAULT_DELTAS", "DPPOLoss", "DPPOOutputs", "FusedLinearDPPOLoss", "MODES", "MODE_ALIASES",
    "__version__", "aggregate_loss", "cuda_compiled", "dppo_loss", "dppo_loss_backward", "dppo_loss_forward",
    "dppo_loss_forward_vocab_parallel", "dppo_metrics", "fused_linear_dppo_loss", "fused_linear_dppo_loss_per_row",
]

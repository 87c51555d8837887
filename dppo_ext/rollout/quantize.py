"""Rollout-side weight quantisation: a same-weights precision mismatch of a chosen size.

With ``rollout_weight_bits = b`` the engine rolls out with a copy of the trainer's weights in which the weight
of every linear layer except the LM head is rounded to ``b``-bit symmetric integers, one scale per group of
``group`` consecutive input weights of an output row (the layout of GPTQ / AWQ int4 checkpoints, without their
calibration: round to nearest, ties to even)::

    s = max |w_g| / (2^(b-1) - 1),    w_g <- s * round(w_g / s)        (s = 0: the group stays 0)

The LM head, the embeddings, the norms and the biases keep the trainer's values, as weight-only int4 deployments
keep them. The trainer scores ``pi`` with its own weights, so ``|pi - mu|`` is the rounding's effect on the
policy: unlike a rollout lag it does not saturate, it grows as the policy sharpens (a sharper softmax turns the
same logit error into more probability). Non-finite weights stay non-finite: a group holding one quantises to
NaN, which the engine's sync guard reports.
"""

from __future__ import annotations

import torch

from dppo_ext.contract import ROLLOUT_WEIGHT_BITS

__all__ = ["check_weight_quantization", "fake_quantize", "quantize_rollout_weights_"]


def check_weight_quantization(bits: int, group: int) -> None:
    """Raise ``ValueError`` unless ``bits`` is one of ``ROLLOUT_WEIGHT_BITS`` and ``group`` an int >= 1."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in ROLLOUT_WEIGHT_BITS:
        raise ValueError(f"bits must be one of {list(ROLLOUT_WEIGHT_BITS)} (integer width), got {bits!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be an int >= 1 (input weights per scale), got {group!r}")


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """``weight`` (``[out, in]``) rounded to ``bits``-bit integers times one float32 scale per ``group`` input
    weights of a row (the last group of a row may be shorter), returned in ``weight``'s dtype and shape."""
    check_weight_quantization(bits, group)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    return _rounded(weight, bits, group)


def _rounded(weight: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """:func:`fake_quantize` of a checked 2-D ``weight``."""
    rows, cols = weight.shape
    if weight.numel() == 0:
        return weight.clone()
    pad = -cols % group
    w = torch.nn.functional.pad(weight.detach().float(), (0, pad)).view(rows, -1, group)
    top = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=-1, keepdim=True) / top
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale gives zeros
    q = torch.round(w / safe).clamp_(-top, top) * scale
    return q.view(rows, -1)[:, :cols].to(weight.dtype)


@torch.no_grad()
def quantize_rollout_weights_(model: torch.nn.Module, bits: int, group: int) -> list[str]:
    """Fake-quantise, in place, the weight of every ``torch.nn.Linear`` in ``model`` except its LM head
    (``get_output_embeddings()``); return the names of the modules quantised."""
    check_weight_quantization(bits, group)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    done = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module is not head:
            module.weight.copy_(_rounded(module.weight, bits, group))  # nn.Linear weights are 2-D
            done.append(name)
    if not done:
        raise ValueError(
            f"rollout weight quantisation found no linear layer to quantise in {type(model).__name__} (the LM head "
            "is left out); expected a transformer with nn.Linear projections"
        )
    return done

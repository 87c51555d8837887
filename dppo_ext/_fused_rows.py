"""The fused LM-head + DPPO per-row outputs on flat rows with resolved settings, on one device or across a
vocabulary-parallel group: the one call below ``fused_linear_dppo_loss_per_row`` and the recompute path of
``fused_linear_dppo_loss`` (``dppo_ext.fused_linear``, whose docstring gives the design)."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional, Sequence

import torch

from . import vocab_parallel
from ._agreement import Rendezvous
from ._fused_autograd import FusedLinearRecompute
from ._lm_head_tiles import check_fused_inputs, plan_chunks, resolve_logits_dtype
from ._rows import DPPOOutputs, LossSettings, RowInputs

__all__ = ["per_row_outputs"]


def per_row_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    rows: RowInputs,
    settings: LossSettings,
    chunk_size: Optional[int],
    vocab_chunk_size: Optional[int],
    memory_budget_bytes: Optional[int],
    weight_context: Optional[Callable[[], ContextManager]],
    rendezvous: Optional[Rendezvous],
    vocab_offsets: Optional[Sequence[int]],
    reduce_hidden_grad: bool = True,
    logits_dtype: Optional[torch.dtype] = None,
) -> DPPOOutputs:
    """The per-row outputs on flat rows with resolved settings: the single-device fused function, or its
    vocab-parallel form inside ``vocab_parallel_call(vocab_parallel_group)`` (``rendezvous``)."""
    logits_dtype = resolve_logits_dtype(logits_dtype, hidden.dtype)
    if rendezvous is not None:
        if logits_dtype is not None:
            raise ValueError(
                f"logits_dtype={logits_dtype} is not supported with vocab_parallel_group yet (each rank's tiles are "
                f"in hidden's dtype {hidden.dtype}); leave logits_dtype=None"
            )
        if vocab_chunk_size is not None or weight_context is not None:
            raise ValueError(
                "vocab_chunk_size and weight_context are not supported with vocab_parallel_group (each "
                "rank's weight slice is used whole and must be materialised)"
            )
        return vocab_parallel.fused_linear_rows(
            hidden,
            weight,
            bias,
            rows,
            settings,
            chunk_size=chunk_size,
            memory_budget_bytes=memory_budget_bytes,
            rendezvous=rendezvous,
            vocab_offsets=vocab_offsets,
            reduce_hidden_grad=reduce_hidden_grad,
        )
    check_fused_inputs(hidden, weight, bias, rows)
    (n, hidden_size), vocab = hidden.shape, weight.shape[0]
    chunking = dict(chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size, memory_budget_bytes=memory_budget_bytes)
    plan = plan_chunks(n, vocab, hidden_size, hidden.dtype, logits_dtype=logits_dtype, **chunking)
    return DPPOOutputs(
        *FusedLinearRecompute.apply(
            hidden, weight, bias, rows, settings, plan, weight_context or contextlib.nullcontext
        )
    )

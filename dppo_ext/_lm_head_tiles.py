"""The LM head in tiles: how the fused-linear entry points compute ``hidden @ weight^T (+ bias)`` without ever
holding the ``[N, V]`` logits.

- :func:`plan_chunks` / :class:`FusedLinearPlan`: the rows per forward chunk and the backward tile (rows x
  vocabulary block) for a memory budget; :func:`check_chunk_settings` the rules of its settings.
- :func:`check_fused_inputs`: the shape/dtype/device rules of ``hidden [N, H]``, ``weight [V, H]``, ``bias [V]``
  and the per-row inputs, checked once per call (the per-tile op calls cannot phrase them for the whole call).
- :func:`logits_tiles`: THE tile loop. It fills one reused buffer with each tile's logits; the fused-linear
  forward, its backward and the vocabulary-parallel fused path all iterate it.
- :func:`head_backward`: the LM head's gradients from the tiles' logits gradients: ``grad_hidden += g @ W_b``,
  ``grad_weight[b] += g^T @ h``, ``grad_bias[b] += g.sum(0)``, with float32 (float64) accumulators only where
  partial sums are added across tiles.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, NamedTuple, Optional

import torch
from torch import Tensor

from ._rows import RowInputs
from .contract import LOGITS_DTYPES, accumulation_dtype

__all__ = [
    "FusedLinearPlan",
    "LogitsTile",
    "check_accum_dtype",
    "check_chunk_settings",
    "check_fused_inputs",
    "head_backward",
    "logits_tiles",
    "plan_chunks",
    "resolve_accum_dtype",
]

# Smallest vocabulary block the automatic plan uses before it also splits rows (keeps matmuls efficient).
MIN_VOCAB_BLOCK = 2048
# Default memory budget for one logits buffer: max(this, the size of ``hidden``).
DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024
# Rows per chunk of a training forward, which computes the LM head's gradients chunk by chunk
# (plan_chunks(grads_in_forward=True)). Each chunk's three products stream a whole [V, H] operand once (the BLAS
# packs W for h_c @ W^T and for g @ W; g^T @ h_c reads and writes grad_weight), a cost of ~1/rows of the chunk's
# own multiply-adds whatever V and H are: at N=2048, H=512, V=32768, float32, AVX-512, 2 threads, the two W
# products took 1.30x (128 rows) and 1.20x (256 rows) their time as one 2048-row product, the grad_weight product
# 1.0x. The default is at least this many rows, and H / 4 rows when that is more (a chunk's logits then cost at most
# a quarter of the weight gradient's memory): whole steps against the logits path are in docs/results.md.
MIN_TRAINING_CHUNK_ROWS = 256
# More rows when they fit in this many bytes of logits (a small vocabulary).
TRAINING_CHUNK_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class FusedLinearPlan:
    """Chunking of one fused-linear call.

    chunk_rows: rows per forward chunk (forward buffer ``[chunk_rows, V]``).
    tile_rows, vocab_block: backward tile (buffer ``[tile_rows, vocab_block + 1]``).
    """

    chunk_rows: int
    tile_rows: int
    vocab_block: int

    def buffer_bytes(self, vocab: int, element_size: int) -> int:
        """Largest logits buffer the plan allocates, in bytes."""
        forward = self.chunk_rows * vocab
        backward = self.tile_rows * (self.vocab_block + (1 if self.vocab_block < vocab else 0))
        return max(forward, backward) * element_size


def check_chunk_settings(
    chunk_size: Optional[int], vocab_chunk_size: Optional[int], memory_budget_bytes: Optional[int]
) -> None:
    """The chunking settings' rules: positive ints (a budget in bytes), or None for automatic."""
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if memory_budget_bytes is not None and memory_budget_bytes < 1:
        raise ValueError(f"memory_budget_bytes must be positive or None, got {memory_budget_bytes!r}")


def check_accum_dtype(accum_dtype: Optional[torch.dtype]) -> None:
    """``accum_dtype`` is None or a floating-point ``torch.dtype`` (which ones a call accepts depends on hidden's
    dtype, see :func:`resolve_accum_dtype`)."""
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be None or a floating-point torch.dtype, got {accum_dtype!r}")


def resolve_accum_dtype(accum_dtype: Optional[torch.dtype], dtype: torch.dtype) -> torch.dtype:
    """The dtype of the weight gradient's partial sums across row chunks for ``dtype`` inputs: ``accum_dtype``, or
    by default ``dtype`` itself (the gradient's own dtype). Only that and the accumulation dtype (float32; float64
    for float64 inputs) are accepted."""
    check_accum_dtype(accum_dtype)
    if accum_dtype is None:
        return dtype
    wide = accumulation_dtype(dtype)
    if accum_dtype not in (wide, dtype):
        allowed = f"None or {dtype}" if wide == dtype else f"None, {wide} or {dtype} (hidden's dtype)"
        raise TypeError(f"accum_dtype must be {allowed} for {dtype} hidden, got {accum_dtype}")
    return accum_dtype


def plan_chunks(
    num_rows: int,
    vocab: int,
    hidden_size: int,
    dtype: torch.dtype,
    *,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    grads_in_forward: bool = False,
) -> FusedLinearPlan:
    """Choose chunk sizes for ``num_rows`` rows, a ``[vocab, hidden_size]`` weight and ``dtype``.

    Automatic plan: a logits buffer of at most ``memory_budget_bytes`` (default: max(64 MiB, the size of the hidden
    states [N, H])). Forward chunks take as many whole rows as fit. The backward keeps all rows in one tile and
    splits the vocabulary into blocks of at least 2048 columns; only when even that does not fit are rows split too.
    ``chunk_size`` (rows) overrides the forward chunk and the backward tile rows; ``vocab_chunk_size`` overrides the
    backward vocabulary block (default with ``chunk_size``: the whole vocabulary).

    ``grads_in_forward``: the plan of a forward that computes the LM head's gradients chunk by chunk (no backward
    tile: ``tile_rows = vocab_block = 0``): chunks of ``chunk_size`` rows, else as many as fit in
    ``memory_budget_bytes``, else the larger of ``MIN_TRAINING_CHUNK_ROWS`` and ``hidden_size // 4`` (a chunk's
    logits then take at most a quarter of the weight gradient's size once rows pass the minimum), or as many as fit
    in ``TRAINING_CHUNK_BYTES`` (the same for either ``accum_dtype``).
    """
    check_chunk_settings(chunk_size, vocab_chunk_size, memory_budget_bytes)
    rows = max(num_rows, 1)
    element_size = torch.empty((), dtype=dtype).element_size()
    if grads_in_forward:  # forward chunks only: there is no backward tile
        if chunk_size is not None:
            chunk_rows = chunk_size
        elif memory_budget_bytes is None:
            min_rows = max(MIN_TRAINING_CHUNK_ROWS, hidden_size // 4)
            chunk_rows = max(TRAINING_CHUNK_BYTES // (vocab * element_size), min_rows)
        else:
            chunk_rows = max(memory_budget_bytes // (vocab * element_size), 1)
        return FusedLinearPlan(min(chunk_rows, rows), 0, 0)
    if memory_budget_bytes is None:
        memory_budget_bytes = max(DEFAULT_BUDGET_BYTES, rows * hidden_size * element_size)
    budget_elems = max(memory_budget_bytes // element_size, 1)
    if chunk_size is not None:
        chunk_rows = min(chunk_size, rows)
        tile_rows = chunk_rows
        vocab_block = min(vocab_chunk_size or vocab, vocab)
        return FusedLinearPlan(chunk_rows, tile_rows, vocab_block)
    chunk_rows = min(max(budget_elems // vocab, 1), rows)
    if vocab_chunk_size is not None:
        vocab_block = min(vocab_chunk_size, vocab)
    elif rows * vocab <= budget_elems:
        vocab_block = vocab
    else:
        # one column of every blocked tile is the off-block padding column
        vocab_block = min(vocab, max(budget_elems // rows - 1, MIN_VOCAB_BLOCK))
    tile_rows = min(rows, max(budget_elems // (vocab_block + 1), 1))
    return FusedLinearPlan(chunk_rows, tile_rows, vocab_block)


def check_fused_inputs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], rows: RowInputs) -> None:
    """Shape/dtype/device checks the per-tile ops cannot phrase in terms of the whole call."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be 2-D [V, H] with H={hidden.shape[1]} (hidden's last dim), got shape {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype must equal hidden dtype {hidden.dtype}, got {weight.dtype}")
    if hidden.dtype not in LOGITS_DTYPES:
        raise TypeError(f"hidden must be float32, float16, bfloat16 or float64, got {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"weight must be on hidden's device {hidden.device}, got {weight.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [V] with V={weight.shape[0]}, got shape {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(
                f"bias must have hidden's dtype {hidden.dtype} and device {hidden.device}, "
                f"got {bias.dtype} on {bias.device}"
            )
    n = hidden.shape[0]
    if rows.tokens.shape != (n,):
        raise ValueError(
            f"tokens must be 1-D with N={n} rows (hidden's first dim), got shape {tuple(rows.tokens.shape)}"
        )
    for name in ("rollout_logprobs", "advantages", "anchor_logprobs"):
        tensor = getattr(rows, name)
        if tensor is not None and tensor.shape != (n,):
            raise ValueError(f"{name} must be 1-D with N={n} rows, got shape {tuple(tensor.shape)}")
    for name, width in (("topk_ids", "K"), ("topk_logprobs", "K"), ("kept_ids", "S")):
        tensor = getattr(rows, name)
        if tensor is not None and (tensor.dim() != 2 or tensor.shape[0] != n):
            raise ValueError(f"{name} must be 2-D [N={n}, {width}], got shape {tuple(tensor.shape)}")


class LogitsTile(NamedTuple):
    """One tile of ``hidden @ weight^T (+ bias)``: rows ``rows`` x vocabulary columns ``cols``."""

    rows: slice
    cols: slice
    hidden: Tensor  # [r, H], hidden[rows]
    logits: Tensor  # [r, c], the tile's logits in the reused buffer (a view of ``padded``)
    padded: Tensor  # [r, c + 1] when the vocabulary is split into blocks (one spare column after the logits),
    #                 else ``logits`` itself

    @property
    def has_spare_column(self) -> bool:
        return self.padded.shape[1] > self.logits.shape[1]


def logits_tiles(
    hidden: Tensor, weight: Tensor, bias: Optional[Tensor], tile_rows: int, vocab_block: Optional[int] = None
) -> Iterator[LogitsTile]:
    """The tiles of ``hidden [N, H] @ weight [V, H]^T (+ bias [V])``: vocabulary blocks of ``vocab_block`` columns
    (default: all of V) outermost, row tiles of ``tile_rows`` inside. Every tile is computed into one buffer of
    ``[min(tile_rows, N), vocab_block (+ 1 when V is split)]`` that the next tile overwrites, so a consumer must be
    done with a tile (it may overwrite it, e.g. with its gradient) before it asks for the next."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if n == 0:
        return
    block = vocab if vocab_block is None else min(vocab_block, vocab)
    spare = 1 if block < vocab else 0
    rows = min(tile_rows, n)
    buf = hidden.new_empty(rows, block + spare)
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        w_block = weight[v0:v1]
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            padded = buf[: r1 - r0, : v1 - v0 + spare]
            logits = padded[:, : v1 - v0]
            h = hidden[r0:r1]
            torch.mm(h, w_block.t(), out=logits)
            if bias is not None:
                logits.add_(bias[v0:v1])
            yield LogitsTile(slice(r0, r1), slice(v0, v1), h, logits, padded if spare else logits)


def head_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    needs: tuple[bool, bool, bool],
    tile_rows: int,
    vocab_block: Optional[int],
    tile_grad: Callable[[LogitsTile], Tensor],
    weight_context: Callable[[], ContextManager] = contextlib.nullcontext,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_hidden, grad_weight, grad_bias)`` of the LM head (``None`` where ``needs`` says it is not needed).

    ``tile_grad(tile)`` returns ``d loss / d logits`` of one tile of :func:`logits_tiles` (it may overwrite the
    tile's buffer with it). ``weight_context`` is entered around every use of ``weight`` and ``bias``. The
    gradients are contiguous and in the inputs' dtypes; partial sums across tiles are accumulated in float32
    (float64 for float64 inputs): ``grad_weight`` when rows are split, ``grad_hidden`` when the vocabulary is.
    """
    need_hidden, need_weight, need_bias = needs
    need_bias = need_bias and bias is not None
    n, hidden_size = hidden.shape
    vocab = weight.shape[0]
    acc = accumulation_dtype(hidden.dtype)
    grad_hidden = torch.zeros(n, hidden_size, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(vocab, hidden_size, dtype=weight.dtype, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=hidden.device) if need_bias else None
    if n > 0 and (need_hidden or need_weight or need_bias):
        split_vocab = vocab_block is not None and vocab_block < vocab
        split_rows = tile_rows < n
        hidden_acc = (
            torch.zeros(n, hidden_size, dtype=acc, device=hidden.device) if need_hidden and split_vocab else None
        )
        weight_acc = None
        with weight_context():
            for tile in logits_tiles(hidden, weight, bias, tile_rows, vocab_block):
                if need_weight and split_rows and tile.rows.start == 0:  # a vocabulary block's first row tile
                    weight_acc = torch.zeros(tile.logits.shape[1], hidden_size, dtype=acc, device=hidden.device)
                g = tile_grad(tile)
                if need_hidden:
                    if hidden_acc is None:
                        torch.mm(g, weight[tile.cols], out=grad_hidden[tile.rows])
                    else:
                        hidden_acc[tile.rows] += torch.mm(g, weight[tile.cols])
                if need_weight:
                    if weight_acc is None:
                        torch.mm(g.t(), tile.hidden, out=grad_weight[tile.cols])
                    else:
                        weight_acc += torch.mm(g.t(), tile.hidden)
                if need_bias:
                    grad_bias[tile.cols] += g.sum(0, dtype=acc)
                if weight_acc is not None and tile.rows.stop == n:  # the block's last row tile
                    grad_weight[tile.cols] = weight_acc
                    weight_acc = None
        if hidden_acc is not None:
            grad_hidden.copy_(hidden_acc)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias

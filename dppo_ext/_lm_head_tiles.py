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
- ``logits_dtype=torch.float32`` with bfloat16/float16 operands (:func:`resolve_logits_dtype`): every tile's logits
  and logits gradient are float32, each product formed in float32 from operands widened a block at a time
  (:func:`head_logits_`, :func:`upcast_mm`, :func:`weight_grad_into`): at most ``UPCAST_BLOCK_BYTES`` (16 MiB) of
  widened weight exist at once, never a float32 copy of the whole weight. (This torch has no mixed-dtype ``torch.mm`` on
  the CPU: ``aten::mm.dtype``, ``out_dtype=``, is registered for CUDA only.)
"""

from __future__ import annotations

import contextlib
import dataclasses
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
    "check_logits_dtype",
    "head_backward",
    "head_logits_",
    "logits_tiles",
    "plan_chunks",
    "resolve_accum_dtype",
    "resolve_logits_dtype",
    "upcast_mm",
    "weight_grad_into",
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
# Bytes of one block of widened (float32) weight rows or gradient columns when the logits are wider than the
# operands (logits_dtype=torch.float32 with bfloat16/float16 hidden and weight): a small fraction of any real LM head,
# and large enough that each block's product runs near the BLAS's rate for one whole product. Measured for one
# 256-row chunk's logits at H=512, V=32768 (benchmarks/bench_upcast_blocks.py; AVX-512, 2 threads, a host under a
# load of 31): blocks of 1024 rows (2 MiB) took 6.3x one float32 product with a whole float32 weight, 4096 rows
# 2.6x, 8192 rows (16 MiB) 1.5x, 16384 rows 2.0x, widening the whole weight and one product 1.3x. Widening costs
# O(V * H) per chunk of rows, 1/rows of the chunk's multiply-adds.
UPCAST_BLOCK_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class FusedLinearPlan:
    """Chunking of one fused-linear call.

    chunk_rows: rows per forward chunk (forward buffer ``[chunk_rows, V]``).
    tile_rows, vocab_block: backward tile (buffer ``[tile_rows, vocab_block + 1]``).
    logits_dtype: the dtype of the logits tiles when it is wider than the inputs' (``torch.float32`` for
        bfloat16/float16 inputs), else None (the inputs' dtype).
    """

    chunk_rows: int
    tile_rows: int
    vocab_block: int
    logits_dtype: Optional[torch.dtype] = None

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


def check_logits_dtype(logits_dtype: Optional[torch.dtype]) -> None:
    """``logits_dtype`` is None or a floating-point ``torch.dtype`` (which ones a call accepts depends on hidden's
    dtype, see :func:`resolve_logits_dtype`)."""
    if logits_dtype is not None and not (isinstance(logits_dtype, torch.dtype) and logits_dtype.is_floating_point):
        raise TypeError(f"logits_dtype must be None or a floating-point torch.dtype, got {logits_dtype!r}")


def resolve_logits_dtype(logits_dtype: Optional[torch.dtype], dtype: torch.dtype) -> Optional[torch.dtype]:
    """The logits tiles' dtype for ``dtype`` hidden and weight when it differs from ``dtype``, else None.

    ``logits_dtype``: None or ``dtype`` (the tiles in the inputs' dtype), or the accumulation dtype (``torch.float32``
    for bfloat16/float16 inputs: the products accumulated and kept in float32). Anything else is a TypeError."""
    check_logits_dtype(logits_dtype)
    if logits_dtype is None or logits_dtype == dtype:
        return None
    wide = accumulation_dtype(dtype)
    if logits_dtype != wide:
        allowed = f"None or {dtype}" if wide == dtype else f"None, {dtype} (hidden's dtype) or {wide}"
        raise TypeError(f"logits_dtype must be {allowed} for {dtype} hidden, got {logits_dtype!r}")
    return logits_dtype


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
    logits_dtype: Optional[torch.dtype] = None,
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

    ``logits_dtype``: the tiles' dtype when wider than ``dtype`` (:func:`resolve_logits_dtype`); the budgets are then
    counted in its element size, the plan carries it.
    """
    check_chunk_settings(chunk_size, vocab_chunk_size, memory_budget_bytes)
    logits_dtype = resolve_logits_dtype(logits_dtype, dtype)
    if logits_dtype is not None:
        return dataclasses.replace(
            plan_chunks(
                num_rows,
                vocab,
                hidden_size,
                logits_dtype,
                chunk_size=chunk_size,
                vocab_chunk_size=vocab_chunk_size,
                memory_budget_bytes=memory_budget_bytes,
                grads_in_forward=grads_in_forward,
            ),
            logits_dtype=logits_dtype,
        )
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


def _blocks(count: int, row_bytes: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive blocks of ``count`` rows of ``row_bytes`` each, ``UPCAST_BLOCK_BYTES`` a
    block (at least one row)."""
    step = max(UPCAST_BLOCK_BYTES // max(row_bytes, 1), 1)
    for start in range(0, count, step):
        yield start, min(start + step, count)


def head_logits_(out: Tensor, h: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``out [r, c] = h [r, H] @ w [c, H]^T (+ bias [c])``, the products in ``out``'s dtype: one ``torch.mm`` when
    it is the operands' dtype, else (float32 out, 16-bit operands) ``h`` widened once and ``w`` a block of rows at a
    time."""
    if out.dtype == h.dtype:
        torch.mm(h, w.t(), out=out)
    else:
        wide = h.to(out.dtype)
        for c0, c1 in _blocks(w.shape[0], w.shape[1] * out.element_size()):
            torch.mm(wide, w[c0:c1].to(out.dtype).t(), out=out[:, c0:c1])
    if bias is not None:
        out.add_(bias)
    return out


def upcast_mm(g: Tensor, w: Tensor) -> Tensor:
    """``g [r, c] @ w [c, H]`` in ``g``'s dtype (float32 ``g``, 16-bit ``w``), ``w`` widened a block of rows at a
    time and the blocks' products summed in a ``[r, H]`` accumulator."""
    out = g.new_zeros(g.shape[0], w.shape[1])
    for c0, c1 in _blocks(w.shape[0], w.shape[1] * g.element_size()):
        out.addmm_(g[:, c0:c1], w[c0:c1].to(g.dtype))
    return out


def weight_grad_into(out: Tensor, g: Tensor, h: Tensor) -> None:
    """``out [c, H] = g [r, c]^T @ h [r, H]``, the product in ``g``'s dtype (``h`` widened to it), written in blocks
    of ``out``'s rows when ``out`` is narrower (no ``[c, H]`` temporary in ``g``'s dtype)."""
    if out.dtype == g.dtype == h.dtype:
        torch.mm(g.t(), h, out=out)
        return
    wide = h.to(g.dtype)
    for c0, c1 in _blocks(out.shape[0], out.shape[1] * g.element_size()):
        out[c0:c1] = torch.mm(g[:, c0:c1].t(), wide)


def logits_tiles(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    tile_rows: int,
    vocab_block: Optional[int] = None,
    logits_dtype: Optional[torch.dtype] = None,
) -> Iterator[LogitsTile]:
    """The tiles of ``hidden [N, H] @ weight [V, H]^T (+ bias [V])``: vocabulary blocks of ``vocab_block`` columns
    (default: all of V) outermost, row tiles of ``tile_rows`` inside. Every tile is computed into one buffer of
    ``[min(tile_rows, N), vocab_block (+ 1 when V is split)]`` that the next tile overwrites, so a consumer must be
    done with a tile (it may overwrite it, e.g. with its gradient) before it asks for the next. The buffer is in
    ``logits_dtype`` (default: hidden's dtype; see :func:`head_logits_`)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    if n == 0:
        return
    block = vocab if vocab_block is None else min(vocab_block, vocab)
    spare = 1 if block < vocab else 0
    rows = min(tile_rows, n)
    buf = hidden.new_empty(rows, block + spare, dtype=logits_dtype or hidden.dtype)
    for v0 in range(0, vocab, block):
        v1 = min(v0 + block, vocab)
        w_block = weight[v0:v1]
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            padded = buf[: r1 - r0, : v1 - v0 + spare]
            logits = padded[:, : v1 - v0]
            h = hidden[r0:r1]
            head_logits_(logits, h, w_block, None if bias is None else bias[v0:v1])
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
    logits_dtype: Optional[torch.dtype] = None,
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """``(grad_hidden, grad_weight, grad_bias)`` of the LM head (``None`` where ``needs`` says it is not needed).

    ``tile_grad(tile)`` returns ``d loss / d logits`` of one tile of :func:`logits_tiles` (it may overwrite the
    tile's buffer with it). ``weight_context`` is entered around every use of ``weight`` and ``bias``. The
    gradients are contiguous and in the inputs' dtypes; partial sums across tiles are accumulated in float32
    (float64 for float64 inputs): ``grad_weight`` when rows are split, ``grad_hidden`` when the vocabulary is.
    ``logits_dtype``: the tiles' dtype (:func:`logits_tiles`); with float32 tiles of 16-bit inputs every product is
    formed in float32 (:func:`upcast_mm`, :func:`weight_grad_into`) and rounded once into the gradient.
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
            for tile in logits_tiles(hidden, weight, bias, tile_rows, vocab_block, logits_dtype):
                if need_weight and split_rows and tile.rows.start == 0:  # a vocabulary block's first row tile
                    weight_acc = torch.zeros(tile.logits.shape[1], hidden_size, dtype=acc, device=hidden.device)
                g = tile_grad(tile)
                wide = g.dtype != hidden.dtype  # float32 tiles of 16-bit inputs
                if need_hidden:
                    if wide:
                        product = upcast_mm(g, weight[tile.cols])
                        if hidden_acc is None:
                            grad_hidden[tile.rows] = product
                        else:
                            hidden_acc[tile.rows] += product
                    elif hidden_acc is None:
                        torch.mm(g, weight[tile.cols], out=grad_hidden[tile.rows])
                    else:
                        hidden_acc[tile.rows] += torch.mm(g, weight[tile.cols])
                if need_weight:
                    if weight_acc is None:
                        weight_grad_into(grad_weight[tile.cols], g, tile.hidden)
                    elif wide:
                        weight_acc.addmm_(g.t(), tile.hidden.to(g.dtype))
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

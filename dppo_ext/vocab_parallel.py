"""The DPPO loss over a vocabulary sharded across a tensor-parallel group (Megatron-style or DTensor TP).

Each rank of ``group`` holds the logits (or the LM-head rows) of one contiguous slice of the vocabulary,
``[vocab_offsets[r], vocab_offsets[r + 1])`` on rank ``r``; tokens, rollout log-probs, advantages and the
rollout's top-K are global ids/values, identical on every rank. The result on every rank is bit-for-bit the
same and equals the single-device op on the gathered logits (to rounding: sums are merged in another order).

Forward, per call (``docs/distributed.md``):
  1. ``torch.ops.dppo.dppo_vocab_parallel_stats`` reads the local slice once and keeps, per row, the
     single-device kernel's state: max, non-target exp-sum, entropy moment, and the sampled token's and the
     top-K ids' logits where this rank owns them -- ``4 + K`` numbers.
  2. ONE collective: an all-gather of those ``[N, 4 + K]`` statistics (plus one header row holding each
     rank's slice, checked against ``vocab_offsets``) over ``group``.
  3. ``torch.ops.dppo.dppo_vocab_parallel_epilogue`` merges the ranks' states and runs the per-row epilogue
     (divergence, mask, weight, loss, entropy, lse) -- the same code on every rank, on the same bytes.
Backward: no communication. Each rank writes only its slice's gradient with the single-device backward op
(``dppo_loss_backward``), fed the merged ``lse``/entropy. A row whose sampled token lives on another rank has
no ``1[j = a]`` term here: the op is pointed at column 0 and that column is then recomputed as an ordinary
column by the same op on a two-column copy (``_slice_backward``).

Bytes per row gathered by each rank: ``W * (4 + K) * 4`` (float32 statistics; 8 for float64 logits), e.g.
96 B for W = 4 binary modes, 384 B for W = 4, K = 20 -- against ``V * 2`` bytes to all-gather bf16 logits.
The fused-linear form (``fused_linear_dppo_loss(..., vocab_parallel_group=)``) additionally all-reduces the ``[N, H]`` hidden-state gradient in backward, as
Megatron's column-parallel LM head does.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .contract import resolve_op_settings
from .ops import (_BACKWARD_CONSUMED, _NO_DOUBLE_BACKWARD, DPPOOutputs, _acc_dtype, _grad_args, _inplace_applies,
                  check_no_functorch)

__all__ = [
    "dppo_loss_forward_vocab_parallel",
    "even_vocab_offsets",
    "fused_linear_dppo_loss_vocab_parallel",
    "gathered_bytes_per_row",
    "vocab_parallel_offsets",
]

_HEADER_ROWS = 1  # the all-gathered payload's extra row: (V_local, vocab_start) of the sending rank


@torch.library.register_fake("dppo::dppo_vocab_parallel_stats")
def _stats_fake(logits, tokens, topk_ids, vocab_start, temperature, compute_entropy):
    torch._check(logits.dim() == 2, lambda: f"logits must be 2-D [N, V_local], got shape {tuple(logits.shape)}")
    k = 0 if topk_ids is None else topk_ids.shape[1]
    return logits.new_empty((logits.shape[0], 4 + k), dtype=_acc_dtype(logits.dtype))


@torch.library.register_fake("dppo::dppo_vocab_parallel_epilogue")
def _epilogue_fake(stats, vocab_offsets, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs,
                   anchor_logprobs, mode, delta_low, delta_high, ratio_cap, compute_entropy):
    torch._check(stats.dim() == 3, lambda: f"stats must be 3-D [W, N, 4 + K], got shape {tuple(stats.shape)}")
    return tuple(stats.new_empty((stats.shape[1],)) for _ in range(7))


# ---- the vocabulary split ------------------------------------------------------------------------


def even_vocab_offsets(vocab_size: int, world_size: int) -> list[int]:
    """Offsets ``[W + 1]`` of ``torch.chunk`` / DTensor ``Shard`` semantics: ``ceil(V / W)`` columns per rank,
    the remainder on the last non-empty rank (Megatron's even split when ``W`` divides ``V``)."""
    per = -(-vocab_size // world_size)
    return [min(r * per, vocab_size) for r in range(world_size + 1)]


def vocab_parallel_offsets(local_vocab: int, group: Optional[dist.ProcessGroup] = None) -> list[int]:
    """Every rank's slice from each rank's local vocabulary size, in rank order: one small all-gather.

    Call it once and pass the result as ``vocab_offsets`` so a training step has a single collective.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([local_vocab], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        mine = mine.cuda()
    sizes = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sizes, mine, group=group)
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + int(s.item()))
    return offsets


def gathered_bytes_per_row(world_size: int, k: int = 0, logits_dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes each rank receives per row in the forward's one all-gather: ``W * (4 + K) * sizeof(acc)``."""
    return world_size * (4 + k) * torch.empty((), dtype=_acc_dtype(logits_dtype)).element_size()


def _check_offsets(offsets: Sequence[int], world: int) -> list[int]:
    """Structure only: whether each rank's slice matches its logits is checked on the all-gathered header, so
    that a wrong split raises on every rank at once instead of leaving the others waiting in the collective."""
    offsets = [int(o) for o in offsets]
    if len(offsets) != world + 1 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"vocab_offsets must be W + 1 = {world + 1} strictly increasing ints starting at 0 (every rank holds at "
            f"least one column), got {offsets}")
    return offsets


def _gather_stats(stats: Tensor, local_vocab: int, start: int, offsets: list[int],
                  group: Optional[dist.ProcessGroup]) -> Tensor:
    """All-gather ``[N, C]`` statistics as ``[W, N, C]`` (one collective); the header row lets every rank
    check every other rank's slice, so a wrong split raises the same error on all ranks instead of hanging."""
    world = len(offsets) - 1
    header = stats.new_zeros((_HEADER_ROWS, stats.shape[1]))
    header[0, 0], header[0, 1] = float(local_vocab), float(start)
    payload = torch.cat([header, stats]).contiguous()
    out = payload.new_empty((world * payload.shape[0], payload.shape[1]))
    dist.all_gather_into_tensor(out, payload, group=group)
    out = out.view(world, payload.shape[0], payload.shape[1])
    got = out[:, 0, :2].tolist()
    for r in range(world):
        want = [float(offsets[r + 1] - offsets[r]), float(offsets[r])]
        if got[r] != want:
            raise ValueError(
                f"vocab-parallel split mismatch: rank {r} of the group holds {int(got[r][0])} columns starting at "
                f"{int(got[r][1])}, but vocab_offsets {offsets} gives it {int(want[0])} starting at {int(want[1])}")
    return out[:, _HEADER_ROWS:]


# ---- per-row op ------------------------------------------------------------------------------------


def _local_tokens(tokens: Tensor, start: int, local_vocab: int) -> tuple[Tensor, Tensor]:
    """(ids for the backward op on this slice, rows whose column 0 must be recomputed as a non-target column).

    Owned rows: the local id. Rows owned elsewhere: column 0 (fixed afterwards). Padding (-100) stays -100."""
    owned = (tokens >= start) & (tokens < start + local_vocab)
    pad = tokens == -100
    local = torch.where(owned, tokens - start, torch.zeros_like(tokens))
    local = torch.where(pad, tokens, local)
    return local, ~owned & ~pad


def _slice_backward(grad_target: Tensor, grad_entropy: Optional[Tensor], entropy: Optional[Tensor], logits: Tensor,
                    local_tokens: Tensor, foreign: Tensor, lse: Tensor, temperature: float, inplace: bool) -> Tensor:
    """d loss / d logits for this rank's slice, written by ``dppo_loss_backward`` (in place into ``logits`` when
    ``inplace``). ``foreign`` rows (token on another rank) had the op's target column at 0; that column is then
    recomputed by the same op as a non-target column of a two-column copy whose column 1 plays the target."""
    col0 = logits[:, 0].clone()
    if inplace:
        torch.ops.dppo.dppo_loss_backward_(grad_target, grad_entropy, logits, local_tokens, lse, entropy, temperature)
        grad = logits
    else:
        grad = torch.ops.dppo.dppo_loss_backward(grad_target, grad_entropy, logits, local_tokens, lse, entropy,
                                                 temperature)
    pair = torch.stack([col0, col0], dim=1)
    pair_tokens = torch.where(foreign, torch.ones_like(local_tokens), torch.full_like(local_tokens, -100))
    fixed = torch.ops.dppo.dppo_loss_backward(grad_target, grad_entropy, pair, pair_tokens, lse, entropy, temperature)
    grad[:, 0] = torch.where(foreign, fixed[:, 0], grad[:, 0])
    return grad


def _forward_outputs(stats: Tensor, local_vocab: int, start: int, offsets: list[int], group, tokens, rollout, adv,
                     topk_ids, topk_lp, anchor, mode, delta_low, delta_high, ratio_cap, compute_entropy):
    gathered = _gather_stats(stats, local_vocab, start, offsets, group)
    return torch.ops.dppo.dppo_vocab_parallel_epilogue(
        gathered, offsets, tokens, rollout, adv, topk_ids, topk_lp, anchor, mode, delta_low, delta_high, ratio_cap,
        compute_entropy)


class _VocabParallelDPPO(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, rollout, adv, topk_ids, topk_lp, anchor, mode, temperature, delta_low,
                delta_high, ratio_cap, compute_entropy, group, offsets, inplace):  # type: ignore[override]
        rank = dist.get_rank(group)
        local_vocab, start = logits.shape[1], offsets[rank]
        ids = topk_ids if mode in ("topk_tv", "topk_kl") else None
        stats = torch.ops.dppo.dppo_vocab_parallel_stats(logits, tokens, ids, start, temperature, compute_entropy)
        outs = _forward_outputs(stats, local_vocab, start, offsets, group, tokens, rollout, adv, ids,
                                topk_lp if ids is not None else None, anchor, mode, delta_low, delta_high, ratio_cap,
                                compute_entropy)
        _loss, _logp, divergence, mask, weight, entropy, lse = outs
        local_tokens, foreign = _local_tokens(tokens, start, local_vocab)
        ctx.save_for_backward(logits, local_tokens, foreign, adv, mask, weight, entropy, lse)
        ctx.temperature = temperature
        ctx.compute_entropy = compute_entropy
        ctx.inplace = inplace
        ctx.consumed = False
        ctx.mark_non_differentiable(divergence, mask, weight, lse)
        return outs

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD.format(what="the vocab-parallel DPPO loss"))
        if ctx.consumed:  # the same rule as ops._DPPOInplace
            raise RuntimeError(_BACKWARD_CONSUMED)
        logits, local_tokens, foreign, adv, mask, weight, entropy, lse = ctx.saved_tensors
        gt, ge, ent = _grad_args(ctx, adv, mask, weight, g_loss, g_logp, g_entropy, entropy)
        grad = _slice_backward(gt, ge, ent, logits, local_tokens, foreign, lse, ctx.temperature, ctx.inplace)
        if ctx.inplace:  # autograd must know the logits were overwritten (ops._DPPOInplace)
            torch.autograd.graph.increment_version(logits)
            ctx.consumed = True
        return (grad,) + (None,) * 15


def _resolve_offsets(local_vocab: int, group, vocab_offsets: Optional[Sequence[int]]) -> list[int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab_parallel_group needs an initialised torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of vocab_parallel_group")
    if vocab_offsets is None:
        vocab_offsets = vocab_parallel_offsets(local_vocab, group)
    return _check_offsets(vocab_offsets, world)


def dppo_loss_forward_vocab_parallel(
    logits: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    mode: str = "binary_tv",
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
    compute_entropy: bool = True,
    inplace_backward: bool = False,
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
) -> DPPOOutputs:
    """``dppo_loss_forward`` (per-row outputs) with the vocabulary sharded over ``group``.

    Args:
        logits: ``[N, V_local]`` this rank's contiguous vocabulary slice (stride(1) == 1).
        tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs: as
            ``dppo_loss_forward``, with GLOBAL vocabulary ids, identical on every rank.
        group: the tensor-parallel process group (None: the default group).
        vocab_offsets: ``[W + 1]`` global column offsets of the ranks' slices, in group-rank order. None
            derives them with one extra all-gather of the slice sizes (pass them to save it; see
            :func:`even_vocab_offsets`, :func:`vocab_parallel_offsets`).
        Everything else: as ``dppo_loss_forward``.

    Returns:
        ``DPPOOutputs``, each ``[N]``, identical on every rank; ``loss``, ``logp`` and ``entropy`` are
        differentiable w.r.t. the local logits (the backward writes only this slice, no communication).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V_local], got shape {tuple(logits.shape)}")
    if logits.shape[1] == 0:
        raise ValueError("every rank of vocab_parallel_group must hold at least one vocabulary column, this rank "
                         f"got logits of shape {tuple(logits.shape)}")
    settings = resolve_op_settings(mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy)
    check_no_functorch("dppo_loss_forward_vocab_parallel", logits)
    _inplace_applies(inplace_backward, logits)
    offsets = _resolve_offsets(logits.shape[1], group, vocab_offsets)
    args = (tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs, *settings.op_args(),
            group, offsets, bool(inplace_backward))
    return DPPOOutputs(*_VocabParallelDPPO.apply(logits, *args))


# ---- DTensor ---------------------------------------------------------------------------------------


def dtensor_vocab_shard(logits) -> tuple[Tensor, dist.ProcessGroup, list[int]]:
    """``(local logits, group, vocab_offsets)`` of a DTensor sharded on its last (vocabulary) dim.

    The placement must be ``Shard(-1)`` on exactly one mesh dimension (any other mesh dimension Replicate);
    the local tensor is returned through the differentiable ``to_local()``.
    """
    from torch.distributed.tensor import Replicate, Shard

    vocab_dim = logits.dim() - 1
    shard_dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard)]
    bad = [p for p in logits.placements if not isinstance(p, (Shard, Replicate))]
    if bad or len(shard_dims) != 1 or logits.placements[shard_dims[0]].dim not in (vocab_dim, -1):
        raise ValueError(
            "a DTensor logits must be sharded on its last (vocabulary) dim over one mesh dimension and replicated "
            f"over the others, got placements {logits.placements} for shape {tuple(logits.shape)}")
    mesh_dim = shard_dims[0]
    group = logits.device_mesh.get_group(mesh_dim)
    offsets = even_vocab_offsets(logits.shape[-1], logits.device_mesh.size(mesh_dim))
    return logits.to_local(), group, offsets


def replicated_local(t, name: str):
    """A replicated DTensor's local tensor (plain tensors and None pass through)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name} must be replicated over the tensor-parallel mesh (global ids and values on every "
                         f"rank), got a DTensor with placements {t.placements}")
    return t.to_local()


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


# ---- fused linear: LM-head rows sharded over the group -----------------------------------------------


class _FusedLinearVocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, rollout, adv, topk_ids, topk_lp, anchor, mode, temperature,
                delta_low, delta_high, ratio_cap, compute_entropy, chunk_rows, group, offsets,
                reduce_hidden_grad):  # type: ignore[override]
        n, local_vocab = hidden.shape[0], weight.shape[0]
        start = offsets[dist.get_rank(group)]
        ids = topk_ids if mode in ("topk_tv", "topk_kl") else None
        k = 0 if ids is None else ids.shape[1]
        stats = torch.empty((n, 4 + k), dtype=_acc_dtype(hidden.dtype), device=hidden.device)
        if n > 0:
            buf = hidden.new_empty((min(chunk_rows, n), local_vocab))
            for r0 in range(0, n, chunk_rows):
                r1 = min(r0 + chunk_rows, n)
                logits = buf[: r1 - r0]
                torch.mm(hidden[r0:r1], weight.t(), out=logits)
                if bias is not None:
                    logits.add_(bias)
                stats[r0:r1] = torch.ops.dppo.dppo_vocab_parallel_stats(
                    logits, tokens[r0:r1], None if ids is None else ids[r0:r1], start, temperature, compute_entropy)
            del buf
        outs = _forward_outputs(stats, local_vocab, start, offsets, group, tokens, rollout, adv, ids,
                                topk_lp if ids is not None else None, anchor, mode, delta_low, delta_high, ratio_cap,
                                compute_entropy)
        _loss, _logp, divergence, mask, row_weight, entropy, lse = outs
        local_tokens, foreign = _local_tokens(tokens, start, local_vocab)
        ctx.save_for_backward(hidden, weight, bias, local_tokens, foreign, adv, mask, row_weight, entropy, lse)
        ctx.temperature, ctx.compute_entropy, ctx.chunk_rows = temperature, compute_entropy, chunk_rows
        ctx.group, ctx.reduce_hidden_grad = group, reduce_hidden_grad
        ctx.mark_non_differentiable(divergence, mask, row_weight, lse)
        return outs

    @staticmethod
    def backward(ctx, g_loss, g_logp, _g_div, _g_mask, _g_weight, g_entropy, _g_lse):  # type: ignore[override]
        if torch.is_grad_enabled():
            raise RuntimeError(_NO_DOUBLE_BACKWARD.format(what="fused_linear_dppo_loss (vocab-parallel)"))
        hidden, weight, bias, local_tokens, foreign, adv, mask, row_weight, entropy, lse = ctx.saved_tensors
        gt, ge, ent = _grad_args(ctx, adv, mask, row_weight, g_loss, g_logp, g_entropy, entropy)
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        chunks = max(1, math.ceil(n / ctx.chunk_rows))
        weight_acc = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight and chunks > 1 else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_bias and bias is not None \
            else None
        if n > 0:
            buf = hidden.new_empty((min(ctx.chunk_rows, n), weight.shape[0]))
            for r0 in range(0, n, ctx.chunk_rows):
                r1 = min(r0 + ctx.chunk_rows, n)
                h, logits = hidden[r0:r1], buf[: r1 - r0]
                torch.mm(h, weight.t(), out=logits)
                if bias is not None:
                    logits.add_(bias)
                g = _slice_backward(gt[r0:r1], None if ge is None else ge[r0:r1], None if ent is None else ent[r0:r1],
                                    logits, local_tokens[r0:r1], foreign[r0:r1], lse[r0:r1], ctx.temperature, True)
                if need_hidden:
                    torch.mm(g, weight, out=grad_hidden[r0:r1])
                if need_weight:
                    if weight_acc is None:
                        torch.mm(g.t(), h, out=grad_weight)
                    else:
                        weight_acc += torch.mm(g.t(), h)
                if grad_bias is not None:
                    grad_bias += g.sum(0, dtype=acc)
            if weight_acc is not None:
                grad_weight.copy_(weight_acc)
        if need_hidden and ctx.reduce_hidden_grad:
            # hidden feeds every rank's slice of the head: its gradient is the sum over the group.
            dist.all_reduce(grad_hidden, group=ctx.group)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return (grad_hidden, grad_weight, grad_bias) + (None,) * 16


def fused_linear_dppo_loss_vocab_parallel(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    rollout_logprobs: Tensor,
    advantages: Tensor,
    *,
    bias: Optional[Tensor] = None,
    topk_ids: Optional[Tensor] = None,
    topk_logprobs: Optional[Tensor] = None,
    anchor_logprobs: Optional[Tensor] = None,
    mode: str = "binary_tv",
    temperature: float = 1.0,
    delta_low: Optional[float] = None,
    delta_high: Optional[float] = None,
    ratio_cap: float = 10.0,
    compute_entropy: bool = True,
    chunk_size: Optional[int] = None,
    memory_budget_bytes: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    vocab_offsets: Optional[Sequence[int]] = None,
    reduce_hidden_grad: bool = True,
) -> DPPOOutputs:
    """``fused_linear_dppo_loss_per_row`` with the LM head's rows sharded over ``group``: ``weight`` is this rank's
    ``[V_local, H]`` slice (``bias`` its ``[V_local]``), ``hidden`` ``[N, H]`` is replicated. Neither the logits
    nor the whole head exist on any rank: row chunks of ``hidden @ weight.T`` go through the stats op, one
    all-gather merges them, the backward recomputes each chunk and writes its gradient in place.

    ``reduce_hidden_grad``: all-reduce the hidden-state gradient over ``group`` (the sum of every slice's
    contribution), as Megatron's column-parallel linear does; pass False when the framework reduces it itself
    (e.g. a reduce-scatter under sequence parallelism).
    """
    from .fused_linear import _check_inputs, plan_chunks

    settings = resolve_op_settings(mode, temperature, delta_low, delta_high, ratio_cap, compute_entropy)
    _check_inputs(hidden, weight, bias, tokens, {"rollout_logprobs": rollout_logprobs, "advantages": advantages,
                                                 "anchor_logprobs": anchor_logprobs}, topk_ids, topk_logprobs)
    if weight.shape[0] == 0:
        raise ValueError("every rank of vocab_parallel_group must hold at least one LM-head row, this rank got "
                         f"weight of shape {tuple(weight.shape)}")
    offsets = _resolve_offsets(weight.shape[0], group, vocab_offsets)
    plan = plan_chunks(hidden.shape[0], weight.shape[0], hidden.shape[1], hidden.dtype, chunk_size=chunk_size,
                       memory_budget_bytes=memory_budget_bytes)
    outs = _FusedLinearVocabParallel.apply(
        hidden, weight, bias, tokens, rollout_logprobs, advantages, topk_ids, topk_logprobs, anchor_logprobs,
        *settings.op_args(), plan.chunk_rows, group, offsets, bool(reduce_hidden_grad))
    return DPPOOutputs(*outs)

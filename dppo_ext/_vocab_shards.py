"""Which rank of a tensor-parallel group holds which vocabulary columns, and the one collective that joins them.

- The split: ``even_vocab_offsets`` (torch.chunk / DTensor ``Shard`` semantics), ``vocab_parallel_offsets``
  (from each rank's local size, one small all-gather), ``resolve_offsets`` / ``check_offsets`` (a call's offsets).
- ``gather_stats``: the forward's one all-gather of every rank's ``[N, 4 + K]`` statistics, with a header row
  that lets every rank check every other rank's slice (``gathered_bytes_per_row``: its size).
- DTensor: ``vocab_shard`` (the local logits and split of vocabulary-parallel logits), ``dtensor_vocab_shard``,
  ``replicated_local``, ``is_dtensor``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .contract import accumulation_dtype

__all__ = [
    "VocabShard",
    "check_offsets",
    "dtensor_vocab_shard",
    "even_vocab_offsets",
    "gather_stats",
    "gathered_bytes_per_row",
    "is_dtensor",
    "replicated_local",
    "resolve_offsets",
    "vocab_parallel_offsets",
    "vocab_shard",
]

_HEADER_ROWS = 1  # the all-gathered payload's extra row: (V_local, vocab_start) of the sending rank


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
    return world_size * (4 + k) * torch.empty((), dtype=accumulation_dtype(logits_dtype)).element_size()


def check_offsets(offsets: Sequence[int], world: int) -> list[int]:
    """Structure only: whether each rank's slice matches its logits is checked on the all-gathered header, so
    that a wrong split raises on every rank at once instead of leaving the others waiting in the collective."""
    offsets = [int(o) for o in offsets]
    if len(offsets) != world + 1 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"vocab_offsets must be W + 1 = {world + 1} strictly increasing ints starting at 0 (every rank holds at "
            f"least one column), got {offsets}"
        )
    return offsets


def resolve_offsets(local_vocab: int, group, vocab_offsets: Optional[Sequence[int]]) -> list[int]:
    """The checked offsets of this call (derived with one all-gather when not given)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "vocab_parallel_group needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of vocab_parallel_group")
    if vocab_offsets is None:
        vocab_offsets = vocab_parallel_offsets(local_vocab, group)
    return check_offsets(vocab_offsets, world)


def _all_gather_single(out: Tensor, payload: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """All-gather ``payload`` into ``out`` (ranks stacked along dim 0): ``all_gather_single`` since torch 2.13,
    where its older name ``all_gather_into_tensor`` warns that it is deprecated."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, payload, group=group)


def gather_stats(
    stats: Tensor, local_vocab: int, start: int, offsets: list[int], group: Optional[dist.ProcessGroup]
) -> Tensor:
    """All-gather ``[N, C]`` statistics as ``[W, N, C]`` (one collective); the header row lets every rank
    check every other rank's slice, so a wrong split raises the same error on all ranks instead of hanging."""
    world = len(offsets) - 1
    header = stats.new_zeros((_HEADER_ROWS, stats.shape[1]))
    header[0, 0], header[0, 1] = float(local_vocab), float(start)
    payload = torch.cat([header, stats]).contiguous()
    out = payload.new_empty((world * payload.shape[0], payload.shape[1]))
    _all_gather_single(out, payload, group)
    out = out.view(world, payload.shape[0], payload.shape[1])
    got = out[:, 0, :2].tolist()
    for r in range(world):
        want = [float(offsets[r + 1] - offsets[r]), float(offsets[r])]
        if got[r] != want:
            raise ValueError(
                f"vocab-parallel split mismatch: rank {r} of the group holds {int(got[r][0])} columns starting at "
                f"{int(got[r][1])}, but vocab_offsets {offsets} gives it {int(want[0])} starting at {int(want[1])}"
            )
    return out[:, _HEADER_ROWS:]


# ---- DTensor ---------------------------------------------------------------------------------------


class VocabShard(NamedTuple):
    """This rank's part of vocabulary-parallel logits: the local ``[..., V_local]`` tensor and the split."""

    logits: Tensor
    group: Optional[dist.ProcessGroup]
    vocab_offsets: Optional[Sequence[int]]


def vocab_shard(
    logits: Tensor, group: Optional[dist.ProcessGroup], vocab_offsets: Optional[Sequence[int]]
) -> VocabShard:
    """The local logits and the split of vocabulary-parallel ``logits``: a DTensor sharded on its vocabulary dim
    (its device mesh and placements define the split, see :func:`dtensor_vocab_shard`), or this rank's slice with
    ``group`` and ``vocab_offsets`` as given."""
    if not is_dtensor(logits):
        return VocabShard(logits, group, vocab_offsets)
    if group is not None or vocab_offsets is not None:
        raise ValueError(
            "logits is a DTensor: its device mesh and placements define the vocabulary split, do "
            "not also pass vocab_parallel_group / vocab_offsets"
        )
    return VocabShard(*dtensor_vocab_shard(logits))


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
            f"over the others, got placements {logits.placements} for shape {tuple(logits.shape)}"
        )
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
        raise ValueError(
            f"{name} must be replicated over the tensor-parallel mesh (global ids and values on every "
            f"rank), got a DTensor with placements {t.placements}"
        )
    return t.to_local()


def is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)

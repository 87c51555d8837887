"""Which rank of a tensor-parallel group holds which vocabulary columns, and the collectives that join the ranks.

- The split: ``even_vocab_offsets`` (torch.chunk / DTensor ``Shard`` semantics), ``vocab_parallel_offsets``
  (from each rank's local size, one small all-gather), ``check_offsets`` (a call's offsets), ``check_split_args``,
  ``group_rank``.
- The collectives' plumbing: ``comm_device`` (where a group's collectives take their tensors),
  ``all_gather_single``, and ``gather_stats``, every rank's ``[N, 4 + K]`` statistics (``gathered_bytes_per_row``:
  its size). The call header exchanged before them is ``dppo_ext._agreement``'s.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .contract import accumulation_dtype

__all__ = [
    "all_gather_single",
    "check_offsets",
    "check_split_args",
    "comm_device",
    "even_vocab_offsets",
    "gather_stats",
    "gathered_bytes_per_row",
    "group_rank",
    "vocab_parallel_offsets",
]


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


def gathered_bytes_per_row(
    world_size: int, k: int = 0, logits_dtype: torch.dtype = torch.bfloat16, kept_width: int = 0
) -> int:
    """Bytes each rank receives per row in the forward's statistics all-gather: ``W * (4 + K + S) * sizeof(acc)``
    (``S = kept_width``, the kept-set width of sampling replay; plus, once per call, the ``W * 144`` bytes of the
    call headers, see ``dppo_ext._agreement.Rendezvous``)."""
    width = 4 + k + kept_width
    return world_size * width * torch.empty((), dtype=accumulation_dtype(logits_dtype)).element_size()


def check_offsets(offsets: Sequence[int], world: int) -> list[int]:
    """Structure only: whether each rank's slice matches its logits is checked on the exchanged call headers, so
    that a wrong split raises on every rank at once instead of leaving the others waiting in the collective."""
    offsets = [int(o) for o in offsets]
    if len(offsets) != world + 1 or offsets[0] != 0 or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(
            f"vocab_offsets must be W + 1 = {world + 1} strictly increasing ints starting at 0 (every rank holds at "
            f"least one column), got {offsets}"
        )
    return offsets


def group_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """``(world size, this rank)`` of ``group``; a clear error without a process group or outside the group."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "vocab_parallel_group needs an initialised torch.distributed process group "
            "(torch.distributed.init_process_group)"
        )
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of vocab_parallel_group")
    return world, rank


def check_split_args(group: Optional[dist.ProcessGroup], vocab_offsets: Optional[Sequence[int]]) -> None:
    """``vocab_offsets`` without ``vocab_parallel_group``: the loss would silently run over this rank's columns
    only, as if they were the whole vocabulary."""
    if vocab_offsets is not None and group is None:
        raise ValueError(
            f"vocab_offsets={list(vocab_offsets)} was given but vocab_parallel_group is None: without a group the "
            "loss would be computed over this rank's vocabulary columns only, as if they were the whole vocabulary. "
            "Pass vocab_parallel_group=<the tensor-parallel group> (after torch.distributed.init_process_group; "
            "torch.distributed.group.WORLD is None before it), or drop vocab_offsets for unsharded logits."
        )


def all_gather_single(out: Tensor, payload: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """All-gather ``payload`` into ``out`` (ranks stacked along dim 0): ``all_gather_single`` since torch 2.13,
    where its older name ``all_gather_into_tensor`` warns that it is deprecated."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, payload, group=group)


def gather_stats(stats: Tensor, world: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """All-gather ``[N, C]`` statistics as ``[W, N, C]``; the call headers exchanged first
    (``dppo_ext._agreement.Rendezvous``) guarantee that every rank sends the same ``N``, ``C`` and dtype, so the
    collective's sizes agree."""
    payload = stats.contiguous()
    out = payload.new_empty((world * payload.shape[0], payload.shape[1]))
    all_gather_single(out, payload, group)
    return out.view(world, payload.shape[0], payload.shape[1])


def comm_device(group: Optional[dist.ProcessGroup], device: Optional[torch.device]) -> torch.device:
    """Where ``group``'s collectives take their tensors: the GPU for an NCCL group, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return (
            device
            if device is not None and device.type == "cuda"
            else torch.device("cuda", torch.cuda.current_device())
        )
    return torch.device("cpu")

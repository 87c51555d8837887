"""Vocabulary-parallel logits as a DTensor: the local logits and the split they define, and replicated inputs.

- ``vocab_shard``: this rank's logits, group and offsets, from a DTensor sharded on its vocabulary dim
  (``dtensor_vocab_shard``) or from a plain tensor and the caller's group and offsets.
- ``replicated_local``: a replicated DTensor input's local tensor; ``is_dtensor``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch.distributed as dist
from torch import Tensor

from ._vocab_split import even_vocab_offsets

__all__ = [
    "VocabShard",
    "dtensor_vocab_shard",
    "is_dtensor",
    "replicated_local",
    "vocab_shard",
]


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

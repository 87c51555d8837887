"""Which rank of a tensor-parallel group holds which vocabulary columns, and the collectives that join them.

- The split: ``even_vocab_offsets`` (torch.chunk / DTensor ``Shard`` semantics), ``vocab_parallel_offsets``
  (from each rank's local size, one small all-gather), ``check_offsets`` (a call's offsets), ``check_split_args``.
- The forward's two collectives: ``Rendezvous`` (a fixed-size call header per rank: row count, split, settings,
  a ``fingerprint`` of each per-row input, a failure flag; ``check_agreement`` makes every rank raise the same
  error when the ranks' calls differ, ``agreed_failures`` makes a rank whose own checks failed still join it),
  then ``gather_stats``, every rank's ``[N, 4 + K]`` statistics (``gathered_bytes_per_row``: its size).
- DTensor: ``vocab_shard`` (the local logits and split of vocabulary-parallel logits), ``dtensor_vocab_shard``,
  ``replicated_local``, ``is_dtensor``.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .contract import accumulation_dtype

__all__ = [
    "ROW_INPUT_NAMES",
    "CallHeader",
    "Rendezvous",
    "VocabShard",
    "agreed_failures",
    "call_header",
    "check_agreement",
    "check_offsets",
    "check_split_args",
    "comm_device",
    "dtensor_vocab_shard",
    "even_vocab_offsets",
    "fingerprint",
    "gather_stats",
    "group_rank",
    "gathered_bytes_per_row",
    "is_dtensor",
    "replicated_local",
    "vocab_parallel_offsets",
    "vocab_shard",
]

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
    """Bytes each rank receives per row in the forward's statistics all-gather: ``W * (4 + K) * sizeof(acc)`` (plus,
    once per call, the ``W * 128`` bytes of the call headers, see :class:`Rendezvous`)."""
    return world_size * (4 + k) * torch.empty((), dtype=accumulation_dtype(logits_dtype)).element_size()


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


def _all_gather_single(out: Tensor, payload: Tensor, group: Optional[dist.ProcessGroup]) -> None:
    """All-gather ``payload`` into ``out`` (ranks stacked along dim 0): ``all_gather_single`` since torch 2.13,
    where its older name ``all_gather_into_tensor`` warns that it is deprecated."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, payload, group=group)


def gather_stats(stats: Tensor, world: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """All-gather ``[N, C]`` statistics as ``[W, N, C]``; the call headers exchanged first (:class:`Rendezvous`)
    guarantee that every rank sends the same ``N``, ``C`` and dtype, so the collective's sizes agree."""
    payload = stats.contiguous()
    out = payload.new_empty((world * payload.shape[0], payload.shape[1]))
    _all_gather_single(out, payload, group)
    return out.view(world, payload.shape[0], payload.shape[1])


# ---- the call header: every rank checks that every other rank made the same call ------------------------

# Per-row inputs, in RowInputs order, as the agreement errors name them.
ROW_INPUT_NAMES = (
    "tokens (or response_mask, which marks the ignored tokens)",
    "rollout_logprobs",
    "advantages",
    "topk_ids",
    "topk_logprobs",
    "anchor_logprobs",
)
_HEADER_WORDS = 16  # int64 words: the fixed size that lets ranks with different row counts still meet
_MAGIC = 0x4450504F  # header[0] of every call header ("DPPO")
_FLAG, _ROWS, _TOPK, _LOCAL_VOCAB, _ACC_BYTES, _OFFSETS, _SETTINGS, _FINGERPRINTS = 1, 2, 3, 4, 5, 6, 7, 8
_ABSENT = -1  # the fingerprint of an input that was not passed (None)
# Odd 64-bit constants (two's complement) of the fingerprint's multiply-xor mix.
_MIX_A, _MIX_B = -7046029254386353131, -4658895280553007687
_WORD_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(t: Optional[Tensor], device: torch.device) -> Tensor:
    """A 0-d int64 hash of ``t``'s dtype, shape and bytes (position-dependent, so reordered rows differ too).

    Integer arithmetic that wraps mod 2^64 and whose reduction order cannot change the result: identical inputs
    give identical fingerprints on every rank and device, whatever the SIMD level; a changed element changes it
    (one changed word always does: the multiplier is odd). Device ops only, no host sync."""
    if t is None:
        return torch.full((), _ABSENT, dtype=torch.int64, device=device)
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view(_WORD_VIEWS[flat.element_size()]).to(torch.int64)
    position = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    mixed = torch.bitwise_xor(words, position * _MIX_A + _host_key(t.dtype, tuple(t.shape))) * _MIX_B
    return mixed.sum().to(device)


def _host_key(*values: object) -> int:
    """A deterministic signed 64-bit hash of Python values (``hash()`` of a str differs between processes)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def comm_device(group: Optional[dist.ProcessGroup], device: Optional[torch.device]) -> torch.device:
    """Where ``group``'s collectives take their tensors: the GPU for an NCCL group, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return (
            device
            if device is not None and device.type == "cuda"
            else torch.device("cuda", torch.cuda.current_device())
        )
    return torch.device("cpu")


class CallHeader(NamedTuple):
    """One rank's call header, as exchanged (a row of ``[W, 16]`` int64)."""

    failed: bool
    rows: int
    topk: int
    local_vocab: int
    acc_bytes: int
    offsets: int
    settings: int
    fingerprints: tuple[int, ...]


class Rendezvous:
    """The forward's first collective, one per call: an all-gather of a fixed-size header per rank (a failure flag,
    the row count, K, the local vocabulary size, the statistics' dtype, hashes of ``vocab_offsets`` and of the
    settings, and a :func:`fingerprint` of each per-row input). Its size never depends on the inputs, so ranks
    that passed different row counts still meet, and every rank then checks every rank's header and raises the
    same error. A second collective is unavoidable for that: a collective's sizes must agree on every rank, and
    the statistics' size depends on ``N``. A rank whose local checks failed joins with the failure flag set
    (:func:`agreed_failures`), so that the others raise instead of waiting in a collective it never reaches."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        self.done = False

    def exchange(self, header: Tensor) -> list[CallHeader]:
        """All-gather ``header`` (``[16]`` int64) and return every rank's header: the one host sync of the forward."""
        self.done = True
        world = dist.get_world_size(self.group)
        out = header.new_empty((world * _HEADER_WORDS,))
        _all_gather_single(out, header.contiguous(), self.group)
        table = out.view(world, _HEADER_WORDS).tolist()
        if any(words[0] != _MAGIC for words in table):
            raise RuntimeError(
                "vocab-parallel loss: a rank of vocab_parallel_group sent something other than a call header to the "
                "forward's first all-gather; every rank of the group must make the same loss calls in the same order"
            )
        return [
            CallHeader(
                bool(w[_FLAG]), *w[_ROWS:_FINGERPRINTS], tuple(w[_FINGERPRINTS : _FINGERPRINTS + len(ROW_INPUT_NAMES)])
            )
            for w in table
        ]

    def exchange_failure(self) -> None:
        """Join the exchange as a rank whose local checks failed (its own error is then raised by the caller)."""
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=comm_device(self.group, None))
        header[0], header[_FLAG] = _MAGIC, 1
        self.exchange(header)


def call_header(
    rows: Sequence[Optional[Tensor]],
    n: int,
    local_vocab: int,
    acc_dtype: torch.dtype,
    offsets: Optional[Sequence[int]],
    settings: object,
    device: torch.device,
) -> Tensor:
    """This rank's ``[16]`` int64 header (see :class:`Rendezvous`) on ``device`` (:func:`comm_device`)."""
    topk = 0 if rows[3] is None else int(rows[3].shape[1])
    host = [_MAGIC, 0, n, topk, local_vocab, torch.empty((), dtype=acc_dtype).element_size()]
    host += [_ABSENT if offsets is None else _host_key(*offsets), _host_key(settings)]
    words = torch.tensor(host + [0] * (_HEADER_WORDS - len(host)), dtype=torch.int64)
    if device.type == "cuda":  # a pinned source: the copy does not wait for the stream's queued work
        words = words.pin_memory()
    words = words.to(device, non_blocking=True)
    prints = torch.stack([fingerprint(t, device) for t in rows])
    return torch.cat([words[:_FINGERPRINTS], prints, words[_FINGERPRINTS + len(rows) :]])


def check_agreement(headers: list[CallHeader], offsets: Optional[list[int]], world: int) -> list[int]:
    """Raise, identically on every rank, if any rank failed or made another call than the others; else return the
    call's offsets (``offsets``, or derived from the ranks' local vocabulary sizes)."""
    failed = [r for r, h in enumerate(headers) if h.failed]
    if failed:
        raise RuntimeError(
            f"vocab-parallel loss: rank(s) {failed} of vocab_parallel_group raised an error in their own checks of "
            "this call (see their error); every rank stops with this error so that none waits in a collective"
        )

    def differing(field: str, what: str, fix: str, show: bool = True) -> None:
        values = [getattr(h, field) for h in headers]
        if len(set(values)) > 1:
            if show:
                seen = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            else:  # hashes: name the ranks that differ
                seen = f"rank(s) {[r for r, v in enumerate(values) if v != values[0]]} differ from rank 0"
            raise ValueError(
                f"vocab-parallel loss: the ranks of vocab_parallel_group passed different {what} ({seen}); {fix}"
            )

    same_rows = (
        "every rank must pass the same rows (tokens, rollout_logprobs, advantages, response_mask, top-K and anchor "
        "replicated); only the logits' (or the LM head's) vocabulary columns are split"
    )
    differing("rows", "row counts N", same_rows)
    differing("topk", "top-K widths K", same_rows)
    differing(
        "acc_bytes", "logits dtypes (statistics of different precision)", "pass logits of one dtype on every rank"
    )
    differing(
        "settings", "loss settings", "pass the same mode, temperature, thresholds, ratio_cap and aggregation", False
    )
    differing("offsets", "vocab_offsets", "pass the same vocab_offsets (or None) on every rank", False)
    for i, name in enumerate(ROW_INPUT_NAMES):
        prints = [h.fingerprints[i] for h in headers]
        if len(set(prints)) > 1:
            odd = [r for r, p in enumerate(prints) if p != prints[0]]
            raise ValueError(
                f"vocab-parallel loss: {name} differ between the ranks of vocab_parallel_group (rank(s) {odd} "
                f"differ from rank 0 in dtype, shape or values); {same_rows}"
            )
    local = [h.local_vocab for h in headers]
    if offsets is None:
        offsets = [0]
        for v in local:
            offsets.append(offsets[-1] + v)
    for r in range(world):
        want = offsets[r + 1] - offsets[r]
        if local[r] != want:
            raise ValueError(
                f"vocab-parallel split mismatch: rank {r} of the group holds {local[r]} columns, but vocab_offsets "
                f"{offsets} gives it {want} (columns {offsets[r]} to {offsets[r + 1]})"
            )
    return offsets


def _can_join(group: Optional[dist.ProcessGroup]) -> bool:
    try:
        return dist.is_available() and dist.is_initialized() and dist.get_rank(group) >= 0
    except Exception:  # not a process group at all: nobody to wait for this rank
        return False


@contextlib.contextmanager
def agreed_failures(group: Optional[dist.ProcessGroup]) -> Iterator[Rendezvous]:
    """The body of a vocab-parallel call: an exception raised on this rank before the call header was exchanged
    still joins the exchange (flagged as failed) and is then re-raised, so that the other ranks raise too."""
    rendezvous = Rendezvous(group)
    try:
        yield rendezvous
    except Exception:
        if not rendezvous.done and _can_join(group):
            rendezvous.exchange_failure()
        raise


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

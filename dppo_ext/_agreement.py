"""The agreement protocol of a vocab-parallel call: every rank checks that every other rank made the same call.

- ``Rendezvous``: the forward's first collective, a fixed-size call header per rank (``call_header``: row count,
  K, slice width, statistics dtype, hashes of the split and the settings, a ``fingerprint`` of each per-row input,
  a failure flag), exchanged once per call.
- ``check_agreement``: every rank raises the same error when the ranks' headers differ, and returns the call's
  vocabulary offsets otherwise.
- ``agreed_failures``: the body of a call; a rank whose own checks failed still joins the exchange (flagged), so
  that no rank waits in a collective that another never reaches. ``vocab_parallel_call``: the same, or nothing for
  an unsharded call, the one way every entry point enters a call.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import ContextManager, Iterator, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._vocab_split import all_gather_single, comm_device

__all__ = [
    "ROW_INPUT_NAMES",
    "CallHeader",
    "Rendezvous",
    "agreed_failures",
    "call_header",
    "check_agreement",
    "fingerprint",
    "vocab_parallel_call",
]

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
        all_gather_single(out, header.contiguous(), self.group)
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


def vocab_parallel_call(group: Optional[dist.ProcessGroup]) -> ContextManager[Optional[Rendezvous]]:
    """The body of an entry point's call: :func:`agreed_failures` over ``group`` when the vocabulary is sharded (an
    error of this rank alone still reaches the other ranks), nothing (``None``) when ``group`` is None."""
    return contextlib.nullcontext() if group is None else agreed_failures(group)

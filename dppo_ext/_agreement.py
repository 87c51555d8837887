"""The agreement protocol of a vocab-parallel call: every rank checks that every other rank made the same call.

- ``Rendezvous``: the forward's first collective, a fixed-size call header per rank (``call_header``: row count,
  K, slice width, statistics dtype, the input's dtype, hashes of the split, of the settings (by value: ``1`` and
  ``1.0`` agree) and of the dtype and shape of every tensor a later collective reduces, a ``fingerprint`` of each
  per-row input and of the replicated ``hidden``, a failure flag), exchanged once per call.
- ``check_agreement``: every rank raises the same error when the ranks' headers differ, and returns the call's
  vocabulary offsets otherwise.
- ``agreed_failures``: the body of a call; a rank whose own checks failed still joins the exchange (flagged), so
  that no rank waits in a collective that another never reaches. ``vocab_parallel_call``: the same, or nothing for
  an unsharded call, the one way every entry point enters a call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import numbers
from typing import Callable, ContextManager, Iterator, NamedTuple, Optional, Sequence

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
    "gather_settings",
    "settings_fields",
    "settings_key",
    "vocab_parallel_call",
]

ROW_INPUT_NAMES = (
    "tokens (or response_mask, which marks the ignored tokens)",
    "rollout_logprobs",
    "advantages",
    "topk_ids",
    "topk_logprobs",
    "anchor_logprobs",
    "kept_ids",
)
_HEADER_WORDS = 18  # int64 words: the fixed size that lets ranks with different row counts still meet
_MAGIC = 0x4450504F  # header[0] of every call header ("DPPO")
_FLAG, _ROWS, _TOPK, _LOCAL_VOCAB, _ACC_BYTES, _OFFSETS, _SETTINGS, _FINGERPRINTS = 1, 2, 3, 4, 5, 6, 7, 8
_DTYPE, _REDUCED, _HIDDEN = 15, 16, 17  # after the fingerprints: the input's dtype, the reduced tensors, hidden
# The input dtypes a header names (its index; -1 for any other): shown by name when the ranks differ.
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_CHUNK_WORDS = 1 << 20  # the fingerprint's working set: int64 temporaries of this many words, whatever the input
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
    words = flat.view(_WORD_VIEWS[flat.element_size()])
    key = _host_key(t.dtype, tuple(t.shape))
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    # In chunks (a [N, H] hidden would otherwise need several int64 copies of itself); the wrapping sum is the same.
    for start in range(0, words.numel(), _CHUNK_WORDS):
        part = words[start : start + _CHUNK_WORDS].to(torch.int64)
        position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=words.device)
        total += (torch.bitwise_xor(part, position * _MIX_A + key) * _MIX_B).sum()
    return total.to(device)


def _by_value(value: object) -> object:
    """``value`` as the ops see it: a real number as a float (``1`` and ``1.0``, ``-0.0`` and ``0.0`` agree; a
    one-element tensor by its value), a bool or anything else as it is."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        value = value.item()
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return float(value) + 0.0
        except OverflowError:  # an int beyond float: no op can take it, its own check refuses it
            return value
    return value


def settings_fields(settings: object) -> list[tuple[str, object]]:
    """``(name, value)`` of each setting of a call, compared by value (:func:`_by_value`): the fields of a dataclass,
    the places of a tuple (``"#i"``), or the one value."""
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        fields = [(f.name, getattr(settings, f.name)) for f in dataclasses.fields(settings)]
    elif isinstance(settings, tuple):
        fields = [(f"#{i}", v) for i, v in enumerate(settings)]
    else:
        fields = [("settings", settings)]
    return [(name, _by_value(value)) for name, value in fields]


def settings_key(settings: object) -> tuple:
    """The settings of a call compared by value (:func:`settings_fields`)."""
    if not isinstance(settings, tuple) and not (dataclasses.is_dataclass(settings) and not isinstance(settings, type)):
        return (settings,)
    return (type(settings).__name__, *(value for _, value in settings_fields(settings)))


def gather_settings(settings: object, group: Optional[dist.ProcessGroup]) -> list[list[tuple[str, object]]]:
    """Every rank's :func:`settings_fields` (a second collective, made only once the ranks' settings hashes differ,
    by every rank: each saw the same headers), so that the refusal names the setting and each rank's value."""
    gathered: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, settings_fields(settings), group=group)
    return gathered  # type: ignore[return-value]


def _differing_settings(ranks: Sequence[Sequence[tuple[str, object]]]) -> str:
    """``name (rank 0: v0, rank 1: v1)`` for each setting whose value differs between the ranks."""
    names = [name for name, _ in ranks[0]]
    parts = []
    for name in names:
        values = [dict(fields).get(name) for fields in ranks]
        if any(repr(v) != repr(values[0]) for v in values):
            parts.append(f"{name} (" + ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values)) + ")")
    return "; ".join(parts) or "the same values, but a different kind of settings"


def _host_key(*values: object) -> int:
    """A deterministic signed 64-bit hash of Python values (``hash()`` of a str differs between processes)."""
    digest = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class CallHeader(NamedTuple):
    """One rank's call header, as exchanged (a row of ``[W, 18]`` int64)."""

    failed: bool
    rows: int
    topk: int
    local_vocab: int
    acc_bytes: int
    offsets: int
    settings: int
    fingerprints: tuple[int, ...]
    dtype: int
    reduced: int
    hidden: int


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
        """All-gather ``header`` (``[18]`` int64) and return every rank's header: the one host sync of the forward."""
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
                bool(w[_FLAG]),
                *w[_ROWS:_FINGERPRINTS],
                tuple(w[_FINGERPRINTS : _FINGERPRINTS + len(ROW_INPUT_NAMES)]),
                *w[_DTYPE : _HIDDEN + 1],
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
    *,
    dtype: torch.dtype,
    reduced: Sequence[tuple[str, torch.dtype, Sequence[int]]] = (),
    hidden: Optional[Tensor] = None,
) -> Tensor:
    """This rank's ``[18]`` int64 header (see :class:`Rendezvous`) on ``device`` (:func:`comm_device`).

    ``dtype``: the input's (logits or hidden); ``reduced``: ``(name, dtype, shape)`` of every tensor that a later
    collective of the call reduces (the fused backward's hidden-state gradient), so that no collective meets
    mismatched sizes or dtypes; ``hidden``: the replicated hidden states of the fused path (fingerprinted)."""
    topk = 0 if rows[3] is None else int(rows[3].shape[1])
    host = [_MAGIC, 0, n, topk, local_vocab, torch.empty((), dtype=acc_dtype).element_size()]
    host += [_ABSENT if offsets is None else _host_key(*offsets), _host_key(settings_key(settings))]
    host += [_ABSENT] * len(rows)  # the fingerprints' places
    reduced_key = _host_key(*((name, str(dt), tuple(int(d) for d in shape)) for name, dt, shape in reduced))
    host += [_DTYPES.index(dtype) if dtype in _DTYPES else _ABSENT, reduced_key, _ABSENT]
    words = torch.tensor(host + [0] * (_HEADER_WORDS - len(host)), dtype=torch.int64)
    if device.type == "cuda":  # a pinned source: the copy does not wait for the stream's queued work
        words = words.pin_memory()
    words = words.to(device, non_blocking=True)
    prints = torch.stack([fingerprint(t, device) for t in rows])
    hidden_print = fingerprint(hidden, device).reshape(1)
    return torch.cat(
        [words[:_FINGERPRINTS], prints, words[_FINGERPRINTS + len(rows) : _HIDDEN], hidden_print, words[_HIDDEN + 1 :]]
    )


def check_agreement(
    headers: list[CallHeader],
    offsets: Optional[list[int]],
    world: int,
    ranks_settings: Optional[Callable[[], Sequence[Sequence[tuple[str, object]]]]] = None,
) -> list[int]:
    """Raise, identically on every rank, if any rank failed or made another call than the others; else return the
    call's offsets (``offsets``, or derived from the ranks' local vocabulary sizes). ``ranks_settings``: every
    rank's :func:`settings_fields` (:func:`gather_settings`), asked for only when the settings differ, so that the
    refusal names the setting and the values."""
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
    dtypes = [str(_DTYPES[h.dtype]) if 0 <= h.dtype < len(_DTYPES) else "another dtype" for h in headers]
    if len(set(dtypes)) > 1:
        seen = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dtypes))
        raise ValueError(
            f"vocab-parallel loss: the ranks of vocab_parallel_group passed logits (or hidden and LM-head rows) of "
            f"different dtypes ({seen}); pass one dtype on every rank"
        )
    if len({h.settings for h in headers}) > 1:
        seen = f"rank(s) {[r for r, h in enumerate(headers) if h.settings != headers[0].settings]} differ from rank 0"
        if ranks_settings is not None:
            seen = _differing_settings(ranks_settings())
        raise ValueError(
            f"vocab-parallel loss: the ranks of vocab_parallel_group passed different loss settings: {seen}; pass "
            "the same mode, temperature, thresholds, ratio_cap and aggregation on every rank, by value (a float32 "
            "tensor holds another number than the Python float it was made from: 0.7 is 0.699999988)"
        )
    differing("offsets", "vocab_offsets", "pass the same vocab_offsets (or None) on every rank", False)
    differing(
        "reduced",
        "shapes or dtypes of a tensor that the call's backward all-reduces (the hidden-state gradient: hidden's "
        "[N, H] and dtype, and whether reduce_hidden_grad applies)",
        "pass hidden of the same shape and dtype, and the same reduce_hidden_grad and requires_grad, on every rank",
        False,
    )
    for i, name in enumerate(ROW_INPUT_NAMES):
        prints = [h.fingerprints[i] for h in headers]
        if len(set(prints)) > 1:
            odd = [r for r, p in enumerate(prints) if p != prints[0]]
            raise ValueError(
                f"vocab-parallel loss: {name} differ between the ranks of vocab_parallel_group (rank(s) {odd} "
                f"differ from rank 0 in dtype, shape or values); {same_rows}"
            )
    prints = [h.hidden for h in headers]
    if len(set(prints)) > 1:
        odd = [r for r, p in enumerate(prints) if p != prints[0]]
        raise ValueError(
            f"vocab-parallel loss: hidden differs between the ranks of vocab_parallel_group (rank(s) {odd} differ "
            "from rank 0 in its values: a changed row, a NaN); hidden must be the same full [N, H] on every rank, "
            "only the LM head's vocabulary rows are split"
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

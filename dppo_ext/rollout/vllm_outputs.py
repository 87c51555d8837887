"""vLLM's ``RequestOutput``s -> the DPPO op's tensors, for any training loop (ours, TRL's, yours).

The recipe that gives the right ``mu``::

    llm = LLM(model=path, logprobs_mode="processed_logprobs")       # log-probs of logits / T
    params = SamplingParams(n=G, temperature=T, logprobs=K)          # K >= 1 for the top-K modes
    rollout = vllm_rollout_tensors(llm.generate(prompts, params), top_k=K)
    loss, metrics = dppo_loss(logits, rollout.tokens, rollout.rollout_logprobs, advantages,
                              response_mask=rollout.response_mask, topk_ids=rollout.topk_ids,
                              topk_logprobs=rollout.topk_logprobs, temperature=T, mode="topk_tv")

Without ``logprobs_mode="processed_logprobs"`` vLLM reports log-probs of the raw logits, so at
``T != 1`` every token shows a spurious mismatch ``|pi - mu|`` and DPPO masks tokens the policy
never moved.

For every generated position vLLM returns the ``K`` highest-ranked tokens plus the sampled one
(``K + 1`` entries when the sampled token ranks below ``K``). The op wants a fixed ``[K]`` row
that contains the sampled token: it replaces the lowest-ranked entry when it is not among the
``K`` best (:func:`dppo_ext.rollout.base.force_sampled_into_topk`). Every path of this package
goes through :func:`ranked_topk_rows` for that step -- the trainer's vLLM engine
(:func:`extract_token_logprobs` on ``RequestOutput``s) and the TRL integration (TRL's rank-sorted
lists) -- so one rollout gives the same top-K divergence on both.

Truncated sampling (``SamplingParams`` with ``top_k`` > 0, ``top_p`` < 1 or ``min_p`` > 0): vLLM samples from the
distribution truncated to a kept set and renormalised, and its processed log-probs are those of that distribution:
``-inf`` for every returned token outside the kept set. Given ``sampling_params=``, :func:`vllm_rollout_tensors`
returns the kept set of every position as ``kept_ids [B, T, S]`` (the finite entries, by rank; -1 padding) for the
loss to renormalise pi over (DeepSeek-V3.2's "keep sampling mask"). That set is known exactly only where a returned
entry is ``-inf`` (the set ends among the returned ones) or where top-k sampling keeps at most the ``logprobs``
returned; elsewhere the set may hold more tokens than vLLM returned, and the position raises (ask for more
``logprobs``, up to vLLM's ``max_logprobs``), or derive the set from the trainer's logits by the same rule
(:func:`dppo_ext.rollout.kept_ids_by_rule`, docs/contract.md "Truncated sampling").

Nothing here imports vLLM: the functions read the fields of vLLM's objects (``outputs``,
``token_ids``, ``logprobs`` dictionaries of ``Logprob(logprob, rank)``, ``prompt_token_ids``) and of
``SamplingParams`` (``top_k``, ``top_p``, ``min_p``, ``logprobs``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dppo_ext.contract import sampling_truncation
from dppo_ext.rollout.base import RolloutSample, force_sampled_into_topk

__all__ = [
    "RolloutTensors",
    "extract_token_logprobs",
    "kept_sets",
    "pack_rollout_samples",
    "ranked_topk_rows",
    "rollout_samples_from_vllm",
    "vllm_rollout_tensors",
]


def ranked_topk_rows(
    token_ids: Sequence[int],
    ranked_ids: Sequence[Sequence[int]],
    ranked_logprobs: Sequence[Sequence[Optional[float]]],
    top_k: int,
) -> tuple[list[Optional[float]], list[list[int]] | None, list[list[float]] | None]:
    """Sampled-token log-probs and fixed-size top-K rows from rank-sorted candidates.

    Args:
        token_ids: [T] sampled tokens.
        ranked_ids: [T][>= K] candidate ids per position, sorted by rank (most likely first); the
            sampled token must be among them (vLLM appends it when it ranks below K).
        ranked_logprobs: [T][same] their log-probs; ``None`` marks a value vLLM could not compute.
        top_k: K, entries kept per position (0 = none).

    Returns:
        ``(logprobs [T], topk_ids [T][K] | None, topk_logprobs [T][K] | None)``. A top-K row is the
        K best candidates by rank, the sampled token replacing the last one when it is not among
        them. A ``None`` sampled log-prob stays ``None``; a ``None`` top-K log-prob becomes ``-inf``.
    """
    if not len(token_ids) == len(ranked_ids) == len(ranked_logprobs):
        raise ValueError(
            f"token_ids, ranked_ids and ranked_logprobs must have the same length, got "
            f"{len(token_ids)}, {len(ranked_ids)} and {len(ranked_logprobs)}"
        )
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    logprobs: list[Optional[float]] = []
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    for pos, (tok, ids, lps) in enumerate(zip(token_ids, ranked_ids, ranked_logprobs)):
        ids, lps = list(ids), list(lps)
        if len(ids) != len(lps):
            raise ValueError(f"position {pos}: {len(ids)} candidate ids but {len(lps)} log-probs")
        if tok not in ids:
            raise ValueError(
                f"vLLM returned no log-prob for the sampled token {tok} at position {pos} "
                f"(candidates: {ids}); was SamplingParams(logprobs=...) set?"
            )
        sampled = lps[ids.index(tok)]
        sampled = None if sampled is None else float(sampled)
        logprobs.append(sampled)
        if top_k == 0:
            continue
        if len(ids) < top_k:
            raise ValueError(
                f"vLLM returned {len(ids)} log-prob entries at position {pos}, fewer than top_k={top_k}; "
                "ask for SamplingParams(logprobs=K) with K >= top_k (and K <= the vocabulary size)"
            )
        best = [-math.inf if lp is None else float(lp) for lp in lps[:top_k]]
        row_ids, row_lps = force_sampled_into_topk(ids[:top_k], best, tok, -math.inf if sampled is None else sampled)
        topk_ids.append(row_ids)
        topk_logprobs.append(row_lps)
    if top_k == 0:
        return logprobs, None, None
    return logprobs, topk_ids, topk_logprobs


def extract_token_logprobs(
    token_ids: Sequence[int],
    position_logprobs: Sequence[Mapping[int, Any]],
    top_k: int,
) -> tuple[list[float], list[list[int]] | None, list[list[float]] | None]:
    """DPPO rollout fields of one vLLM completion (``CompletionOutput.token_ids`` / ``.logprobs``).

    Args:
        token_ids: [T] sampled tokens.
        position_logprobs: [T] mappings ``token_id -> Logprob`` (objects with ``.logprob`` and
            ``.rank``, rank 1 = most likely) as vLLM returns them for ``SamplingParams(logprobs=K)``.
        top_k: K, number of top-K entries to keep per position (0 = none).

    Returns:
        ``(logprobs [T], topk_ids [T][K] | None, topk_logprobs [T][K] | None)``, see
        :func:`ranked_topk_rows`.
    """
    if position_logprobs is None:
        raise ValueError("the completion carries no log-probs; generate with SamplingParams(logprobs=K), K >= 0")
    if len(token_ids) != len(position_logprobs):
        raise ValueError(
            f"token_ids and position_logprobs must have the same length, got "
            f"{len(token_ids)} and {len(position_logprobs)}"
        )
    ranked = [sorted(entries.items(), key=lambda item: item[1].rank) for entries in position_logprobs]
    return ranked_topk_rows(
        token_ids,
        [[tid for tid, _ in row] for row in ranked],
        [[lp.logprob for _, lp in row] for row in ranked],
        top_k,
    )


def kept_sets(
    token_ids: Sequence[int],
    position_logprobs: Sequence[Mapping[int, Any]],
    *,
    logprobs: int,
    top_k: int,
    vocab_size: Optional[int] = None,
) -> list[list[int]]:
    """The kept set of every position of one completion generated with truncated sampling.

    Args:
        token_ids: [T] sampled tokens.
        position_logprobs: [T] mappings ``token_id -> Logprob`` (``.logprob``, ``.rank``) of an
            ``LLM(..., logprobs_mode="processed_logprobs")``: ``-inf`` marks a token the truncation removed.
        logprobs: L, ``SamplingParams.logprobs`` (vLLM returns the L best ranks plus the sampled token).
        top_k: ``SamplingParams.top_k`` (<= 0: no top-k truncation).
        vocab_size: V of the model, when known: ``logprobs >= V`` returns every token, so every set is exact.

    Returns:
        [T] lists of the kept token ids (the finite entries), by rank.

    Raises ValueError naming the position when the kept set may hold more tokens than vLLM returned: all L best
    entries finite, unless top-k sampling keeps at most L tokens (0 < top_k <= L) or fewer than L entries came back
    (the whole vocabulary); and when the sampled token is not in the set (its log-prob is -inf).
    """
    if len(token_ids) != len(position_logprobs):
        raise ValueError(
            f"token_ids and position_logprobs must have the same length, got "
            f"{len(token_ids)} and {len(position_logprobs)}"
        )
    exact_by_top_k = 0 < top_k <= logprobs or (vocab_size is not None and logprobs >= vocab_size)
    sets = []
    for pos, (tok, entries) in enumerate(zip(token_ids, position_logprobs)):
        ranked = sorted(entries.items(), key=lambda item: item[1].rank)
        kept = [tid for tid, lp in ranked if lp.logprob is not None and math.isfinite(lp.logprob)]
        best = [lp.logprob for _, lp in ranked if lp.rank <= logprobs]
        if len(best) >= logprobs and all(lp is not None and math.isfinite(lp) for lp in best) and not exact_by_top_k:
            raise ValueError(
                f"position {pos}: all {len(best)} best log-probs vLLM returned are finite, so the kept set of the "
                f"truncated sampling may hold more tokens than the {len(best)} returned; raise "
                f"SamplingParams(logprobs=...) above {len(best)} (and vLLM's LLM(max_logprobs=...) with it), sample "
                "with top_k <= logprobs, or derive the kept set from the trainer's logits with "
                "dppo_ext.rollout.kept_ids_by_rule"
            )
        if tok not in kept:
            raise ValueError(
                f"position {pos}: the sampled token {tok} is not in its kept set (vLLM returned log-prob "
                f"{entries[tok].logprob if tok in entries else None} for it); was the engine created with "
                "logprobs_mode='processed_logprobs'?"
            )
        sets.append(kept)
    return sets


def _sampling_settings(sampling_params: Any) -> tuple[bool, int, int]:
    """``(truncates, logprobs, top_k)`` of a ``SamplingParams`` (None: no truncation known)."""
    if sampling_params is None:
        return False, 0, 0
    top_k, top_p, min_p = (getattr(sampling_params, name, None) for name in ("top_k", "top_p", "min_p"))
    names = {name: f"sampling_params.{name}" for name in ("top_k", "top_p", "min_p")}
    truncates = bool(sampling_truncation(top_k, 1.0 if top_p is None else top_p, min_p, names=names))
    return truncates, int(getattr(sampling_params, "logprobs", None) or 0), top_k or 0


def rollout_samples_from_vllm(
    outputs: Sequence[Any], top_k: int, *, sampling_params: Any = None, vocab_size: Optional[int] = None
) -> list[list[RolloutSample]]:
    """One :class:`RolloutSample` per completion of each ``RequestOutput``.

    Args:
        outputs: vLLM ``RequestOutput``s (``LLM.generate``'s return value), generated with
            ``SamplingParams(logprobs=max(top_k, 0))`` and ``logprobs_mode="processed_logprobs"``.
        top_k: K, top-K entries per position (0 = none).
        sampling_params: the ``SamplingParams`` they were generated with; when they truncate (``top_k`` > 0,
            ``top_p`` < 1 or ``min_p`` > 0) every sample carries its ``kept_ids`` (:func:`kept_sets`). None: no
            truncation; a returned ``-inf`` log-prob beside the sampled token then raises (it shows truncation).
        vocab_size: the model's V, when known (see :func:`kept_sets`).

    Returns:
        ``[len(outputs)][n]`` samples, in vLLM's order.
    """
    truncates, logprobs, sampling_top_k = _sampling_settings(sampling_params)
    results: list[list[RolloutSample]] = []
    for i, request in enumerate(outputs):
        group = []
        for j, completion in enumerate(request.outputs):
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(
                    f"vLLM finished a request with reason {completion.finish_reason!r}; expected 'stop' or 'length'"
                )
            response = list(completion.token_ids)
            kept = None
            try:
                token_logprobs, topk_ids, topk_logprobs = extract_token_logprobs(response, completion.logprobs, top_k)
                if truncates:
                    kept = kept_sets(
                        response, completion.logprobs, logprobs=logprobs, top_k=sampling_top_k, vocab_size=vocab_size
                    )
                else:
                    _refuse_unannounced_truncation(response, completion.logprobs)
            except ValueError as exc:  # name the sequence: the position alone does not find it in a batch
                raise ValueError(f"request {i}, completion {j}: {exc}") from exc
            missing = [pos for pos, lp in enumerate(token_logprobs) if lp is None]
            if missing:
                pos = missing[0]
                raise ValueError(
                    f"request {i}, completion {j}, position {pos}: vLLM returned no log-prob (None) for the sampled "
                    f"token {response[pos]} ({len(missing)} such position(s) in this completion); the loss needs "
                    "the rollout log-prob of every sampled token: generate with SamplingParams(logprobs=K) and "
                    "LLM(..., logprobs_mode='processed_logprobs'), or drop this completion"
                )
            group.append(
                RolloutSample(
                    prompt_ids=list(request.prompt_token_ids),
                    response_ids=response,
                    logprobs=token_logprobs,
                    topk_ids=topk_ids,
                    topk_logprobs=topk_logprobs,
                    text=completion.text,
                    finish_reason=completion.finish_reason,
                    kept_ids=kept,
                )
            )
        results.append(group)
    return results


@dataclass
class RolloutTensors:
    """The response side of a rollout batch, right-padded to the longest response T.

    Attributes:
        tokens: [B, T] int64 sampled ids (``pad_token_id`` on padding).
        rollout_logprobs: [B, T] float32 log mu of each sampled token (0 on padding).
        response_mask: [B, T] bool, True on generated tokens.
        topk_ids: [B, T, K] int64 top-K ids with the sampled token forced in (0 on padding), or None.
        topk_logprobs: [B, T, K] float32 matching log-probs (0 on padding), or None.
        prompt_ids: B prompt token lists (B = completions, request by request).
        kept_ids: [B, T, S] int64 kept set of each position under truncated sampling (the token ids, by rank;
            -1 pads each set to S, the largest, and fills padding positions), or None when sampling did not truncate.
    """

    tokens: torch.Tensor
    rollout_logprobs: torch.Tensor
    response_mask: torch.Tensor
    topk_ids: Optional[torch.Tensor]
    topk_logprobs: Optional[torch.Tensor]
    prompt_ids: list[list[int]]
    kept_ids: Optional[torch.Tensor] = None


def pack_rollout_samples(samples: Sequence[RolloutSample], *, pad_token_id: int, with_topk: bool) -> RolloutTensors:
    """Right-pad the responses of ``samples`` into :class:`RolloutTensors`.

    Args:
        samples: B samples (responses may be empty; then their row is all padding).
        pad_token_id: id written into ``tokens`` at padding.
        with_topk: pack ``topk_ids`` / ``topk_logprobs`` too (every non-empty sample must carry
            them, with one K).

    ``kept_ids`` is packed when any sample carries it (then every non-empty one must).
    """
    if not samples:
        raise ValueError("need at least one rollout sample, got none")
    batch, length = len(samples), max(len(s.response_ids) for s in samples)
    tokens = torch.full((batch, length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((batch, length), dtype=torch.bool)
    rollout_logprobs = torch.zeros((batch, length), dtype=torch.float32)
    topk_ids = topk_logprobs = kept_ids = None
    with_kept = any(s.kept_ids is not None for s in samples)
    if with_kept:
        if any(s.kept_ids is None for s in samples if s.response_ids):
            raise ValueError("some samples carry kept_ids and some do not; one rollout batch has one sampling rule")
        width = max((len(kept) for s in samples if s.kept_ids for kept in s.kept_ids), default=1)
        kept_ids = torch.full((batch, length, width), -1, dtype=torch.long)
    if with_topk:
        k = _topk_width(samples)
        topk_ids = torch.zeros((batch, length, k), dtype=torch.long)
        topk_logprobs = torch.zeros((batch, length, k), dtype=torch.float32)
    for row, sample in enumerate(samples):
        t = len(sample.response_ids)
        if len(sample.logprobs) != t:
            raise ValueError(f"sample {row}: {t} response tokens but {len(sample.logprobs)} log-probs")
        if t == 0:
            continue
        missing = next((pos for pos, lp in enumerate(sample.logprobs) if lp is None), None)
        if missing is not None:
            raise ValueError(
                f"sample {row}, position {missing}: no rollout log-prob (None) for the sampled token "
                f"{sample.response_ids[missing]}; every sampled token needs one (drop the sample, or generate with "
                "SamplingParams(logprobs=K) and logprobs_mode='processed_logprobs')"
            )
        tokens[row, :t] = torch.tensor(sample.response_ids, dtype=torch.long)
        response_mask[row, :t] = True
        rollout_logprobs[row, :t] = torch.tensor(sample.logprobs, dtype=torch.float32)
        if with_topk:
            topk_ids[row, :t] = torch.tensor(sample.topk_ids, dtype=torch.long)
            topk_logprobs[row, :t] = torch.tensor(sample.topk_logprobs, dtype=torch.float32)
        if with_kept:
            if len(sample.kept_ids) != t:
                raise ValueError(f"sample {row}: {t} response tokens but {len(sample.kept_ids)} kept sets")
            for pos, kept in enumerate(sample.kept_ids):
                kept_ids[row, pos, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    return RolloutTensors(
        tokens=tokens,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        prompt_ids=[list(s.prompt_ids) for s in samples],
        kept_ids=kept_ids,
    )


def vllm_rollout_tensors(
    outputs: Sequence[Any], top_k: int = 0, *, pad_token_id: int = 0, sampling_params: Any = None
) -> RolloutTensors:
    """The DPPO op's rollout tensors from vLLM's ``RequestOutput``s.

    Args:
        outputs: ``LLM.generate``'s return value, from an ``LLM(..., logprobs_mode="processed_logprobs")``
            with ``SamplingParams(logprobs=K)`` (K >= ``top_k``; ``logprobs=0`` is enough for the binary modes).
        top_k: K of the top-K modes (0: no top-K tensors).
        pad_token_id: id written into ``tokens`` at padding.
        sampling_params: the ``SamplingParams`` of the generation. When they truncate (``top_k`` > 0, ``top_p`` < 1,
            ``min_p`` > 0) the result carries ``kept_ids`` (see the module docstring; a position whose kept set may
            exceed what vLLM returned raises, naming it and the settings to raise). None: untruncated sampling.

    Returns:
        :class:`RolloutTensors` with B = all completions, request by request (a GRPO group is
        ``n`` consecutive rows).
    """
    groups = rollout_samples_from_vllm(outputs, top_k, sampling_params=sampling_params)
    samples = [s for group in groups for s in group]
    return pack_rollout_samples(samples, pad_token_id=pad_token_id, with_topk=top_k > 0)


def _refuse_unannounced_truncation(token_ids: Sequence[int], position_logprobs: Sequence[Mapping[int, Any]]) -> None:
    """A returned ``-inf`` beside the sampled token means the sampling truncated; without ``sampling_params`` the
    kept set would be dropped silently."""
    for pos, (tok, entries) in enumerate(zip(token_ids, position_logprobs)):
        removed = [tid for tid, lp in entries.items() if tid != tok and lp.logprob == -math.inf]
        if removed:
            raise ValueError(
                f"position {pos}: vLLM returned log-prob -inf for token(s) {removed[:5]}, which the sampling's "
                "truncation (top_k / top_p / min_p) removed; pass sampling_params= (the SamplingParams of the "
                "generation) so that the kept sets come back as kept_ids, or sample with top_p=1, top_k=-1, min_p=0"
            )


def _topk_width(samples: Sequence[RolloutSample]) -> int:
    if any(s.topk_ids is None or s.topk_logprobs is None for s in samples if s.response_ids):
        raise ValueError("a top-K loss needs topk_ids/topk_logprobs on every sample; generate with top_k >= 1")
    widths = {len(row) for s in samples if s.topk_ids is not None for row in s.topk_ids}
    if len(widths) != 1:
        raise ValueError(f"every top-K row must have the same K, got widths {sorted(widths)}")
    return widths.pop()

"""The sync guard: after a weight sync, the engine must score a sequence as the trainer's model does.

It scores a short, already generated sequence (:data:`PROBE_TOKENS` tokens of an earlier rollout's prompt and
response) in vLLM (``prompt_logprobs``, :func:`engine_logprobs`) and with the trainer's model
(:func:`model_logprobs`), and raises :class:`~dppo_ext.rollout.weight_sync.WeightSyncError` when they differ by more
than the dtypes in use explain (:func:`sync_tolerance`), naming the engine parameters that still hold other values
than the trainer's (:func:`stale_parameters`), or saying that the difference lies in a copy vLLM derives from them.

:func:`push_and_check` is one sync of the reference trainer's vLLM engine and of the TRL integration alike: the
weights go in by the plan of :mod:`dppo_ext.rollout.weight_sync`, then the guard checks them; its result, a
:class:`SyncCheck`, is what both keep as ``last_sync_check``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dppo_ext.rollout.vllm_parity import attention_hint
from dppo_ext.rollout.weight_sync import SyncPlan, WeightSyncError, load_weights_into_vllm

logger = logging.getLogger(__name__)

__all__ = [
    "PROBE_TOKENS",
    "SYNC_TOLERANCES",
    "SyncCheck",
    "SyncGuard",
    "engine_logprobs",
    "model_logprobs",
    "push_and_check",
    "stale_parameters",
    "sync_tolerance",
]

# Tokens of the sequence the guard scores after every sync (prompt and response of an earlier rollout).
PROBE_TOKENS = 32
# |log pi - log mu| the guard accepts per token: ATOL + RTOL * |log pi|, by the narrower dtype of engine and trainer.
# float32: at most 7.6e-6 measured on tiny random models of every tested architecture (log-probs down to -23;
# python_tests/e2e/test_architectures.py, integrations/test_trl_architectures.py), but up to 1.6e-4 on models trained
# for a few hundred RL steps, at a position whose forward is ill-conditioned: there the trainer's own float32
# log-prob is 3.9e-5 off its float64 value too, with every engine parameter equal to the trainer's
# (benchmarks/bench_sync_guard_trained.py). A stale tensor or LM head moves log-probs by 1e-2 or more; one RL step of
# those runs moves the sampled tokens' probabilities by 0.0014-0.084 on average (median 0.017, lag 0), so an engine
# one step behind can sit near this bound on the quietest steps. bfloat16: up to
# 0.24 measured (engine bf16, trainer fp32 or bf16; benchmarks/bench_sync_guard.py), so in bf16 the guard only
# catches gross staleness. float16 (not measured): bf16's bound scaled by their mantissa widths.
SYNC_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-3, 1e-5),
    torch.bfloat16: (0.5, 0.05),
    torch.float16: (0.1, 0.01),
}
_WIDTH = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def sync_tolerance(*dtypes: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` of the guard for an engine and a trainer in ``dtypes`` (the narrowest one decides)."""
    known = [d for d in dtypes if d in SYNC_TOLERANCES] or [torch.float32]
    return SYNC_TOLERANCES[max(known, key=lambda d: _WIDTH[d])]


def engine_logprobs(llm: Any, ids: Sequence[int]) -> torch.Tensor:
    """[len(ids) - 1] float64 log-probs of ``ids[1:]`` under a ``vllm.LLM`` (``prompt_logprobs``, the raw
    distribution): what the sync guard compares with the trainer's."""
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": list(ids)}], SamplingParams(max_tokens=1, prompt_logprobs=0, seed=0), use_tqdm=False
    )[0]
    return torch.tensor(
        [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])], dtype=torch.float64
    )


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1] log-probs of ``ids[1:]`` under a transformers ``model`` (raw logits, eval mode, no gradient):
    the trainer's side of what the sync guard compares (:func:`engine_logprobs` the engine's)."""
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids], device=device)).logits[0, :-1].float()
    finally:
        model.train(training)
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]


@dataclass(frozen=True)
class SyncCheck:
    """One guard check: the largest ``|log pi - log mu|`` over the probe, what was accepted, its cost."""

    max_diff: float
    tolerance: float
    tokens: int
    seconds: float


class SyncGuard:
    """After a sync, vLLM's log-probs of a stored sequence must equal the trainer's (to the dtypes' precision).

    ``remember`` keeps the first :data:`PROBE_TOKENS` tokens of a generated sequence; ``check`` scores them with
    vLLM (``prompt_logprobs``, the raw distribution) and with ``score`` (the trainer's log-probs of ``ids[1:]``),
    and raises :class:`WeightSyncError` naming what is stale. Until a sequence is remembered it checks nothing.
    """

    def __init__(self, engine_dtype: torch.dtype, max_model_len: int) -> None:
        self.engine_dtype = engine_dtype
        self.max_tokens = max(2, min(PROBE_TOKENS, max_model_len - 1))
        self.probe: list[int] | None = None

    def remember(self, ids: Sequence[int]) -> None:
        """Keep ``ids`` (a prompt followed by its response) as the sequence to score after the next sync."""
        ids = [int(i) for i in ids[: self.max_tokens]]
        if len(ids) >= 2:
            self.probe = ids

    def check(
        self,
        llm: Any,
        score: Callable[[list[int]], torch.Tensor],
        *,
        trainer_dtype: torch.dtype,
        plan: SyncPlan | None = None,
        trainer_tensors: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        hint: str = "",
    ) -> SyncCheck | None:
        """Compare vLLM with the trainer on the stored sequence; return the check, or None without a sequence."""
        if self.probe is None:
            return None
        start = time.perf_counter()
        ids = self.probe
        mu = engine_logprobs(llm, ids)
        with torch.no_grad():
            pi = score(ids).detach().double().cpu().reshape(-1)
        atol, rtol = sync_tolerance(self.engine_dtype, trainer_dtype)
        # -inf on both sides agrees (no probability on either; -inf - -inf is NaN); the relative part only for a
        # finite log pi, so that a -inf on one side only is never within an infinite tolerance.
        diff = torch.where(pi.isneginf() & mu.isneginf(), 0.0, (pi - mu).abs())
        allowed = atol + rtol * torch.where(pi.isfinite(), pi.abs(), 0.0)
        result = SyncCheck(
            max_diff=float(diff.max()),
            tolerance=float(allowed.max()),
            tokens=len(ids) - 1,
            seconds=time.perf_counter() - start,
        )
        if bool((diff <= allowed).all()):
            return result
        worst = int((diff - allowed).argmax())
        what = "the engine"
        if plan is not None:
            what = f"vLLM's {plan.architecture}"
        stale = stale_parameters(llm, plan, trainer_tensors) if plan is not None and trainer_tensors else None
        if stale:
            cause = f"these engine parameters hold other values than the trainer's: {stale}"
        elif stale is not None:
            cause = (
                "every engine parameter that can be compared directly holds the trainer's value, so the "
                "difference lies in a copy vLLM derives from them (a packed linear weight or LM head) or in the "
                "forward itself"
            )
        else:
            cause = "the engine's weights or its forward differ from the trainer's"
        raise WeightSyncError(
            f"sync guard: after the weight sync {what} scores the stored sequence differently from the trainer: "
            f"|log pi - log mu| = {result.max_diff:.3g} at token {worst + 1} of {result.tokens} (accepted: "
            f"{atol:g} + {rtol:g} * |log pi| for engine {self.engine_dtype} / trainer {trainer_dtype}); {cause}"
            f"{hint}. Rollouts from this engine would be sampled from stale weights"
        )


def stale_parameters(llm: Any, plan: SyncPlan, tensors: Callable[[], Mapping[str, torch.Tensor]]) -> list[str]:
    """The vLLM parameters of ``plan.comparable`` whose values differ from the trainer's (in-process engines)."""
    trainer = tensors()

    def differing(model: torch.nn.Module) -> list[str]:
        params = dict(model.named_parameters(remove_duplicate=False))
        out = []
        for target, source in plan.comparable.items():
            param, mine = params.get(target), trainer.get(source)
            if param is None or mine is None or param.numel() == 0:
                continue
            rows = mine.shape[0]
            if not torch.equal(param.data[:rows].cpu(), mine.detach().to(param.dtype).cpu()):
                out.append(target)
        return out

    try:
        return sorted({name for found in llm.apply_model(differing) for name in found})
    except Exception as err:  # a multi-process engine cannot hand its tensors over: no diagnosis then
        logger.debug("sync guard: no per-parameter diagnosis (%s)", err)
        return []


def push_and_check(
    llm: Any,
    plan: SyncPlan,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | None,
    guard: SyncGuard | None,
    model: torch.nn.Module,
    score: Callable[[list[int]], torch.Tensor],
) -> SyncCheck | None:
    """One weight sync: stream ``weights`` into ``llm`` by ``plan`` (:func:`~dppo_ext.rollout.weight_sync.
    load_weights_into_vllm`, floating tensors in ``dtype``), then, with a ``guard``, check the engine against the
    trainer's ``model`` (``score``: its log-probs of a sequence's ``ids[1:]``). Returns the check, or None when
    nothing was checked (no guard, or no sequence remembered yet); raises ``WeightSyncError`` when the sync failed
    or the engine is stale."""
    load_weights_into_vllm(llm, plan, weights, dtype)
    if guard is None:
        return None
    return guard.check(
        llm,
        score,
        trainer_dtype=next(model.parameters()).dtype,
        plan=plan,
        trainer_tensors=model.state_dict,
        hint=attention_hint(model),
    )

"""The vLLM side of the integration: the rollout top-K from TRL's generation output, and colocated-vLLM hooks.

* :func:`split_vllm_logprobs` turns TRL's per-position vLLM log-probs (``logprobs=K``) into the sampled token's
  log-prob and a fixed ``[K]`` top-K row with the sampled token forced in, by the conversion the reference
  trainer's vLLM engine uses (:func:`dppo_ext.rollout.ranked_topk_rows`); :func:`pad_topk` pads the ragged rows.
* :func:`extra_llm_kwargs` adds keyword arguments (the engine's dtype) to the ``vllm.LLM`` TRL builds.
* :class:`VLLMWeightSync` replaces TRL 1.16's colocate weight sync (which fails with vLLM 0.32 and leaves a tied LM
  head stale) by the reference trainer's rule, with the sync guard.

Nothing here imports TRL or vLLM: the functions read the objects they are given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any, Optional

import torch

from ...rollout.sync_guard import SyncCheck, SyncGuard, push_and_check
from ...rollout.vllm_outputs import ranked_topk_rows
from ...rollout.weight_sync import SyncPlan, trainer_aliases, vllm_sync_plan

logger = logging.getLogger(__name__)

__all__ = ["VLLMWeightSync", "extra_llm_kwargs", "pad_topk", "split_vllm_logprobs"]


def split_vllm_logprobs(
    completion_ids: list[list[int]],
    logprobs: list[list[list[Optional[float]]]],
    logprob_token_ids: list[list[list[int]]],
    k: int,
) -> tuple[list[list[Optional[float]]], list[list[list[int]]], list[list[list[float]]]]:
    """Split TRL's per-position vLLM log-probs (``logprobs=k``) into the sampled token's and the top-K.

    TRL hands over, per position, vLLM's candidates sorted by rank: the top-``k`` plus the sampled token when it is
    not among them. The rows go through :func:`dppo_ext.rollout.ranked_topk_rows`, the conversion the trainer's
    vLLM engine uses, so the sampled token is forced into each ``[k]`` row the same way. Returns
    ``(sampled [B][T], topk_ids [B][T][k], topk_logprobs [B][T][k])``; a log-prob vLLM could not compute (``None``)
    stays ``None`` for the sampled token and becomes ``-inf`` (no mass) in the top-K.
    """
    sampled, topk_ids, topk_logprobs = [], [], []
    for seq, seq_lps, seq_ids in zip(completion_ids, logprobs, logprob_token_ids, strict=True):
        s_sampled, s_ids, s_lps = ranked_topk_rows(seq, seq_ids, seq_lps, k)
        sampled.append(s_sampled)
        topk_ids.append(s_ids)
        topk_logprobs.append(s_lps)
    return sampled, topk_ids, topk_logprobs


def pad_topk(
    rows: list[list[list[float]]], length: int, k: int, fill: float, dtype: torch.dtype, device: Any
) -> torch.Tensor:
    """``[B, length, k]`` tensor from ragged ``[B][T_b][k]`` lists, right-padded with ``fill``."""
    out = torch.full((len(rows), length, k), fill, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out.to(device)


@contextlib.contextmanager
def extra_llm_kwargs(module: ModuleType, **extra: Any) -> Iterator[None]:
    """While the block runs, ``module.LLM(...)`` (TRL's ``trl.generation.vllm_generation``, which builds the
    colocated engine) gets ``extra`` added to its keyword arguments; ``module.LLM`` is put back afterwards."""
    if not extra:
        yield
        return
    original = module.LLM
    module.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        module.LLM = original


# vLLM's CPU backend lets this legacy variable override an engine's kv_cache_memory_bytes whenever it is set (and
# dppo_ext.rollout.VLLMEngine sets it process-wide when it starts an engine).
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


@contextlib.contextmanager
def kv_cache_env_lifted(kv_cache_memory_bytes: Optional[int]) -> Iterator[None]:
    """While the block runs, ``VLLM_CPU_KVCACHE_SPACE`` is out of ``os.environ`` when an explicit KV-cache size is
    given, so that the engine started in the block gets that size; the variable is put back afterwards."""
    held = os.environ.pop(KV_CACHE_ENV, None) if kv_cache_memory_bytes is not None else None
    if held is not None:
        logger.info(
            "dppo_vllm_kv_cache_gib (%d bytes) takes precedence over %s=%s for the colocated engine",
            kv_cache_memory_bytes,
            KV_CACHE_ENV,
            held,
        )
    try:
        yield
    finally:
        if held is not None:
            os.environ[KV_CACHE_ENV] = held


class VLLMWeightSync:
    """TRL's colocate weight sync (a ``VLLMGeneration.sync_weights`` replacement) by the reference trainer's rule.

    TRL 1.16 calls the vLLM model's ``load_weights`` directly, which vLLM 0.32 no longer supports once the weights
    are loaded (``'Parameter' object has no attribute 'weight_loader'`` on the CPU backend's float32 layers), and
    it streams ``named_parameters()``, which names a tied LM head once: vLLM's CPU backend then keeps computing
    logits from the packed copy of the head made at start-up (issue 26 measured |pi - mu| growing from 6.6e-7 to
    4.4e-2 over 12 steps). This streams TRL's own ``(name, tensor)`` pairs (``_iter_named_params``: FSDP/DeepSpeed
    gathers, PEFT merges and names included) through :func:`dppo_ext.rollout.sync_guard.push_and_check` by the plan
    :func:`~dppo_ext.rollout.weight_sync.vllm_sync_plan` makes from the engine's model (made on the first sync,
    checked before anything loads; tied heads sent under both names), which with ``sync_check`` also runs the sync
    guard on the first sequence of the latest generation and ``score`` (the trainer's log-probs). Its result is
    ``last_sync_check`` (as the reference trainer's engine names it), and every one is kept in ``checks``.
    """

    def __init__(
        self, generation: Any, model: torch.nn.Module, score: Any, *, sync_check: bool, max_model_len: int
    ) -> None:
        self.generation = generation
        self.model = model
        self.score = score
        llm = generation.llm
        self.dtype = llm.llm_engine.model_config.dtype
        self.guard = SyncGuard(self.dtype, max_model_len) if sync_check else None
        self.plan: Optional[SyncPlan] = None
        self.last_sync_check: Optional[SyncCheck] = None
        self.checks: list[SyncCheck] = []
        generate = generation.generate

        @functools.wraps(generate)
        def remembering_generate(*args: Any, **kwargs: Any) -> Any:
            out = generate(*args, **kwargs)
            prompt_ids, completion_ids = out[0], out[1]
            if self.guard is not None and prompt_ids and completion_ids:
                self.guard.remember(list(prompt_ids[0]) + list(completion_ids[0]))
            return out

        generation.generate = remembering_generate

    def _rename(self, name: str) -> str:
        return self.generation._fix_param_name_to_vllm(name.replace(".base_layer", ""))

    def _make_plan(self) -> SyncPlan:
        shapes = {name: tuple(tensor.shape) for name, tensor in self.generation._iter_named_params()}
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        aliases = {alias: source for alias, source in trainer_aliases(base, self._rename).items() if source in shapes}
        return vllm_sync_plan(self.generation.llm, list(shapes), shapes, aliases, trained=list(shapes))

    def __call__(self) -> None:
        """Push the trainer's weights into the colocated engine, then check them (``sync_check``)."""
        if self.plan is None:
            self.plan = self._make_plan()
        self.last_sync_check = None
        self.last_sync_check = push_and_check(
            self.generation.llm,
            self.plan,
            self.generation._iter_named_params(),
            self.dtype,
            self.guard,
            self.model,
            self.score,
        )
        if self.last_sync_check is not None:
            self.checks.append(self.last_sync_check)

"""The rollout side: verl's vLLM server returns the top-K log-probs of every sampled position.

verl 0.9.1's vLLM server (``vllm_async_server.vLLMHttpServer.generate``) asks vLLM for ``logprobs=0`` (the
sampled token only) and keeps one log-prob per token. With ``actor_rollout_ref.rollout.custom.dppo_topk=K`` the
plugin changes three names of that module while a request of such a server runs (a context variable carries K,
so other servers and other calls are untouched):

* ``generate`` sets the context variable from the server's rollout config;
* ``SamplingParams`` is built with ``logprobs=K`` (so the sampled token's log-prob, verl's ``rollout_log_probs``,
  comes back even when ``calculate_log_probs`` is off: the top-K modes need it as mu);
* ``extract_prompt_logprobs``, which the server calls with the finished ``RequestOutput`` and the dict that becomes
  ``TokenOutput.extra_fields``, also stores a :class:`RolloutTopK` under :data:`TOPK_FIELD`.

verl's agent loop carries ``extra_fields`` of a single-turn request into the batch's ``non_tensor_batch`` (one
object per sample), and from there into every micro-batch of the actor update, where the loss
(:mod:`dppo_ext.integrations.verl.loss`) aligns it with the response tokens. The top-K rows are vLLM's K best
candidates by rank with the sampled token forced in (:func:`dppo_ext.rollout.vllm_outputs.extract_token_logprobs`,
the same step as the reference trainer and the TRL integration), and the log-probs are vLLM's processed ones when
the rollout runs with ``logprobs_mode="processed_logprobs"`` (verl's default).

Nothing here imports verl or vLLM: the functions take the module they patch as an argument.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

import numpy as np

from dppo_ext.rollout.vllm_outputs import extract_token_logprobs

__all__ = ["TOPK_CONFIG_KEY", "TOPK_FIELD", "RolloutTopK", "patch_vllm_server", "topk_from_rollout_config"]

# actor_rollout_ref.rollout.custom.<TOPK_CONFIG_KEY> = K turns the top-K log-probs on.
TOPK_CONFIG_KEY = "dppo_topk"
# The extra_fields / non_tensor_batch key that carries one RolloutTopK per sample.
TOPK_FIELD = "dppo_topk"
# K of the request being served (0: none), set by the patched generate.
_REQUEST_TOPK: contextvars.ContextVar[int] = contextvars.ContextVar("dppo_ext_verl_topk", default=0)


@dataclass(frozen=True)
class RolloutTopK:
    """The rollout's top-K of one response, one row per generated token.

    An opaque object (not a sequence) on purpose: verl's agent loop puts every sample's extra field into a numpy
    object array, which would try to broadcast same-shaped nested lists into one array.

    Attributes:
        ids: ``[T, K]`` int32 token ids by rank, the sampled token forced in.
        logprobs: ``[T, K]`` float32 their log-probs (``-inf`` where vLLM reported none).
    """

    ids: np.ndarray
    logprobs: np.ndarray

    def __post_init__(self) -> None:
        if self.ids.ndim != 2 or self.ids.shape != self.logprobs.shape:
            raise ValueError(
                f"RolloutTopK needs ids and logprobs of one shape [T, K], got {self.ids.shape} and "
                f"{self.logprobs.shape}"
            )

    @property
    def k(self) -> int:
        return int(self.ids.shape[1])

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    @classmethod
    def from_vllm(cls, token_ids: Sequence[int], position_logprobs: Sequence[Mapping[int, Any]], k: int) -> RolloutTopK:
        """From one vLLM ``CompletionOutput`` (``.token_ids``, ``.logprobs``) generated with ``logprobs >= k``."""
        _, ids, logprobs = extract_token_logprobs(list(token_ids), position_logprobs, k)
        return cls(
            np.asarray(ids, dtype=np.int32).reshape(len(token_ids), k),
            np.asarray(logprobs, dtype=np.float32).reshape(len(token_ids), k),
        )


def topk_from_rollout_config(config: Any) -> int:
    """K from a verl rollout config (``custom.dppo_topk``), 0 when it is not set.

    Raises ``ValueError`` for a value that is not an int >= 1.
    """
    custom = getattr(config, "custom", None) if not isinstance(config, Mapping) else config.get("custom")
    if not custom:
        return 0
    k = custom.get(TOPK_CONFIG_KEY) if hasattr(custom, "get") else None
    if k is None:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(
            f"actor_rollout_ref.rollout.custom.{TOPK_CONFIG_KEY} must be an int >= 1 (the K of the top-K DPPO modes), "
            f"got {k!r}"
        )
    return k


def patch_vllm_server(module: ModuleType) -> None:
    """Install the three changes above into verl's ``vllm_async_server`` module (idempotent)."""
    server = module.vLLMHttpServer
    if getattr(server.generate, "__dppo_ext__", False):
        return
    make_params = module.SamplingParams
    extract = module.extract_prompt_logprobs
    generate = server.generate

    @functools.wraps(generate)
    async def generate_with_topk(self, *args: Any, **kwargs: Any) -> Any:
        token = _REQUEST_TOPK.set(topk_from_rollout_config(self.config))
        try:
            return await generate(self, *args, **kwargs)
        finally:
            _REQUEST_TOPK.reset(token)

    def sampling_params(*args: Any, **kwargs: Any) -> Any:
        k = _REQUEST_TOPK.get()
        if k:
            kwargs["logprobs"] = max(k, kwargs.get("logprobs") or 0)
        return make_params(*args, **kwargs)

    @functools.wraps(extract)
    def extract_with_topk(output: Any, num_prompt_logprobs: Optional[int], result_dict: dict) -> Any:
        result = extract(output=output, num_prompt_logprobs=num_prompt_logprobs, result_dict=result_dict)
        k = _REQUEST_TOPK.get()
        if k and output.outputs:
            completion = output.outputs[0]
            result_dict[TOPK_FIELD] = RolloutTopK.from_vllm(completion.token_ids, completion.logprobs, k)
        return result

    for fn in (generate_with_topk, sampling_params, extract_with_topk):
        fn.__dppo_ext__ = True
    server.generate = generate_with_topk
    module.SamplingParams = sampling_params
    module.extract_prompt_logprobs = extract_with_topk

"""Rollout-engine interface shared by the vLLM and transformers engines.

A rollout engine turns token prompts into sampled responses together with the
log-probabilities the trainer needs for DPPO:

* ``logprobs[t]`` is log mu(y_t | prefix) of the sampled token under the SAME
  temperature-processed distribution the trainer scores,
  i.e. ``log_softmax(logits / temperature)``.
* with ``logit_noise = sigma > 0`` the engine samples from, and reports, ``mu = softmax((z +
  sigma * eps) / T)`` instead (``dppo_ext.rollout.noise``: a training-inference mismatch of a
  chosen size).
* with a :class:`Truncation` (top-k / top-p / min-p sampling) the engine samples from the truncated,
  renormalised distribution, reports its log-probs, and returns each position's kept set as ``kept_ids[t]``
  (the loss's sampling replay; vLLM only).
* ``topk_ids[t]`` / ``topk_logprobs[t]`` are the K highest-ranked tokens of that
  distribution, ordered by rank (highest log-prob first), with the sampled token
  forced in (it replaces the lowest-ranked entry when the engine did not rank it
  within the top K, so every row keeps exactly K entries; see
  :func:`force_sampled_into_topk`).

Engines are created with :func:`dppo_ext.rollout.factory.make_engine`; ``"auto"`` picks vLLM
when it is importable and falls back to transformers ``generate`` otherwise. The factory lives in
its own module because it imports both engines, which import this one.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from dppo_ext.contract import sampling_truncation
from dppo_ext.rollout.noise import check_logit_noise
from dppo_ext.rollout.sync_guard import SyncCheck


@dataclass
class RolloutSample:
    """One sampled response for one prompt.

    Attributes:
        prompt_ids: prompt token ids, length P.
        response_ids: generated token ids, length T (EOS included when it was generated).
        logprobs: [T] rollout log-prob of each sampled token under
            ``log_softmax(logits / temperature)``.
        topk_ids: [T][K] top-K token ids by rank with the sampled token forced in,
            or None when ``top_k == 0``.
        topk_logprobs: [T][K] log-probs matching ``topk_ids``, or None.
        text: decoded response (special tokens skipped).
        finish_reason: ``"stop"`` (EOS / stop token) or ``"length"`` (hit max_tokens).
        kept_ids: [T][S_t] under truncated sampling, the token ids the truncation kept at each position (by
            rank), or None (untruncated sampling).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    topk_ids: list[list[int]] | None
    topk_logprobs: list[list[float]] | None
    text: str
    finish_reason: str
    kept_ids: list[list[int]] | None = None


def force_sampled_into_topk(
    topk_ids: list[int],
    topk_logprobs: list[float],
    sampled_id: int,
    sampled_logprob: float,
) -> tuple[list[int], list[float]]:
    """Make sure the sampled token is a member of the top-K set, keeping K fixed.

    Follows the convention of Stable-RL's vLLM/SGLang rollouts: candidates are
    ordered by rank; when the sampled token is not among them, it replaces the
    lowest-ranked (last) entry.

    Args:
        topk_ids: [K] candidate ids ordered by rank (highest log-prob first), K >= 1.
        topk_logprobs: [K] their log-probs.
        sampled_id: the token that was actually sampled.
        sampled_logprob: its log-prob under the same distribution.

    Returns:
        (ids, logprobs), both of length K (new lists; inputs are not modified).
    """
    if len(topk_ids) != len(topk_logprobs):
        raise ValueError(
            f"topk_ids and topk_logprobs must have the same length, got {len(topk_ids)} and {len(topk_logprobs)}"
        )
    if not topk_ids:
        raise ValueError("topk_ids must hold at least one candidate (K >= 1), got an empty list")
    ids = list(topk_ids)
    lps = list(topk_logprobs)
    if sampled_id not in ids:
        ids[-1] = sampled_id
        lps[-1] = sampled_logprob
    return ids, lps


@dataclass(frozen=True)
class Truncation:
    """Truncated sampling, by vLLM's ``SamplingParams`` names: ``top_k`` (-1 or 0: off), ``top_p`` (1: off),
    ``min_p`` (0: off), and ``logprobs``, the log-probs returned per position so that each kept set comes back whole
    (:func:`dppo_ext.rollout.kept_sets` raises, naming the position, where it may not)."""

    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    logprobs: int = 20

    def __post_init__(self) -> None:
        sampling_truncation(self.top_k, self.top_p, self.min_p)  # the ranges, each named
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 1:
            raise ValueError(f"Truncation.logprobs must be an int >= 1, got {self.logprobs!r}")

    @property
    def truncates(self) -> bool:
        """Whether these settings truncate the distribution at all."""
        return bool(sampling_truncation(self.top_k, self.top_p, self.min_p))


def check_generate_args(
    prompts: list[list[int]],
    n: int,
    temperature: float,
    max_tokens: int,
    top_k: int,
    *,
    logit_noise: float = 0.0,
    seed: int | None = None,
) -> None:
    """Validate the arguments shared by every engine's ``generate``; raise ValueError."""
    if not isinstance(prompts, list) or not all(isinstance(p, list) and p for p in prompts):
        raise ValueError("prompts must be a list of non-empty token-id lists")
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0 for sampled rollouts, got {temperature}; "
            "the trainer scores log_softmax(logits / temperature)"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if top_k < 0:
        raise ValueError(f"top_k (number of rollout top-K log-probs) must be >= 0, got {top_k}")
    check_logit_noise(logit_noise, seed)


class RolloutEngine(abc.ABC):
    """Samples responses and reports rollout log-probs; accepts trainer weights."""

    name: str
    # What the sync guard measured after the latest sync_weights (engines with a guard), else None.
    last_sync_check: SyncCheck | None = None

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        top_k: int = 0,
        seed: int | None = None,
        logit_noise: float = 0.0,
        truncation: Truncation | None = None,
    ) -> list[list[RolloutSample]]:
        """Sample ``n`` responses per prompt.

        Args:
            prompts: token-id lists, one per prompt.
            n: samples per prompt (the GRPO group size).
            temperature: sampling temperature (> 0); log-probs are of
                ``log_softmax(logits / temperature)``.
            max_tokens: maximum generated tokens per response.
            top_k: number of rollout top-K log-probs per token (0 = none).
            seed: seed for this call; the same seed and weights give the same samples.
            logit_noise: sigma of the Gaussian noise added to the logits before the temperature
                (``dppo_ext.rollout.noise``; needs ``seed``); the samples and their log-probs are of
                ``softmax((z + sigma * eps) / T)``. 0 = none.
            truncation: top-k / top-p / min-p sampling; every sample then carries its ``kept_ids``. Engines that
                cannot return the kept sets raise ``ValueError``. None: the whole distribution.

        Returns:
            ``[len(prompts)][n]`` samples.
        """

    @abc.abstractmethod
    def sync_weights(self, model: torch.nn.Module) -> float:
        """Push the trainer model's weights into the engine; return wall seconds.

        ``model`` is a transformers causal LM with the same architecture and
        HF checkpoint parameter names as the engine's model.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine's resources."""

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The vLLM logits processor that adds the rollout logit noise (``dppo_ext.rollout.noise``).

vLLM's sampler runs processors that are not argmax-invariant on the float32 logits before it
divides by the temperature, then samples from, and with ``logprobs_mode="processed_logprobs"``
reports the log-probs of, that same tensor: a token is drawn from
``softmax((z + sigma * eps) / T)`` and that is the ``mu`` the trainer receives.

A request asks for noise with ``SamplingParams(seed=s, extra_args={NOISE_ARG: sigma})``; with
``n > 1`` vLLM gives child ``j`` the seed ``s + j``. The processor keeps, per batch slot, the
request's sigma, seed and a reference to its growing output-token list (whose length is the
position of the token being sampled). Requests without the argument are left untouched, so one
engine serves noisy rollouts and clean evaluations side by side.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from dppo_ext.rollout.noise import add_logit_noise, check_logit_noise

NOISE_ARG = "dppo_logit_noise"
NoiseState = tuple[float, int, list[int]]  # sigma, the request's seed, its output tokens (their count: the position)


def _noise_state(params: SamplingParams, _prompt: Any, output_tok_ids: list[int]) -> NoiseState | None:
    """A request's (sigma, seed, output tokens), or None when it asks for no noise."""
    sigma = (params.extra_args or {}).get(NOISE_ARG, 0.0)
    if not sigma:
        return None
    return float(sigma), int(params.seed), output_tok_ids


class LogitNoiseProcessor(LogitsProcessor):
    """Adds ``sigma * eps(seed, position)`` to the logits of every request that asks for it."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        sigma = (sampling_params.extra_args or {}).get(NOISE_ARG, 0.0)
        check_logit_noise(sigma, sampling_params.seed)

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.requests: dict[int, NoiseState] = {}

    def is_argmax_invariant(self) -> bool:
        """Noise changes the argmax: vLLM then applies it before the temperature, on every request."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.requests, batch_update, _noise_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.requests:
            return logits
        rows = [(row, seed, len(output), sigma) for row, (sigma, seed, output) in self.requests.items()]
        return add_logit_noise(logits, rows)

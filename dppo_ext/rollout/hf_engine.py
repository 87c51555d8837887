"""transformers ``generate`` rollout engine: the fallback when vLLM is not installed.

It samples from ``softmax(logits / temperature)`` with no other logits processing (top-k / top-p
sampling filters off, no repetition penalty), and reads each step's processed scores
(``output_scores``: the logits after the temperature warper) to report
``log_softmax(logits / temperature)`` of the sampled token and its top-K, the same fields as the
vLLM engine. With ``logit_noise = sigma`` a logits processor adds the noise of
``dppo_ext.rollout.noise`` to the logits first (``generate`` runs custom processors before its
temperature warper), so the samples and the reported log-probs are of
``softmax((z + sigma * eps) / T)``. It keeps its own copy of the model in a configurable rollout dtype, so e.g. bf16
rollouts for an fp32 trainer give a real training-inference mismatch.
"""

from __future__ import annotations

import logging
import time

import torch

from dppo_ext.contract import MODEL_DTYPES
from dppo_ext.rollout.base import (
    RolloutEngine,
    RolloutSample,
    Truncation,
    check_generate_args,
    force_sampled_into_topk,
)
from dppo_ext.rollout.noise import add_logit_noise
from dppo_ext.rollout.vllm_parity import policy_load_kwargs

logger = logging.getLogger(__name__)


def topk_with_sampled(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[list[list[int]], list[list[float]]]:
    """Top-K of each row of ``logprobs`` with the sampled token forced in.

    Args:
        logprobs: [T, V] log-probs of each step's distribution.
        sampled: [T] sampled token ids.
        k: K >= 1.

    Returns:
        ``(ids [T][K], logprobs [T][K])``, rows ordered by rank, the sampled token replacing the
        last entry when it is not among the K best.
    """
    values, indices = logprobs.topk(k, dim=-1)
    picked = logprobs.gather(-1, sampled[:, None])[:, 0]
    ids_out, lps_out = [], []
    for row_ids, row_lps, tok, tok_lp in zip(indices.tolist(), values.tolist(), sampled.tolist(), picked.tolist()):
        ids, lps = force_sampled_into_topk(row_ids, row_lps, tok, tok_lp)
        ids_out.append(ids)
        lps_out.append(lps)
    return ids_out, lps_out


class _LogitNoise:
    """transformers logits processor: row ``r`` of the ``[B * n, V]`` scores (sample ``r % n`` of prompt
    ``r // n``) gets the noise of sample seed ``seed + r`` at the current response position."""

    def __init__(self, seed: int, sigma: float, prompt_len: int) -> None:
        self.seed, self.sigma, self.prompt_len = seed, sigma, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_len
        return add_logit_noise(scores, [(row, self.seed + row, position, self.sigma) for row in range(scores.shape[0])])


class HFEngine(RolloutEngine):
    """Rollouts with ``transformers`` ``generate`` on a private copy of the model.

    Args:
        model_path: Hugging Face model folder or hub id (weights + tokenizer).
        dtype: rollout dtype, ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: base seed; a call without ``seed`` uses ``seed + number of earlier calls``, so a
            run is repeatable.
        max_model_len: longest prompt + response in tokens.
        device: torch device for the rollout model (default: CUDA when available, else CPU).
    """

    name = "hf"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 256,
        device: str | torch.device | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {tuple(MODEL_DTYPES)}, got {dtype!r}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = MODEL_DTYPES[dtype]
        self.seed = seed
        self.max_model_len = max_model_len
        self._calls = 0
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, **policy_load_kwargs(model_path)
        )
        self.model.to(self.device).eval()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError(f"model {model_path!r} defines no eos_token_id (generation config or tokenizer)")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)

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
        """See :meth:`RolloutEngine.generate`. Prompts are left-padded into one batch. Samples from the whole
        distribution only: a truncating ``truncation`` raises ``ValueError`` (the vLLM engine replays it)."""
        from transformers import GenerationConfig, LogitsProcessorList

        check_generate_args(prompts, n, temperature, max_tokens, top_k, logit_noise=logit_noise, seed=seed)
        if truncation is not None and truncation.truncates:
            raise ValueError(
                f"the transformers engine samples from the whole distribution and cannot return kept sets, got "
                f"{truncation}; use the vLLM engine for truncated sampling"
            )
        vocab = self.model.config.vocab_size
        if top_k > vocab:
            raise ValueError(f"top_k={top_k} exceeds the vocabulary size {vocab}")
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise ValueError(
                f"a prompt has {longest} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        if seed is None:
            seed = self.seed + self._calls
        self._calls += 1
        # Per-prompt budget: a shorter prompt may generate up to max_model_len - len(prompt).
        budgets = [min(max_tokens, self.max_model_len - len(p)) for p in prompts]
        input_ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, longest - len(prompt) :] = 1
        config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            repetition_penalty=1.0,
            max_new_tokens=max(budgets),
            num_return_sequences=n,
            eos_token_id=sorted(self.eos_ids),
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
                logits_processor=LogitsProcessorList([_LogitNoise(seed, logit_noise, longest)] if logit_noise else []),
            )
        new_tokens = out.sequences[:, longest:].cpu()  # [B*n, S]
        # scores[s]: [B*n, V] logits after the temperature warper at step s.
        logprobs = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1).cpu()  # [B*n, S, V]
        results: list[list[RolloutSample]] = []
        for i, prompt in enumerate(prompts):
            group = []
            for j in range(n):
                row = i * n + j
                tokens = new_tokens[row, : budgets[i]].tolist()
                length = next((t + 1 for t, tok in enumerate(tokens) if tok in self.eos_ids), None)
                finish = "stop" if length is not None else "length"
                length = length if length is not None else len(tokens)
                response = tokens[:length]
                sampled = torch.tensor(response, dtype=torch.long)
                row_lps = logprobs[row, :length]  # [T, V]
                token_lps = row_lps.gather(-1, sampled[:, None])[:, 0].tolist()
                topk_ids = topk_lps = None
                if top_k > 0:
                    topk_ids, topk_lps = topk_with_sampled(row_lps, sampled, top_k)
                group.append(
                    RolloutSample(
                        prompt_ids=list(prompt),
                        response_ids=response,
                        logprobs=token_lps,
                        topk_ids=topk_ids,
                        topk_logprobs=topk_lps,
                        text=self.tokenizer.decode(response, skip_special_tokens=True),
                        finish_reason=finish,
                    )
                )
            results.append(group)
        return results

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> float:
        """Copy ``model.state_dict()`` into the engine's copy (cast to its dtype); return seconds."""
        start = time.perf_counter()
        while hasattr(model, "_orig_mod"):
            model = model._orig_mod
        self.model.load_state_dict(model.state_dict())
        return time.perf_counter() - start

    def close(self) -> None:
        """Drop the engine's model copy."""
        self.model = None

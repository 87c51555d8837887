"""vLLM rollout engine: an in-process ``vllm.LLM`` whose weights follow the trainer.

Log-probs: the engine is created with ``logprobs_mode="processed_logprobs"`` (an ``LLM``
keyword, stored in vLLM's ``ModelConfig``), so every reported log-prob is of
``log_softmax(logits / temperature)`` -- the distribution the trainer scores -- rather than of
the raw logits. ``SamplingParams(logprobs=K)`` makes vLLM return, per generated token, the K
highest-ranked tokens plus the sampled one;
:func:`dppo_ext.rollout.vllm_outputs.rollout_samples_from_vllm` (the helper the TRL integration
shares) turns that into the sampled token's log-prob and a fixed-size [K] top-K row with the
sampled token forced in.

Logit noise (``generate(..., logit_noise=sigma)``, ``dppo_ext.rollout.noise``): the engine is created
with :class:`dppo_ext.rollout.vllm_noise.LogitNoiseProcessor`, which adds ``sigma * eps`` to the logits
of the requests that ask for it before vLLM's temperature scaling, so the token is sampled from, and
its processed log-prob reports, ``mu = softmax((z + sigma * eps) / T)``.

Weight sync: ``LLM.collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
"is_checkpoint_format": True})`` streams (HF checkpoint name, tensor) pairs of ``model.state_dict()`` through the
model's own ``load_weights`` (vLLM's in-place reload path), then the prefix cache is reset so no KV block computed
with the old weights is reused. What is sent under which name (tied heads, stacked shards, renamed modules) is
decided once from the loaded vLLM model and checked before anything is loaded
(:mod:`dppo_ext.rollout.weight_sync`, shared with the TRL integration). After every sync the sync guard
(``sync_check=True``, the default; :mod:`dppo_ext.rollout.sync_guard`) scores the first sequence of the latest
rollout in vLLM and with the trainer's model and raises :class:`~dppo_ext.rollout.weight_sync.WeightSyncError` when
they differ by more than the dtypes explain; :attr:`VLLMEngine.last_sync_check` holds what it measured. vLLM's
per-sync ``Failed to load weights`` warnings for layers that hold only buffers are filtered
(``dppo_ext.rollout.vllm_logging``).

The engine starts inside :func:`dppo_ext.rollout.vllm_parity.engine_private_model_classes`, so that vLLM's
Transformers backend (OLMo2 and other architectures vLLM has no implementation of) leaves the process's
transformers classes as they are and a trainer model can be created before or after the engine.

In-process use: the engine sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the weight iterator is
passed by reference, not pickled) and, when unset, ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache
on the CPU backend). Scripts that create it should still keep their entry point under
``if __name__ == "__main__":`` because vLLM may start helper processes.

Side effects of vLLM's CPU worker on the calling process, undone here: it lowers torch's
intra-op threads to 1 and replaces ``torch.set_num_threads`` with a no-op; the engine restores
both after start-up so the trainer in the same process keeps its threads. vLLM also reseeds
torch's global RNG with the engine seed while starting: seed the trainer after creating the
engine.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from dppo_ext.contract import MODEL_DTYPES
from dppo_ext.rollout.base import RolloutEngine, RolloutSample, Truncation, check_generate_args
from dppo_ext.rollout.sync_guard import SyncCheck, SyncGuard, model_logprobs, push_and_check
from dppo_ext.rollout.vllm_outputs import rollout_samples_from_vllm
from dppo_ext.rollout.vllm_parity import engine_private_model_classes
from dppo_ext.rollout.weight_sync import SyncPlan, trainer_aliases, vllm_sync_plan

logger = logging.getLogger(__name__)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip torch.compile / DistributedDataParallel wrappers so names are checkpoint names."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


def _checkpoint_weights(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF checkpoint name, detached tensor) pairs of ``model.state_dict()``, floating tensors in ``dtype``.

    An engine in a narrower dtype than the trainer (bf16 rollouts of an fp32 model) would round each
    weight on load anyway (``copy_``, round to nearest even, as ``Tensor.to``), but it warns "Attempted
    to load weight ... with dtype torch.float32 into parameter with dtype torch.bfloat16" for every
    directly loaded tensor on every sync; rounding here gives the same weights without the warnings.
    """
    for name, tensor in _unwrap(model).state_dict().items():
        tensor = tensor.detach()
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


class VLLMEngine(RolloutEngine):
    """Rollouts from an in-process ``vllm.LLM`` with processed (temperature-scaled) log-probs.

    Args:
        model_path: Hugging Face model folder or hub id (weights + tokenizer).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        seed: engine seed (vLLM's default sampling RNG).
        max_model_len: longest prompt + response; clamped to the model's
            ``max_position_embeddings`` when that is smaller.
        max_logprobs: largest ``top_k`` that ``generate`` accepts (vLLM's ``max_logprobs``).
        enforce_eager: skip graph compilation; None = True on CPU, False on CUDA.
        gpu_memory_utilization: fraction of GPU memory vLLM may take (CUDA only; leave room for
            the trainer in the same process).
        sync_check: after every ``sync_weights``, check that vLLM's log-probs of the first sequence of the
            latest rollout equal the model's (:class:`~dppo_ext.rollout.sync_guard.SyncGuard`).
        **llm_kwargs: extra keyword arguments for ``vllm.LLM``.
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int = 256,
        max_logprobs: int = 20,
        enforce_eager: bool | None = None,
        gpu_memory_utilization: float = 0.4,
        sync_check: bool = True,
        **llm_kwargs: Any,
    ) -> None:
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {tuple(MODEL_DTYPES)}, got {dtype!r}")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            logger.warning(
                "overriding VLLM_ENABLE_V1_MULTIPROCESSING=%s with 0: the rollout engine must run "
                "in-process for weight sync",
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"],
            )
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from transformers import AutoConfig
        from vllm import LLM

        from dppo_ext.rollout.vllm_noise import LogitNoiseProcessor

        hf_config = AutoConfig.from_pretrained(model_path)
        positions = getattr(hf_config, "max_position_embeddings", None)
        if positions is not None and max_model_len > positions:
            logger.info(
                "max_model_len %d exceeds the model's max_position_embeddings %d; using %d",
                max_model_len,
                positions,
                positions,
            )
            max_model_len = positions
        on_cuda = torch.cuda.is_available()
        if enforce_eager is None:
            enforce_eager = not on_cuda
        if on_cuda:
            llm_kwargs.setdefault("gpu_memory_utilization", gpu_memory_utilization)
        self.model_path = model_path
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.vocab_size = int(hf_config.vocab_size)
        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        start = time.perf_counter()
        with engine_private_model_classes(hf_config):
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                max_logprobs=max_logprobs,
                logprobs_mode="processed_logprobs",
                logits_processors=[LogitNoiseProcessor],
                enforce_eager=enforce_eager,
                **llm_kwargs,
            )
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        logger.info("vLLM engine for %s (%s) started in %.1f s", model_path, dtype, time.perf_counter() - start)
        self.guard = SyncGuard(getattr(torch, dtype), max_model_len) if sync_check else None
        self.last_sync_check: SyncCheck | None = None
        self._plans: dict[tuple[tuple[str, tuple[int, ...]], ...], SyncPlan] = {}  # by the model's names and shapes

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
        """See :meth:`RolloutEngine.generate`. With a seed, prompt i samples with seeds
        ``seed + i * n + j`` for j < n, so equal prompts still get distinct samples. A truncating ``truncation``
        asks for ``max(top_k, truncation.logprobs)`` log-probs per position and returns each kept set."""
        from vllm import SamplingParams

        from dppo_ext.rollout.vllm_noise import NOISE_ARG

        check_generate_args(prompts, n, temperature, max_tokens, top_k, logit_noise=logit_noise, seed=seed)
        if top_k > min(self.max_logprobs, self.vocab_size):
            raise ValueError(
                f"top_k={top_k} exceeds this engine's limit min(max_logprobs={self.max_logprobs}, "
                f"vocab_size={self.vocab_size}); create the engine with a larger max_logprobs"
            )
        truncation = truncation if truncation is not None and truncation.truncates else None
        logprobs = max(top_k, 1, min(truncation.logprobs, self.vocab_size) if truncation is not None else 0)
        if logprobs > self.max_logprobs:
            raise ValueError(
                f"truncation.logprobs={logprobs} exceeds this engine's max_logprobs={self.max_logprobs}; create the "
                "engine with a larger max_logprobs"
            )
        sampling = {}  # only the truncating settings: vLLM's defaults stand for the rest
        if truncation is not None:
            on = {"top_k": truncation.top_k > 0, "top_p": truncation.top_p < 1, "min_p": truncation.min_p > 0}
            sampling = {name: getattr(truncation, name) for name, used in on.items() if used}
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                logprobs=logprobs,
                **sampling,
                seed=None if seed is None else seed + i * n,
                extra_args={NOISE_ARG: float(logit_noise)} if logit_noise else None,
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        if self.guard is not None and outputs and outputs[0].outputs:
            self.guard.remember(list(outputs[0].prompt_token_ids) + list(outputs[0].outputs[0].token_ids))
        return rollout_samples_from_vllm(
            outputs, top_k, sampling_params=params[0] if truncation else None, vocab_size=self.vocab_size
        )

    def sync_plan(self, model: torch.nn.Module) -> SyncPlan:
        """What a sync of ``model`` sends (decided from the engine's model on first use; raises
        :class:`~dppo_ext.rollout.weight_sync.WeightSyncError` when ``model`` does not fit the engine)."""
        model = _unwrap(model)
        state = model.state_dict()
        key = tuple((name, tuple(t.shape)) for name, t in state.items())
        if key not in self._plans:
            self._plans[key] = vllm_sync_plan(
                self.llm,
                list(state),
                {name: tuple(t.shape) for name, t in state.items()},
                aliases={alias: source for alias, source in trainer_aliases(model).items() if alias in state},
                trained=[name for name, _ in model.named_parameters(remove_duplicate=False)],
            )
        return self._plans[key]

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> float:
        """Reload the engine's weights in place from ``model.state_dict()``, then (``sync_check``) check them on
        the latest rollout's first sequence; return seconds (the check included, see ``last_sync_check``)."""
        start = time.perf_counter()
        plan = self.sync_plan(model)
        self.last_sync_check = None
        trainer = _unwrap(model)
        self.last_sync_check = push_and_check(
            self.llm,
            plan,
            _checkpoint_weights(model, getattr(torch, self.dtype)),
            None,
            self.guard,
            trainer,
            functools.partial(model_logprobs, trainer),
        )
        return time.perf_counter() - start

    def close(self) -> None:
        """Drop the engine (in-process: freeing the ``LLM`` object releases its memory)."""
        self.llm = None

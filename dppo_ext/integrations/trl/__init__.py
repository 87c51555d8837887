"""DPPO as the policy loss of TRL's GRPO trainer: ``DPPOGRPOConfig`` + ``DPPOGRPOTrainer``.

    from dppo_ext.integrations.trl import DPPOGRPOConfig, DPPOGRPOTrainer
    args = DPPOGRPOConfig(output_dir="out", dppo_mode="binary_tv", use_vllm=True, ...)
    trainer = DPPOGRPOTrainer(model="Qwen/Qwen3-0.6B", reward_funcs=reward_fn, args=args, train_dataset=ds)
    trainer.train()

What changes against ``trl.GRPOTrainer`` (everything else, generation, rewards, advantages, logging, is TRL's):

* The policy loss is DPPO (docs/contract.md) computed by our fused op. By default through
  :func:`dppo_ext.fused_linear_dppo_loss_per_row` from the last hidden states and the LM-head weight, so no
  ``[B, T, V]`` logits tensor exists (``dppo_fused_linear=False``: the LM head runs as usual and the logits op
  is applied to the logits). The loss runs inside the model's ``forward`` (a wrapper installed on the model), so
  DDP, FSDP and DeepSpeed see an ordinary forward/backward.
* The rollout log-probs ``mu`` are the ones vLLM returned for the sampled tokens (``sampling_per_token_logps``)
  when ``use_vllm=True``. Without vLLM there are none: the trainer then uses the old-policy log-probs recomputed
  by the trainer model (computing them when TRL would skip them), i.e. the paper's "recompute" variant, and logs
  that once (and ``dppo/recompute_variant = 1`` in the metrics). TRL's own vLLM importance-sampling correction is
  not applied on top (DPPO's weight ``min(pi / mu, C)`` already corrects against ``mu``).
* The DPPO settings are config fields (``dppo_*``); our metrics are logged as ``dppo/<name>`` through TRL's
  logger, with ``entropy`` and ``policy_loss`` as TRL names them.
* Top-K modes (``topk_tv``/``topk_kl``, ``dppo_topk=K``) ask vLLM for the top-K log-probs of every sampled
  position (TRL itself asks for the sampled token's only) and keep them next to the completions, with the sampled
  token forced into each row exactly as the reference trainer does (:func:`dppo_ext.rollout.ranked_topk_rows`).
* Colocated vLLM (``vllm_mode="colocate"``): the weights are pushed after each optimizer step through vLLM's
  in-place ``reload_weights`` (TRL 1.16's own push fails with vLLM 0.32), and ``dppo_vllm_dtype`` sets the
  engine's dtype (vLLM runs a float32 checkpoint in bfloat16 unless told otherwise).

Without vLLM the anchor is the current policy (see above), so on the first pass over a generation batch
``pi == mu`` and DPPO masks nothing; masking starts with ``num_iterations > 1`` or ``steps_per_generation > 1``.
The full walk-through is docs/trl.md; a runnable script is examples/trl_dppo_grpo.py.

Supported: text models, ``beta`` (KL to the reference model, TRL's k3 estimator on our log-probs), tools /
environment masks (not with the top-K modes), gradient accumulation, ``num_iterations``. Rejected with a clear
error: top-K modes without vLLM (there is no sampler top-K to compare with), the entropy bonus,
``top_entropy_quantile < 1`` (a TRL loss variant of its own), ``off_policy_mask_threshold`` (with the
``dppo_sequence_mask`` that gives the same mask), multimodal inputs.

One job per module: ``versions`` (the TRL/vLLM releases, checked before TRL is imported), ``config``
(``DPPOGRPOConfig``), ``head`` (the model's DPPO forward), ``generation`` (the vLLM hooks), ``trainer``
(``DPPOGRPOTrainer``: the loss and its logging). Importing this package imports none of TRL, transformers or vLLM
and changes nothing in the process; each name below loads its module, and what that module needs, on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .versions import SUPPORTED_TRL, TESTED_TRL, TESTED_VLLM, check_trl_version  # noqa: F401  (re-exported)

# The names that need TRL: public name -> the submodule that defines it, imported on first use (``__getattr__``).
# Type checkers read the same names from the ``if TYPE_CHECKING:`` block below;
# python_tests/repo/test_public_api.py checks that the two agree.
_LAZY = {
    "VLLM_DTYPES": "config",
    "DPPOGRPOConfig": "config",
    "split_vllm_logprobs": "generation",
    "DPPOForwardOutput": "head",
    "add_dppo_head": "head",
    "DPPOGRPOTrainer": "trainer",
}
if TYPE_CHECKING:
    from .config import VLLM_DTYPES, DPPOGRPOConfig  # noqa: F401
    from .generation import split_vllm_logprobs  # noqa: F401
    from .head import DPPOForwardOutput, add_dppo_head  # noqa: F401
    from .trainer import DPPOGRPOTrainer  # noqa: F401

__all__ = sorted(["SUPPORTED_TRL", "TESTED_TRL", "TESTED_VLLM", "check_trl_version", *_LAZY])


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

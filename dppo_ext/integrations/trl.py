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
* The DPPO settings are config fields (``dppo_*``, below); our metrics are logged as ``dppo/<name>`` through
  TRL's logger, with ``entropy`` and ``policy_loss`` as TRL names them.

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
``top_entropy_quantile < 1`` and ``off_policy_mask_threshold`` (TRL loss variants of their own), multimodal
inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import re
import types
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..contract import DEFAULT_DELTAS, MODE_ALIASES, MODES, TOPK_MODES, canonical_mode, check_settings, resolve_deltas
from ..fused_linear import fused_linear_dppo_loss_per_row
from ..loss import AGG_MODES, IGNORE_INDEX, NORM_AGG_MODES, aggregate_loss, dppo_metrics
from ..ops import DPPOOutputs, dppo_loss_forward
from ..rollout.vllm_logging import install_benign_warning_filters
from ..rollout.vllm_outputs import ranked_topk_rows

logger = logging.getLogger(__name__)

# TRL releases this integration is written and tested against (it overrides GRPOTrainer internals).
SUPPORTED_TRL = SpecifierSet(">=1.16.0,<1.17.0")
TESTED_TRL = "1.16.0"
# Config fields with which a model's forward rescales or soft-caps the LM head's output (as TRL lists them).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                     "logits_scaling")
# TRL's loss_type -> our loss_agg_mode, for the loss types that are an aggregation (docs/aggregation.md).
_TRL_DEFAULT_LOSS_TYPE = "dapo"
_TRL_LOSS_TYPE_AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
# Metrics aggregated across processes by max instead of mean.
_MAX_METRICS = ("mismatch_max", "ratio_max")
# GRPOConfig fields of TRL's own policy losses that the DPPO loss does not read (loss_type is mapped to an
# aggregation and the ratio clips epsilon / epsilon_high / delta are refused, see _check_trl_loss_fields); setting
# one to a non-default value gets a warning. (vllm_importance_sampling_correction is not listed: both of its values
# give the same DPPO loss, whose weight min(pi / mu, C) already corrects against mu.)
_IGNORED_TRL_LOSS_FIELDS = (
    "importance_sampling_level", "sapo_temperature_neg", "sapo_temperature_pos", "vespo_k_pos", "vespo_lambda_pos",
    "vespo_k_neg", "vespo_lambda_neg", "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
)


def check_trl_version(version: str) -> None:
    """Raise ``ImportError`` unless ``version`` (a TRL version string) is in ``SUPPORTED_TRL``."""
    if Version(version) not in SUPPORTED_TRL:
        raise ImportError(
            f"dppo_ext.integrations.trl supports trl{SUPPORTED_TRL} (tested with {TESTED_TRL}) because it overrides "
            f"GRPOTrainer internals, but trl {version} is installed. Install a supported release: "
            f"pip install 'trl=={TESTED_TRL}'"
        )


# The vLLM release this integration is tested with (requirements/cpu.txt). TRL 1.16 warns, each time it checks for
# vLLM (five times while importing, again per trainer), that it supports vLLM 0.22-0.31 only; with this release
# its generation path works and its colocate weight sync is replaced by ours (_reload_weights_into_vllm), so that
# warning is dropped for this exact version. Any other unsupported version still warns.
TESTED_VLLM = "0.32.0"
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")
warnings.filterwarnings(
    "ignore",
    message=rf"TRL currently supports vLLM versions from 0\.22\.0 to 0\.31\.0\. You have version {re.escape(TESTED_VLLM)} ",
    category=UserWarning,
)

try:
    import trl
except ImportError as exc:  # pragma: no cover - exercised only without trl
    raise ImportError(
        f"dppo_ext.integrations.trl needs TRL: pip install 'trl=={TESTED_TRL}' accelerate"
    ) from exc
check_trl_version(trl.__version__)

from torch.distributed.tensor import DTensor  # noqa: E402
from transformers.utils import ModelOutput  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.extras.profiling import profiling_context  # noqa: E402
from trl.generation import vllm_generation as trl_vllm_generation  # noqa: E402
from trl.trainer.utils import maybe_gather_lm_head_ctx  # noqa: E402

__all__ = [
    "DPPOGRPOConfig", "DPPOGRPOTrainer", "SUPPORTED_TRL", "add_dppo_head", "check_trl_version", "split_vllm_logprobs",
]


@dataclass
class DPPOGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the DPPO settings.

    TRL's own loss fields: ``loss_type`` picks the aggregation when ``dppo_loss_agg_mode`` is not given
    (``dapo`` -> ``token-mean``, ``grpo`` -> ``seq-mean-token-mean``, ``dr_grpo`` -> ``seq-mean-token-sum-norm``,
    docs/aggregation.md); the others are loss formulas of their own and are rejected. ``epsilon``,
    ``epsilon_high`` and ``delta`` are ratio clips, a different quantity from DPPO's divergence thresholds: setting
    them is an error that names the ``dppo_*`` field to use (docs/names.md).

    Attributes:
        dppo_mode: ``binary_tv`` | ``binary_kl`` | ``topk_tv`` | ``topk_kl`` | ``ratio`` | ``none``
            (docs/contract.md), or an alias such as verl's ``dppo_tv`` / ``dppo_kl`` (stored as ours). The top-K
            modes need ``use_vllm=True`` and ``dppo_topk > 0``.
        dppo_topk: K, the number of rollout top-K log-probs per token requested from vLLM (top-K modes).
        dppo_delta_low, dppo_delta_high: trust-region thresholds; ``None`` -> ``dppo_ext.DEFAULT_DELTAS[mode]``.
        dppo_ratio_cap: cap C of the importance weight ``min(pi / mu, C)``.
        dppo_loss_agg_mode: ``None`` (from ``loss_type``, default ``token-mean``), ``token-mean`` (over all completion tokens of the generation batch on all processes,
            like TRL's ``dapo``), ``token-sum`` / ``token-sum-norm`` (sums over the optimizer step's micro-batches
            and processes) or a sequence mode of ``dppo_ext.AGG_MODES`` (per micro-batch, averaged). The ``-norm``
            modes divide by ``max_completion_length`` (as TRL's ``dr_grpo``).
        dppo_fused_linear: compute the loss from hidden states + LM-head weight (no logits tensor).
        dppo_chunk_size: rows per fused-linear chunk; ``None`` chooses from the sizes.
        dppo_vllm_dtype: dtype of the colocated vLLM engine (``vllm_mode="colocate"``); ``auto`` is vLLM's choice,
            which runs a float32 checkpoint in bfloat16 or float16, so ``|pi - mu|`` then includes that rounding.
    """

    dppo_mode: str = field(
        default="binary_tv",
        metadata={"help": f"DPPO mode: one of {MODES} or an alias (verl's dppo_tv/dppo_kl): {tuple(MODE_ALIASES)}."},
    )
    dppo_topk: int = field(default=0, metadata={"help": "K: rollout top-K log-probs per token (top-K modes)."})
    dppo_delta_low: Optional[float] = field(
        default=None, metadata={"help": "Lower threshold (A <= 0 side); None: the mode's default."}
    )
    dppo_delta_high: Optional[float] = field(
        default=None, metadata={"help": "Upper threshold (A > 0 side); None: the mode's default."}
    )
    dppo_ratio_cap: float = field(default=10.0, metadata={"help": "Cap C of the importance weight min(pi/mu, C)."})
    dppo_loss_agg_mode: Optional[str] = field(
        default=None, metadata={"help": f"One of {AGG_MODES}; None: from TRL's loss_type (dapo -> token-mean)."}
    )
    dppo_fused_linear: bool = field(
        default=True, metadata={"help": "Fused LM head + loss (no [B, T, V] logits); False: the logits path."}
    )
    dppo_chunk_size: Optional[int] = field(
        default=None, metadata={"help": "Rows per fused-linear chunk; None: automatic."}
    )
    dppo_vllm_dtype: str = field(
        default="auto",
        metadata={"help": "dtype of the colocated vLLM engine: auto (vLLM's choice; it runs a float32 checkpoint in "
                          "bfloat16/float16), float32, bfloat16 or float16."},
    )

    def __post_init__(self) -> None:
        self._warn_ignored_trl_fields()  # before GRPOConfig's own __post_init__ rewrites any of them
        super().__post_init__()
        check_settings(self.dppo_mode, self.temperature, self.dppo_delta_low, self.dppo_delta_high,
                       self.dppo_ratio_cap, prefix="dppo_")
        self.dppo_mode = canonical_mode(self.dppo_mode)
        if self.dppo_topk < 0:
            raise ValueError(f"dppo_topk must be >= 0, got {self.dppo_topk}")
        if self.dppo_mode in TOPK_MODES and (not self.use_vllm or self.dppo_topk < 1):
            raise ValueError(
                f"dppo_mode={self.dppo_mode!r} needs the rollout's top-K log-probs: set use_vllm=True and "
                f"dppo_topk=K >= 1 (got use_vllm={self.use_vllm}, dppo_topk={self.dppo_topk})"
            )
        self._check_trl_loss_fields()
        if self.dppo_loss_agg_mode not in AGG_MODES:
            raise ValueError(f"dppo_loss_agg_mode must be one of {AGG_MODES}, got {self.dppo_loss_agg_mode!r}")
        if self.dppo_loss_agg_mode in NORM_AGG_MODES and not (self.max_completion_length or 0) > 0:
            raise ValueError(
                f"dppo_loss_agg_mode={self.dppo_loss_agg_mode!r} divides by max_completion_length, which must be a "
                f"positive int, got {self.max_completion_length!r}")
        if self.dppo_chunk_size is not None and self.dppo_chunk_size < 1:
            raise ValueError(f"dppo_chunk_size must be a positive int or None, got {self.dppo_chunk_size}")
        if self.dppo_vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"dppo_vllm_dtype must be one of {VLLM_DTYPES}, got {self.dppo_vllm_dtype!r}")

    def _check_trl_loss_fields(self) -> None:
        """Resolve ``dppo_loss_agg_mode`` from TRL's ``loss_type``; reject TRL's ratio clips (docs/names.md)."""
        if self.loss_type != _TRL_DEFAULT_LOSS_TYPE and self.dppo_loss_agg_mode is not None:
            raise ValueError(
                f"set either loss_type (TRL's name) or dppo_loss_agg_mode, not both: got loss_type={self.loss_type!r} "
                f"and dppo_loss_agg_mode={self.dppo_loss_agg_mode!r}")
        if self.dppo_loss_agg_mode is None:
            if self.loss_type not in _TRL_LOSS_TYPE_AGG:
                raise ValueError(
                    f"loss_type={self.loss_type!r} is a TRL loss formula of its own, not an aggregation DPPO can use; "
                    f"set dppo_loss_agg_mode to one of {AGG_MODES} (loss_type maps only {dict(_TRL_LOSS_TYPE_AGG)})")
            self.dppo_loss_agg_mode = _TRL_LOSS_TYPE_AGG[self.loss_type]
        ratio_clips = {"epsilon": (self.epsilon, 0.2), "epsilon_high": (self.epsilon_high, None),
                       "delta": (self.delta, None)}
        changed = {name: value for name, (value, default) in ratio_clips.items() if value != default}
        if changed:
            raise ValueError(
                f"DPPOGRPOTrainer does not read TRL's ratio-clip fields {changed}: DPPO's thresholds bound a divergence "
                f"(binary_tv default {DEFAULT_DELTAS['binary_tv']}), not the ratio pi/pi_old. Set dppo_delta_low / "
                f"dppo_delta_high (for dppo_mode='ratio' these are the same clip as epsilon / epsilon_high) and "
                f"leave epsilon, epsilon_high and delta at TRL's defaults (0.2, None, None)")

    def _warn_ignored_trl_fields(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
        changed = {name: getattr(self, name) for name in _IGNORED_TRL_LOSS_FIELDS
                   if name in defaults and getattr(self, name) != defaults[name]}
        if changed:
            warnings.warn(
                f"DPPOGRPOConfig: the DPPO loss ignores TRL's own loss settings {changed}; set the DPPO ones instead "
                f"(dppo_mode, dppo_delta_low, dppo_delta_high, dppo_ratio_cap, dppo_loss_agg_mode)",
                UserWarning,
                stacklevel=4,
            )

    @property
    def dppo_deltas(self) -> tuple[float, float]:
        """``(delta_low, delta_high)`` with the mode's defaults filled in."""
        return resolve_deltas(self.dppo_mode, self.dppo_delta_low, self.dppo_delta_high)


@dataclass
class DPPOForwardOutput(ModelOutput):
    """Per-token DPPO outputs of the patched forward, each ``[B, T]`` float32 (0 at padding)."""

    loss: Optional[torch.Tensor] = None
    logp: Optional[torch.Tensor] = None
    divergence: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None


def add_dppo_head(model: torch.nn.Module, args: DPPOGRPOConfig, temperature: float) -> None:
    """Wrap ``model.forward`` so that ``model(input_ids, attention_mask, dppo_batch=batch)`` returns DPPO outputs.

    ``batch`` is a dict of ``[B, T]`` tensors for the last ``T`` positions (the completion): ``tokens`` (int64,
    -100 at padding), ``rollout_logprobs``, ``advantages`` (float32), optionally ``anchor_logprobs`` and, for
    the top-K modes, ``topk_ids`` / ``topk_logprobs`` ``[B, T, K]``. The backbone runs on the whole sequence; the
    hidden states that predict the completion tokens go through the LM head and the DPPO op (fused, or via
    logits with ``args.dppo_fused_linear=False``). Without ``dppo_batch`` the previous forward runs unchanged
    (generation, TRL's own log-prob passes). Models that transform the LM head's output (logit soft-capping or
    scaling in their forward) are rejected: the loss would see different logits than the model's.
    """
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or not hasattr(model, "base_model"):
        raise ValueError(
            f"add_dppo_head needs a causal LM with an LM head (model.get_output_embeddings() with a weight, and "
            f"model.base_model), got {type(model).__name__} whose output embeddings are {type(head).__name__}; "
            f"load the model with AutoModelForCausalLM"
        )
    text_config = model.config.get_text_config()
    transforms = {name: getattr(text_config, name, None) for name in _LOGIT_TRANSFORMS}
    transforms = {name: value for name, value in transforms.items() if value is not None and value != 1.0}
    if transforms:
        raise ValueError(
            f"DPPOGRPOTrainer does not support models that transform the LM head's logits in their forward "
            f"(config has {transforms}); the DPPO loss is computed from the plain LM-head output"
        )
    previous_forward = model.forward
    delta_low, delta_high = args.dppo_deltas

    @functools.wraps(type(model).forward)
    def _forward(self, *f_args: Any, dppo_batch: Optional[dict[str, torch.Tensor]] = None, **kwargs: Any):
        if dppo_batch is None:
            return previous_forward(*f_args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*f_args, **kwargs).last_hidden_state
        tokens = dppo_batch["tokens"]
        batch, length = tokens.shape
        hidden = hidden[:, -length - 1 : -1]
        head = self.get_output_embeddings()
        topk_ids = dppo_batch.get("topk_ids")
        topk_logprobs = dppo_batch.get("topk_logprobs")
        op_kwargs = dict(
            topk_ids=None if topk_ids is None else topk_ids.reshape(batch * length, -1),
            topk_logprobs=None if topk_logprobs is None else topk_logprobs.reshape(batch * length, -1).float(),
            anchor_logprobs=_flat(dppo_batch.get("anchor_logprobs")),
            mode=args.dppo_mode,
            temperature=temperature,
            delta_low=delta_low,
            delta_high=delta_high,
            ratio_cap=args.dppo_ratio_cap,
            compute_entropy=True,
        )
        flat_tokens = tokens.reshape(-1)
        rollout = _flat(dppo_batch["rollout_logprobs"])
        advantages = _flat(dppo_batch["advantages"])
        if args.dppo_fused_linear:
            weight, bias = head.weight, head.bias
            if isinstance(weight, DTensor):  # FSDP2 shards: the fused matmul needs the whole head
                weight = weight.full_tensor()
                bias = bias.full_tensor() if bias is not None else None
            gather = functools.partial(maybe_gather_lm_head_ctx, weight, bias)
            # Under autocast the LM head would run in the autocast dtype: do the same, explicitly (the fused
            # function writes into preallocated buffers, which autocast does not handle).
            device_type = hidden.device.type
            dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
            with torch.autocast(device_type, enabled=False), gather():
                out = fused_linear_dppo_loss_per_row(
                    hidden.reshape(batch * length, -1).to(dtype),
                    weight.to(dtype),
                    flat_tokens,
                    rollout,
                    advantages,
                    bias=None if bias is None else bias.to(dtype),
                    chunk_size=args.dppo_chunk_size,
                    weight_context=gather,
                    **op_kwargs,
                )
        else:
            logits = head(hidden)
            out = dppo_loss_forward(logits.reshape(batch * length, -1), flat_tokens, rollout, advantages, **op_kwargs)
        return DPPOForwardOutput(*(t.view(batch, length) for t in out))

    model.forward = types.MethodType(_forward, model)


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


@contextlib.contextmanager
def _extra_llm_kwargs(**extra: Any):
    """While TRL builds its colocated ``vllm.LLM``, add ``extra`` to the constructor's keyword arguments."""
    if not extra:
        yield
        return
    original = trl_vllm_generation.LLM
    trl_vllm_generation.LLM = functools.partial(original, **extra)
    try:
        yield
    finally:
        trl_vllm_generation.LLM = original


def _reload_weights_into_vllm(generation: Any) -> None:
    """TRL's colocate weight sync (a ``VLLMGeneration.sync_weights`` replacement) through vLLM's in-place reload.

    TRL 1.16 calls the vLLM model's ``load_weights`` directly, which vLLM 0.32 no longer supports once the weights
    are loaded (it raises ``'Parameter' object has no attribute 'weight_loader'`` on the CPU backend's float32
    layers, as measured here). This streams the same ``(name, tensor)`` pairs (TRL's ``_iter_named_params``: FSDP/DeepSpeed gathers,
    PEFT merges and names included) through ``reload_weights``, as ``dppo_ext.rollout.VLLMEngine`` does, then resets
    the prefix cache so no KV block computed with the old weights is reused.
    """
    install_benign_warning_filters()
    generation.llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": generation._iter_named_params(), "is_checkpoint_format": True}
    )
    generation.llm.reset_prefix_cache()


def _pad_topk(rows: list[list[list[float]]], length: int, k: int, fill: float, dtype, device) -> torch.Tensor:
    """``[B, length, k]`` tensor from ragged ``[B][T_b][k]`` lists, right-padded with ``fill``."""
    out = torch.full((len(rows), length, k), fill, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out.to(device)


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.reshape(-1).float().contiguous()


class DPPOGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose policy loss is DPPO through ``dppo_ext`` (see the module docstring)."""

    def __init__(self, model: Any, reward_funcs: Any = None, args: Optional[DPPOGRPOConfig] = None, **kwargs: Any):
        if not isinstance(args, DPPOGRPOConfig):
            raise TypeError(f"DPPOGRPOTrainer needs args=DPPOGRPOConfig(...), got {type(args).__name__}")
        unsupported = {
            "entropy_coef": args.entropy_coef != 0.0,
            "use_adaptive_entropy": args.use_adaptive_entropy,
            "top_entropy_quantile": args.top_entropy_quantile < 1.0,
            "off_policy_mask_threshold": args.off_policy_mask_threshold is not None,
        }
        bad = [name for name, is_set in unsupported.items() if is_set]
        if bad:
            raise ValueError(
                f"DPPOGRPOTrainer does not combine DPPO with TRL's {bad} (set them to their defaults: entropy_coef=0, "
                "use_adaptive_entropy=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None)"
            )
        colocate = args.use_vllm and args.vllm_mode == "colocate"
        llm_kwargs = {"dtype": args.dppo_vllm_dtype} if colocate and args.dppo_vllm_dtype != "auto" else {}
        with _extra_llm_kwargs(**llm_kwargs):
            super().__init__(model, reward_funcs, args=args, **kwargs)
        if colocate and not args.vllm_enable_sleep_mode:
            self.vllm_generation.sync_weights = types.MethodType(_reload_weights_into_vllm, self.vllm_generation)
        self._dppo_topk = args.dppo_topk if args.dppo_mode in TOPK_MODES else 0
        if self._dppo_topk:
            if self.tools or self.rollout_func is not None:
                raise ValueError("the top-K DPPO modes do not support tools or rollout_func (the sampler's top-K is "
                                 "kept per generated position of a single turn); use binary_tv or binary_kl")
            self.vllm_generation.logprobs = self._dppo_topk  # TRL asks for 0 (the sampled token only)
        target = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        add_dppo_head(target, args, self.temperature)
        self._dppo_recompute_noted = False
        self._dppo_topk_pending: Optional[tuple[list, list]] = None

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """TRL's vLLM branch, keeping the top-K log-probs (top-K modes); otherwise TRL's method unchanged."""
        if not self._dppo_topk:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        if self.state.global_step != self._last_loaded_step:
            with profiling_context(self, "sync_weights"):
                self.vllm_generation.sync_weights()
            self._last_loaded_step = self.state.global_step
        _, completion_ids, logprobs, logprob_token_ids = self.vllm_generation.generate(
            prompts=prompt_ids,
            images=images,
            num_generations=num_generations,
            profiler=profiling_context(self, "vLLM.generate"),
        )
        sampled, topk_ids, topk_logprobs = split_vllm_logprobs(
            completion_ids, logprobs, logprob_token_ids, self._dppo_topk
        )
        self._dppo_topk_pending = (topk_ids, topk_logprobs)
        return completion_ids, sampled

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)
        if self._dppo_topk_pending is not None:
            topk_ids, topk_logprobs = self._dppo_topk_pending
            self._dppo_topk_pending = None
            length, device = output["completion_ids"].size(1), output["completion_ids"].device
            output["dppo_topk_ids"] = _pad_topk(topk_ids, length, self._dppo_topk, 0, torch.long, device)
            output["dppo_topk_logprobs"] = _pad_topk(
                topk_logprobs, length, self._dppo_topk, -math.inf, torch.float32, device
            )
        if output.get("sampling_per_token_logps") is not None:
            return output
        if not self._dppo_recompute_noted:
            logger.warning(
                "DPPO 'recompute' variant: no rollout log-probs from vLLM (use_vllm=False), so the trust region is "
                "anchored on the old-policy log-probs recomputed by the trainer model, not on the sampler's"
            )
            self._dppo_recompute_noted = True
        if output.get("old_per_token_logps") is None:
            input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
            attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    output["completion_ids"].size(1),
                    batch_size=self.args.per_device_train_batch_size,
                )
            output["old_per_token_logps"] = old
        return output

    def _dppo_rollout(self, inputs: dict[str, Any], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(rollout_logprobs [B, T], mask [B, T], recompute)``: vLLM's log-probs, else the old-policy ones.

        Tokens vLLM could not score (NaN) take the old-policy log-prob when TRL computed it, else leave the loss.
        """
        sampling = inputs.get("sampling_per_token_logps")
        old = inputs.get("old_per_token_logps")
        if sampling is None:
            return old.clamp(max=0.0), mask, True
        unscored = torch.isnan(sampling) & mask
        if unscored.any():
            if old is not None:
                sampling = torch.where(unscored, old, sampling)
            else:
                mask = mask & ~unscored
        return sampling.clamp(max=0.0), mask, False

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if inputs.get("pixel_values") is not None:
            raise ValueError("DPPOGRPOTrainer supports text-only models; got pixel_values in the batch")
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask.bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        rollout, mask, recompute = self._dppo_rollout(inputs, mask)
        advantages = inputs["advantages"]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        advantages = advantages.expand_as(completion_ids)
        batch = {
            "tokens": completion_ids.masked_fill(~mask, IGNORE_INDEX),
            "rollout_logprobs": torch.where(mask, rollout, torch.zeros_like(rollout)),
            "advantages": torch.where(mask, advantages, torch.zeros_like(advantages)),
        }
        if "dppo_topk_ids" in inputs:
            batch["topk_ids"] = inputs["dppo_topk_ids"]
            batch["topk_logprobs"] = inputs["dppo_topk_logprobs"]
        with self.accelerator.autocast():
            out = model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=torch.cat([prompt_mask, completion_mask], dim=1),
                dppo_batch=batch,
            )
        per_token_loss = out.loss
        if self.beta != 0.0:
            ref_diff = inputs["ref_per_token_logps"] - out.logp
            per_token_kl = torch.exp(ref_diff) - ref_diff - 1
            per_token_loss = per_token_loss + self.beta * per_token_kl * mask
        mode = "train" if self.model.training else "eval"
        loss = self._dppo_aggregate(per_token_loss, mask, inputs, mode)
        policy_loss = (out.loss * mask).sum() / mask.sum().clamp(min=1)
        self._dppo_log(out, batch, mask, policy_loss, recompute, mode, per_token_kl if self.beta != 0.0 else None)
        return loss

    def _dppo_aggregate(
        self, per_token_loss: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any], mode: str
    ) -> torch.Tensor:
        """Scalar loss of this micro-batch, scaled so that the sum over accumulation steps and the mean over
        processes give the configured aggregation (sums: ``token-sum``, ``token-sum-norm``; means otherwise)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        agg = self.args.dppo_loss_agg_mode
        if agg == "token-mean":
            # num_items_in_batch: completion tokens of the whole generation batch on all processes.
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            return (per_token_loss * mask).sum() / normalizer
        horizon = self.args.max_completion_length if agg in NORM_AGG_MODES else None
        loss = aggregate_loss(per_token_loss, mask, agg, horizon)
        if agg in ("token-sum", "token-sum-norm"):
            return loss * self.accelerator.num_processes  # DDP averages over processes: undo it, keep the sum
        return loss / accumulation

    def _dppo_log(
        self,
        out: DPPOForwardOutput,
        batch: dict[str, torch.Tensor],
        mask: torch.Tensor,
        policy_loss: torch.Tensor,
        recompute: bool,
        mode: str,
        per_token_kl: Optional[torch.Tensor],
    ) -> None:
        """Our metrics (``dppo/<name>``), reduced across processes, into TRL's metric buffer."""
        flat = DPPOOutputs(*(_flat(t) for t in out.to_tuple()))
        metrics = dppo_metrics(flat, _flat(batch["rollout_logprobs"]), _flat(batch["advantages"]), mask.reshape(-1))
        if per_token_kl is not None:
            metrics["kl"] = (per_token_kl * mask).sum() / mask.sum().clamp(min=1)
        names = list(metrics)
        local = torch.stack([metrics[n].detach().float() for n in names])
        gathered = self.accelerator.gather(local.unsqueeze(0)).view(-1, len(names))
        for i, name in enumerate(names):
            column = gathered[:, i]
            if name in _MAX_METRICS:
                value = column.max()
            elif name == "num_tokens":
                value = column.sum()
            else:
                value = column.mean()
            self._metrics[mode][f"dppo/{name}"].append(value.item())
        self._metrics[mode]["entropy"].append(self._metrics[mode]["dppo/entropy_mean"][-1])
        self._metrics[mode]["dppo/recompute_variant"].append(float(recompute))
        self._metrics[mode]["policy_loss"].append(self.accelerator.gather(policy_loss.detach()).mean().item())


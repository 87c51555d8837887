"""What the sanity test runs: methods, the shared settings, the conditions and arms, one run's config.

The experiments of docs/sanity.md live here:

- the **dosed-mismatch experiment**: the trainer's learning setup with a training-inference
  mismatch of a chosen size (rollout logit noise sigma, or rollouts ``lag`` steps stale), fp32
  rollouts otherwise; arms ``calibration`` (the optimizer setting), ``noise``, ``lag`` and
  ``tail`` (a 4,096-token vocabulary with a long tail of rare tokens);
- the **staleness ladder**, the **collapse replication** and the **precision-dose pilot**, each pre-registered in
  its own folder (``experiments/sanity/results/staleness``, ``experiments/sanity/collapse``,
  ``experiments/sanity/precision``);
- the **earlier sweeps** (``HISTORY``): bf16 / fp16 vLLM rollouts against the fp32 trainer, kept so
  that every number of the history section still has its command.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.losses import LOSSES

from .rare_token import GOOD_TOKEN, RARE_VOCAB

# The paper's sanity-test methods, in its order.
METHODS = (
    "pg_is",
    "cispo",
    "grpo_clip",
    "grpo_clip_higher",
    "minirl",
    "minirl_tis",
    "dppo_binary_tv",
    "dppo_binary_kl",
    "dppo_topk_tv",
    "dppo_topk_kl",
)
# Methods that have no trust region or anchor it elsewhere than on mu (drawn dashed).
BASELINES = ("pg_is", "cispo", "minirl", "minirl_tis", "cispo_clip", "pg_pi_old")
# The paper uses K = 20 of a ~150k vocabulary; the embedded model has 17 tokens, where K = 20 would be the whole
# distribution (an exact divergence). K = 4 keeps the top-K modes an approximation there; the padded
# 4,096-token vocabulary of the tail arm uses the paper's K = 20.
TOPK = 4
TAIL_TOPK = 20


@dataclass(frozen=True)
class Condition:
    """A setting: trainer flags on top of its experiment's base, a description, its default methods and seeds."""

    description: str
    flags: dict[str, Any] = field(default_factory=dict)
    methods: tuple[str, ...] | None = None
    seeds: tuple[int, ...] = (0, 1, 2)
    base: str = "dosed"
    task: str = "arithmetic"  # or "rare_token" (experiments.sanity.rare_token: the reward needs a rare token)


# ---------------------------------------------------------------------------- the dosed-mismatch experiment
# The trainer's learning setup (docs/sanity.md, "Design"): fp32 vLLM rollouts, so the injected
# mismatch is the only one, 200 steps of 16 prompts x 16 samples, the mechanism metrics on.
DOSED: dict[str, Any] = dict(
    max_operand=99,
    max_second_operand=9,
    warm_start_problems=600,
    warm_start_steps=1000,
    warm_start_label_smoothing=0.3,
    num_eval=200,
    eval_samples=4,
    eval_every=20,
    steps=200,
    prompts_per_step=16,
    group_size=16,
    max_new_tokens=6,
    num_minibatches=4,
    ppo_epochs=2,
    warmup_steps=20,
    lr=1e-4,
    max_grad_norm=1.0,
    save_every=20,
    threads=1,
    rollout_dtype="float32",
    dtype="float32",
    engine="vllm",
    mechanism_metrics=True,
)
NO_CLIP = 1e6  # a --max-grad-norm that does not bind (the report counts the updates it clipped)

# The calibration ladder (docs/sanity.md, "Calibration"): PG-IS without mismatch on two seeds that no other arm uses.
LADDER: dict[str, dict[str, Any]] = {
    "cal1": dict(lr=1e-4, max_grad_norm=1.0, ppo_epochs=2),
    # added after the first ladder's runs on seed 100 (every rung above cal1 collapsed PG-IS), before any grid run:
    # the steps between cal1 and cal3, one knob at a time
    "cal1b": dict(lr=1e-4, max_grad_norm=NO_CLIP, ppo_epochs=2),
    "cal1c": dict(lr=2e-4, max_grad_norm=NO_CLIP, ppo_epochs=2),
    "cal2": dict(lr=3e-4, max_grad_norm=1.0, ppo_epochs=2),
    "cal3": dict(lr=3e-4, max_grad_norm=NO_CLIP, ppo_epochs=2),
    "cal4": dict(lr=1e-3, max_grad_norm=NO_CLIP, ppo_epochs=2),
    "cal5": dict(lr=1e-3, max_grad_norm=NO_CLIP, ppo_epochs=4),
    "cal6": dict(lr=3e-3, max_grad_norm=NO_CLIP, ppo_epochs=4),
}
# The chain the rule climbs, each rung at least as aggressive as the one before in every knob (cal2, lr 3e-4 with
# clipping, is between cal1 and cal3 but not comparable with cal1b / cal1c; it runs and is reported, off the chain).
CHAIN = ("cal1", "cal1b", "cal1c", "cal3", "cal4", "cal5", "cal6")
CALIBRATION_SEEDS = (100, 101)
CALIBRATION_GAIN = 0.08  # PG-IS without mismatch must gain at least 8 points on every calibration seed

# The optimizer setting of every other arm: the rung the calibration rule chose (docs/sanity.md, "Calibration").
CALIBRATED = "cal1b"

GRID_METHODS = ("pg_is", "cispo", "minirl", "grpo_clip_higher", "dppo_binary_tv", "dppo_topk_tv")
TAIL_METHODS = ("grpo_clip_higher", "dppo_binary_tv", "dppo_topk_tv")
TAIL: dict[str, Any] = dict(tiny_vocab_size=4096, warm_start_label_smoothing=0.05)


def _dosed_conditions() -> dict[str, Condition]:
    conditions = {
        name: Condition(
            f"calibration rung {name}: lr {f['lr']:g}, "
            f"{'no gradient clipping' if f['max_grad_norm'] >= NO_CLIP else 'gradient clipping at 1'}, "
            f"{f['ppo_epochs']} epochs x 4 mini-batches; PG-IS, no mismatch",
            f,
            methods=("pg_is",),
            seeds=CALIBRATION_SEEDS,
        )
        for name, f in LADDER.items()
    }
    optimizer = LADDER[CALIBRATED]
    for sigma in (0.0, 0.3, 1.0):
        what = "no mismatch (control)" if sigma == 0 else f"rollout logit noise sigma = {sigma:g}"
        conditions[f"sigma{sigma:g}"] = Condition(what, {**optimizer, "rollout_logit_noise": sigma}, GRID_METHODS)
    for lag in (8, 16):
        conditions[f"lag{lag}"] = Condition(
            f"rollouts {lag} steps stale (--rollout-lag {lag})", {**optimizer, "rollout_lag": lag}, GRID_METHODS
        )
    conditions["tail_sigma0.3"] = Condition(
        "4,096-token vocabulary, warm start with label smoothing 0.05 (a long tail of rare tokens), "
        "logit noise sigma = 0.3",
        {**optimizer, **TAIL, "rollout_logit_noise": 0.3},
        TAIL_METHODS,
    )
    return conditions


# ---------------------------------------------------------------------------- the staleness experiment
# experiments/sanity/results/staleness/PREREGISTRATION.md: the dosed experiment's setting with the calibrated
# optimizer, 300 steps, no periodic checkpoint (an interrupted stale run starts over: a resumed one would restart its
# lag window), fresh seeds 10-17, the pilot on seed 100.
STALE_LAGS = (0, 16, 32, 64)
STALE_METHODS = ("pg_is", "dppo_binary_tv", "pg_pi_old", "minirl", "cispo_clip")
STALE_SEEDS = tuple(range(10, 18))
PILOT_SEED = 100
PILOT_EVAL_SAMPLES = 4  # the pilot measures the evaluation noise at k = 4 (PREREGISTRATION.md, "Common setting")
# k of every ladder run: the smallest of 4, 8, 16 whose one-evaluation noise the pilot measured at <= 1 point
STALE_EVAL_SAMPLES = 4
STALE: dict[str, Any] = dict(steps=300, save_every=0)
STEP_SIZES = {"steplr2e-4": "cal1c", "steplr3e-4": "cal3"}  # part 4: PG-IS and DPPO at the rungs PG-IS failed
# part 3: the rare good token, 150 steps evaluated every 10 (the endpoint is the rate at step 50)
RARE_TOKEN_FLAGS: dict[str, Any] = dict(tiny_vocab_size=RARE_VOCAB, steps=150, eval_every=10, save_every=0)
RARE_TOKEN_METHODS = ("grpo_clip_higher", "dppo_binary_tv", "pg_is")


def _staleness_conditions() -> dict[str, Condition]:
    optimizer = LADDER[CALIBRATED]
    conditions = {}
    for lag in STALE_LAGS:
        what = "no lag (control)" if lag == 0 else f"rollouts {lag} steps stale (--rollout-lag {lag})"
        flags = {**optimizer, **STALE, "rollout_lag": lag}
        conditions[f"stale{lag}"] = Condition(
            f"{what}, 300 steps", {**flags, "eval_samples": STALE_EVAL_SAMPLES}, STALE_METHODS, STALE_SEEDS
        )
        conditions[f"pilot_stale{lag}"] = Condition(
            f"pilot: {what}, 300 steps",
            {**flags, "eval_samples": PILOT_EVAL_SAMPLES},
            ("dppo_binary_tv",),
            (PILOT_SEED,),
        )
    conditions["rare_token"] = Condition(
        f"reward = the response holds {GOOD_TOKEN} (mu ~ 2e-3: vocabulary padded to {RARE_VOCAB}), no lag, 150 steps",
        {**optimizer, **RARE_TOKEN_FLAGS, "eval_samples": STALE_EVAL_SAMPLES},
        RARE_TOKEN_METHODS,
        STALE_SEEDS,
        task="rare_token",
    )
    for name, rung in STEP_SIZES.items():
        conditions[name] = Condition(
            f"no lag, lr {LADDER[rung]['lr']:g}, no clipping, 300 steps",
            {**LADDER[rung], **STALE, "eval_samples": STALE_EVAL_SAMPLES},
            ("pg_is", "dppo_binary_tv"),
            STALE_SEEDS,
        )
    return conditions


# ---------------------------------------------------------------------------- the collapse replication
# experiments/sanity/collapse/PREREGISTRATION.md: the staleness ladder's setting at lag 32 (the dose chosen from the
# ladder's exploratory data), 48 seeds never used before, PG-IS and DPPO Binary-TV (primary) and CISPO with its cap
# of 10 (DPPO without its mask), seed-major.
COLLAPSE_LAG = 32
COLLAPSE_CONDITION = f"collapse{COLLAPSE_LAG}"
COLLAPSE_METHODS = ("pg_is", "dppo_binary_tv", "cispo")
COLLAPSE_SEEDS = tuple(range(200, 248))


def _collapse_conditions() -> dict[str, Condition]:
    flags = {**LADDER[CALIBRATED], **STALE, "rollout_lag": COLLAPSE_LAG, "eval_samples": STALE_EVAL_SAMPLES}
    return {
        COLLAPSE_CONDITION: Condition(
            f"collapse replication: rollouts {COLLAPSE_LAG} steps stale, 300 steps",
            flags,
            COLLAPSE_METHODS,
            COLLAPSE_SEEDS,
        )
    }


# ---------------------------------------------------------------------------- the precision-dose pilot
# experiments/sanity/precision/PREREGISTRATION.md (non-confirmatory): the collapse replication's setting without a lag,
# the rollout weights fake-quantised to int4 / int3 on every sync (one scale per 128 input weights), PG-IS and DPPO
# Binary-TV on 4 seeds never used before, seed-major.
PRECISION_BITS = (4, 3)
PRECISION_GROUP = 128
PRECISION_METHODS = ("pg_is", "dppo_binary_tv")
PRECISION_SEEDS = (300, 301, 302, 303)


def precision_condition(bits: int) -> str:
    return f"quant_int{bits}"


def _precision_conditions() -> dict[str, Condition]:
    base = {**LADDER[CALIBRATED], **STALE, "eval_samples": STALE_EVAL_SAMPLES, "rollout_weight_group": PRECISION_GROUP}
    return {
        precision_condition(bits): Condition(
            f"precision pilot: rollout weights fake-quantised to int{bits}, group {PRECISION_GROUP}, no lag, 300 steps",
            {**base, "rollout_lag": 0, "rollout_weight_bits": bits},
            PRECISION_METHODS,
            PRECISION_SEEDS,
        )
        for bits in PRECISION_BITS
    }


# Arms: the conditions drawn in one figure and compared in one table, the control first.
ARMS: dict[str, tuple[str, ...]] = {
    "calibration": tuple(LADDER),
    "noise": ("sigma0", "sigma0.3", "sigma1"),
    "lag": ("sigma0", "lag8", "lag16"),
    "tail": ("tail_sigma0.3",),
    "staleness": tuple(f"stale{lag}" for lag in STALE_LAGS),
    "pilot": ("pilot_stale0", "pilot_stale64"),
    "step_size": ("stale0", *STEP_SIZES),
    "rare_token": ("rare_token",),
}
GRID = ("sigma0", "sigma0.3", "sigma1", "lag8", "lag16", "tail_sigma0.3")

# ---------------------------------------------------------------------------- the earlier sweeps
BASE: dict[str, Any] = dict(
    max_operand=29,
    max_second_operand=9,
    num_eval=100,
    warm_start_problems=150,
    warm_start_steps=150,
    warm_start_label_smoothing=0.0,
    steps=60,
    prompts_per_step=16,
    group_size=8,
    max_new_tokens=6,
    eval_every=10,
    eval_samples=2,
    num_minibatches=2,
    ppo_epochs=2,
    warmup_steps=5,
    lr=1e-4,
    save_every=20,
    threads=1,
    rollout_dtype="bfloat16",
    dtype="float32",
    engine="auto",
)
LEARN: dict[str, Any] = dict(
    max_operand=99,
    warm_start_problems=600,
    warm_start_steps=1000,
    warm_start_label_smoothing=0.3,
    num_eval=200,
    steps=120,
    prompts_per_step=16,
    group_size=16,
    num_minibatches=4,
    warmup_steps=20,
    lr=1e-4,
    eval_every=20,
)


def _history(
    description: str, flags: dict[str, Any] | None = None, methods: tuple[str, ...] | None = None
) -> Condition:
    return Condition(description, flags or {}, methods, base="history")


HISTORY: dict[str, Condition] = {
    "bf16_lr3e-4": _history("bf16 vLLM rollouts vs fp32 trainer, lr 3e-4", {"lr": 3e-4}),
    "fp32_lr3e-4": _history(
        "control without mismatch: fp32 vLLM rollouts, fp32 trainer, lr 3e-4",
        {"lr": 3e-4, "rollout_dtype": "float32"},
        ("pg_is", "cispo", "minirl", "dppo_binary_tv"),
    ),
    "bf16_lr1e-3": _history("bf16 rollouts, lr 1e-3", {"lr": 1e-3}),
    "bf16_lr1e-4": _history("bf16 rollouts, lr 1e-4 (the trainer's default)"),
    "bf16_lr3e-4_ep4": _history(
        "bf16 rollouts, lr 3e-4, 4 PPO epochs x 4 mini-batches", {"lr": 3e-4, "ppo_epochs": 4, "num_minibatches": 4}
    ),
    "bf16_lr3e-4_lag4": _history("bf16 rollouts 4 steps stale (async), lr 3e-4", {"lr": 3e-4, "rollout_lag": 4}),
    "fp16_lr3e-4": _history("fp16 rollouts, lr 3e-4", {"lr": 3e-4, "rollout_dtype": "float16"}),
    "learn_bf16": _history(
        "the trainer's learning setup (a in 0..99, warm start 1000 steps with label smoothing "
        "0.3, lr 1e-4, 16 x 16 per step), bf16 rollouts",
        LEARN,
        ("pg_is", "cispo", "minirl", "dppo_binary_tv", "dppo_topk_tv"),
    ),
    "learn_fp32": _history(
        "the trainer's learning setup, fp32 rollouts (control without mismatch)",
        {**LEARN, "rollout_dtype": "float32"},
        ("pg_is", "dppo_binary_tv"),
    ),
    "learn_bf16_lag4": _history(
        "the trainer's learning setup, bf16 rollouts 4 steps stale (asynchronous RL)",
        {**LEARN, "rollout_lag": 4},
        ("pg_is", "cispo", "minirl", "dppo_binary_tv"),
    ),
}

CONDITIONS: dict[str, Condition] = {
    **_dosed_conditions(),
    **_staleness_conditions(),
    **_collapse_conditions(),
    **_precision_conditions(),
    **HISTORY,
}
BASES = {"dosed": DOSED, "history": BASE}

# The CI smoke test: the top noise dose on a tiny warm start, a few steps.
QUICK: dict[str, Any] = dict(
    steps=3,
    prompts_per_step=4,
    group_size=4,
    num_eval=16,
    eval_every=2,
    eval_samples=2,
    save_every=1,
    warm_start_steps=30,
    warm_start_problems=60,
    max_operand=9,
)
QUICK_METHODS = ("minirl", "dppo_binary_tv")
QUICK_CONDITION = "sigma1"


@dataclass(frozen=True)
class Run:
    """One training run of a sweep."""

    condition: str
    method: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.condition}/{self.method}/seed{self.seed}"


def run_config(run: Run, work: Path, overrides: dict[str, Any]) -> TrainConfig:
    """The validated trainer config of ``run``: its base, the condition, ``overrides``, the method."""
    condition = CONDITIONS[run.condition]
    settings = dict(BASES[condition.base])
    settings.update(condition.flags)
    settings.update(overrides)
    settings.update(loss=run.method, seed=run.seed, out=str(work / run.condition / run.method / f"seed{run.seed}"))
    if LOSSES[run.method].uses_topk:
        settings["top_k"] = TAIL_TOPK if settings.get("tiny_vocab_size") else TOPK
    return TrainConfig(**settings).validate()


def condition_methods(name: str, methods: list[str] | None) -> tuple[str, ...]:
    """``methods`` when given, else the condition's own (all of ``METHODS`` when it names none)."""
    return tuple(methods) if methods else (CONDITIONS[name].methods or METHODS)


def is_unclipped(max_grad_norm: float) -> bool:
    """True for a --max-grad-norm that never binds (``NO_CLIP``)."""
    return math.isfinite(max_grad_norm) and max_grad_norm >= NO_CLIP

"""Typed training configuration; the command-line parser (dppo_ext.trainer.cli) is generated from it.

Every field of ``TrainConfig`` becomes a ``--flag`` (underscores -> dashes) with the field's
type, default and help text, so the dataclass is the single place that defines the CLI.
``TrainConfig.validate`` fails fast with messages that name the flag, the value and what is
expected.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

from dppo_ext.contract import (
    AGG_MODES,
    LOGITS_DTYPE_SETTINGS,
    MAX_LOGIT_NOISE,
    MODEL_DTYPES,
    ROLLOUT_WEIGHT_BITS,
    sampling_truncation,
)
from dppo_ext.models.tiny import ARITHMETIC_ALPHABET, SPECIAL_TOKENS, tiny_heads
from dppo_ext.rollout.base import Truncation
from dppo_ext.rollout.factory import ENGINE_KINDS
from dppo_ext.tasks.base import VERIFIERS
from dppo_ext.trainer.losses import LOSSES
from dppo_ext.trainer.ranges import Range
from dppo_ext.trainer.reporting import REPORT_TARGETS

# --loss name -> dppo_loss mode (the full configuration of each loss: dppo_ext.trainer.losses).
LOSS_MODES = {name: spec.mode for name, spec in LOSSES.items()}
TOPK_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.uses_topk)
PROMPT_FORMATS = ("auto", "plain", "chat")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class TrainConfig:
    """All settings of a training run (defaults: the embedded arithmetic run)."""

    # model and data
    model: str = _opt("", "HF model folder or hub id; empty builds the embedded tiny model and warm-starts it")
    data: str = _opt(
        "",
        "JSONL training data ({'prompt','answer'} per line); empty uses the embedded arithmetic task, which only "
        'the embedded model can take. For --model, write that task as JSONL with: python -c "import json; from '
        "dppo_ext.tasks import make_arithmetic_task; [print(json.dumps(vars(p))) for p in "
        'make_arithmetic_task().train]" > arithmetic.jsonl',
    )
    eval_data: str = _opt("", "JSONL held-out data; empty splits --num-eval problems off --data")
    num_eval: int = _opt(300, "held-out problems (split off the data or the embedded task)")
    verifier: str = _opt(
        "auto", "answer check: numeric, exact, or auto (numeric when the answer is a number)", VERIFIERS
    )
    prompt_format: str = _opt(
        "auto", "plain text prompts, the tokenizer's chat template, or auto (chat when it has one)", PROMPT_FORMATS
    )
    # embedded task and its tiny model
    max_operand: int = _opt(99, "embedded task: the first operand is an integer in [0, max_operand]")
    max_second_operand: int = _opt(9, "embedded task: the second operand is an integer in [0, max_second_operand]")
    tiny_layers: int = _opt(2, "embedded model: decoder layers")
    tiny_hidden: int = _opt(128, "embedded model: hidden size (head_dim = hidden / 2)")
    tiny_vocab_size: int = _opt(
        0,
        "embedded model: pad the vocabulary with tokens no prompt or answer uses (each decodes to a non-digit) up "
        "to this size; with --warm-start-label-smoothing they carry a long tail of rare tokens. 0 = no padding",
    )
    warm_start_steps: int = _opt(1000, "embedded model: supervised warm-start steps")
    warm_start_problems: int = _opt(
        600, "embedded task: problems reserved for the warm start (disjoint from RL and eval)"
    )
    warm_start_lr: float = _opt(3e-3, "embedded model: warm-start learning rate")
    warm_start_label_smoothing: float = _opt(
        0.3, "embedded model: warm-start label smoothing (a policy that ranks the answer first but samples it rarely)"
    )
    # RL
    loss: str = _opt(
        "dppo_binary_tv", "policy loss (see dppo_ext.trainer.losses for what each masks and weights)", tuple(LOSSES)
    )
    steps: int = _opt(400, "RL steps (one rollout batch each)")
    prompts_per_step: int = _opt(32, "prompts per rollout batch")
    group_size: int = _opt(16, "samples per prompt (GRPO group)")
    temperature: float = _opt(1.0, "rollout temperature (the trainer scores logits / temperature)")
    max_new_tokens: int = _opt(6, "maximum response tokens")
    top_k: int = _opt(0, "rollout top-K log-probs per token (>= 1 for the top-K losses)")
    top_p: float = _opt(
        1.0,
        "rollout top-p (nucleus) sampling; 1 = off. Truncated sampling (< 1, or --sample-top-k > 0, --min-p > 0) "
        "runs with sampling replay: vLLM returns each position's kept set and the loss renormalises pi over it "
        "(docs/contract.md, 'Truncated sampling'; --engine vllm only)",
    )
    sample_top_k: int = _opt(
        -1, "rollout top-k sampling (vLLM's SamplingParams.top_k; --top-k is the top-K log-probs); -1 or 0 = off"
    )
    min_p: float = _opt(0.0, "rollout min-p sampling; 0 = off")
    sample_logprobs: int = _opt(
        20,
        "truncated sampling: log-probs vLLM returns per position, so that the kept set comes back whole (a position "
        "whose kept set may be larger raises, naming it; top-k sampling with k <= this is always exact)",
    )
    sampling_replay: bool = _opt(
        True,
        "under truncated sampling, score pi renormalised over each position's kept set (docs/contract.md); "
        "--no-sampling-replay scores it over the whole vocabulary, so every ratio carries the kept set's mass: only "
        "to measure that bias (a warning says so each step)",
    )
    adv_std: bool = _opt(True, "divide group advantages by the group std (GRPO); --no-adv-std keeps reward - mean")
    delta_low: typing.Optional[float] = _opt(None, "trust-region threshold for A <= 0 (default: the loss's)")
    delta_high: typing.Optional[float] = _opt(None, "trust-region threshold for A > 0 (default: the loss's)")
    ratio_cap: typing.Optional[float] = _opt(None, "cap on the importance weight (default: the loss's, 10 or uncapped)")
    loss_agg_mode: str = _opt(
        "token-mean",
        "loss aggregation, verl's names (docs/aggregation.md; the -norm modes divide by --max-new-tokens)",
        AGG_MODES,
    )
    lr: float = _opt(1e-4, "AdamW learning rate")
    warmup_steps: int = _opt(20, "linear learning-rate warm-up over the first k RL steps")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    max_grad_norm: float = _opt(1.0, "gradient clipping norm")
    num_minibatches: int = _opt(4, "optimizer steps per epoch over a rollout batch")
    ppo_epochs: int = _opt(2, "passes over each rollout batch")
    micro_batch_size: int = _opt(0, "sequences per forward/backward (gradient accumulation); 0 = whole mini-batch")
    rollout_lag: int = _opt(
        0, "the engine rolls out with the trainer's weights of k steps ago (asynchronous RL); 0 = synced"
    )
    rollout_logit_noise: float = _opt(
        0.0,
        "sigma of Gaussian noise the engine adds to its logits before the temperature: rollouts sample from and "
        "report mu = softmax((z + sigma * eps) / T), eps ~ N(0, I) fresh per token (a training-inference mismatch of "
        "a chosen size; held-out evaluation stays noise-free). 0 = off",
    )
    rollout_weight_bits: int = _opt(
        0,
        "fake-quantise the weights the engine rolls out with to b-bit integers on every sync: every linear layer "
        "but the LM head, one scale per --rollout-weight-group input weights (a precision mismatch that grows as the "
        "policy sharpens; held-out evaluation uses the trainer's weights; dppo_ext.rollout.quantize). 0 = off",
        choices=(0, *ROLLOUT_WEIGHT_BITS),
    )
    rollout_weight_group: int = _opt(128, "input weights per scale of --rollout-weight-bits (GPTQ/AWQ's usual 128)")
    drop_zero_adv: bool = _opt(True, "skip sequences whose advantage is 0 (groups with equal rewards) in the update")
    mechanism_metrics: bool = _opt(
        False,
        "record per step the mask split (first mini-batch / later ones, by rollout probability x advantage "
        "sign) and, after each optimizer step, the post-update drift |pi_new - mu|, the mass negative samples removed "
        "from tokens with mu > 0.5 and the bad-update fraction (dppo_ext.trainer.mechanism; one extra no-grad pass "
        "per mini-batch)",
    )
    # evaluation
    eval_every: int = _opt(25, "held-out accuracy every k steps (also at start and end)")
    eval_samples: int = _opt(2, "samples per held-out prompt (accuracy = mean reward at --eval-temperature)")
    eval_temperature: float = _opt(1.0, "held-out sampling temperature")
    # engines and devices
    engine: str = _opt("auto", "rollout engine: vllm when installed (auto), vllm, or transformers (hf)", ENGINE_KINDS)
    rollout_dtype: str = _opt(
        "float32", "rollout engine dtype (e.g. bfloat16 rollouts for an fp32 trainer)", tuple(MODEL_DTYPES)
    )
    dtype: str = _opt("float32", "trainer parameter dtype", tuple(MODEL_DTYPES))
    logits_dtype: typing.Optional[str] = _opt(
        None,
        "the response logits' dtype; unset: --dtype's. float32 with --dtype bfloat16/float16: the LM head's products "
        "accumulated and kept in float32 from the 16-bit hidden states and weight (an fp32 LM head; TRL's "
        "dppo_logits_dtype; a 16-bit vLLM engine then runs its head in float32 too); refused for a model whose "
        "forward soft-caps or rescales its logits",
        tuple(LOGITS_DTYPE_SETTINGS),
    )
    device: str = _opt("auto", "trainer device: auto (cuda when available), cpu, cuda, cuda:N")
    max_model_len: int = _opt(256, "rollout engine's maximum prompt + response length")
    vllm_gpu_memory_utilization: float = _opt(0.3, "vLLM on GPU: fraction of GPU memory for the engine")
    sync_check: bool = _opt(
        True,
        "vLLM engine: after every weight sync, score the first sequence of the latest rollout in vLLM and with "
        "the trainer's model and stop with an error when their log-probs differ by more than the dtypes explain (a "
        "stale weight or LM head); its cost is each record's sync_check_s. --no-sync-check skips it",
    )
    threads: int = _opt(
        0, "torch CPU threads of the trainer and the in-process vLLM engine; 0 = every CPU this process may use"
    )
    # run management
    out: str = _opt(
        "runs/default",
        "output folder (metrics.jsonl, plot, checkpoint-<step>/, summary.json, and "
        "dppo-run.json: what the trainer wrote there); must be empty unless --resume or --overwrite",
    )
    overwrite: bool = _opt(
        False,
        "start over in --out: once the new run has started, delete what the previous run "
        "wrote there (what its dppo-run.json lists; nothing else)",
    )
    save_every: int = _opt(50, "checkpoint every k steps (and at the end); 0 = only at the end")
    save_total_limit: int = _opt(
        2,
        "keep the newest N checkpoint-<step>/ folders (older ones are deleted once a new one "
        "is complete); 0 = keep all",
    )
    resume: bool = _opt(
        False, "continue the run in --out from its newest complete checkpoint-<step>/ (same flags; --steps may grow)"
    )
    seed: int = _opt(0, "seed for the task split, warm start, prompt order and rollouts")
    # reporting and logging
    report_to: str = _opt(
        "none",
        "metrics sink beside metrics.jsonl and metrics.png: none, or tensorboard (events in "
        "<out>/tensorboard; needs the tensorboard package)",
        REPORT_TARGETS,
    )
    log_level: str = _opt("info", "level of the trainer's own log messages", LOG_LEVELS)
    verbose: bool = _opt(
        False,
        "show vLLM's and transformers' start-up INFO lines, progress bars and the warnings the "
        "trainer otherwise hides as known to be benign",
    )

    @property
    def mode(self) -> str:
        """The ``dppo_loss`` mode of ``--loss``."""
        return LOSS_MODES[self.loss]

    @property
    def uses_topk(self) -> bool:
        """True when the loss needs the rollout's top-K log-probs."""
        return self.loss in TOPK_LOSSES

    @property
    def truncates_sampling(self) -> bool:
        """True when --top-p, --sample-top-k or --min-p truncate the rollout's sampling (the loss replays the kept
        sets)."""
        return bool(sampling_truncation(self.sample_top_k, self.top_p, self.min_p))

    def truncation(self) -> Truncation:
        """The rollout's sampling truncation (--sample-top-k, --top-p, --min-p, --sample-logprobs)."""
        return Truncation(top_k=self.sample_top_k, top_p=self.top_p, min_p=self.min_p, logprobs=self.sample_logprobs)

    @property
    def uses_recompute_anchor(self) -> bool:
        """True when the loss needs log-probs recomputed by the trainer (MiniRL's mask, ``pg_pi_old``'s weight)."""
        return LOSSES[self.loss].recomputes

    @property
    def weights_on_recompute(self) -> bool:
        """True when the loss's weight is pi / pi_old (the op gets the recomputed log-probs in place of mu)."""
        return LOSSES[self.loss].weight == "recompute"

    def loss_settings(self) -> dict[str, object]:
        """The op's delta_low / delta_high / ratio_cap (flags, else the loss's) and the loss's mask settings."""
        spec = LOSSES[self.loss]
        pick = lambda flag, default: default if flag is None else flag  # noqa: E731
        return {
            "delta_low": pick(self.delta_low, spec.delta_low),
            "delta_high": pick(self.delta_high, spec.delta_high),
            "ratio_cap": pick(self.ratio_cap, spec.ratio_cap),
            "mask_direction": spec.mask_direction,
            "kl_tau": spec.kl_tau,
            "sequence_mask": spec.sequence_mask,
        }

    def validate(self) -> TrainConfig:
        """Check every setting; raise ``ValueError`` naming the flag, its value and what is expected."""
        hints = typing.get_type_hints(TrainConfig)
        for name in config_fields():
            _check_type(name, hints[name], getattr(self, name))
        for name, f in config_fields().items():
            choices = f.metadata.get("choices")
            if choices and getattr(self, name) not in (*choices, None):  # None: an Optional field unset (typed above)
                raise ValueError(
                    f"--{flag_name(name)}: unknown value {getattr(self, name)!r}; expected one of {list(choices)}"
                )
        for bound, names in RANGES:
            for name in names.split():
                value = getattr(self, name)
                if value is not None and value not in bound:  # None: the loss's default
                    raise ValueError(f"--{flag_name(name)} must be {bound}, got {value}")
        if self.max_new_tokens >= self.max_model_len:
            raise ValueError(
                f"--max-new-tokens={self.max_new_tokens} leaves no room for the prompt in --max-model-len="
                f"{self.max_model_len}; expected max_new_tokens < max_model_len"
            )
        unpadded = len(SPECIAL_TOKENS) + len(ARITHMETIC_ALPHABET)
        if self.tiny_vocab_size < 0 or 0 < self.tiny_vocab_size < unpadded:
            raise ValueError(
                f"--tiny-vocab-size must be 0 (no padding) or >= {unpadded} (the embedded model's own "
                f"tokens), got {self.tiny_vocab_size}"
            )
        if self.model and self.tiny_vocab_size:
            raise ValueError(
                f"--tiny-vocab-size={self.tiny_vocab_size} pads the embedded model's vocabulary; it does "
                f"not apply to --model {self.model!r}: drop it"
            )
        heads = tiny_heads(self.tiny_hidden)
        if not self.model and (
            self.tiny_hidden % heads or (self.tiny_hidden // heads) % 2 or self.tiny_hidden // heads < 32
        ):
            raise ValueError(
                f"--tiny-hidden={self.tiny_hidden} gives the embedded model {heads} head(s) of "
                f"{self.tiny_hidden / heads:g} dims; expected whole, even heads of >= 32 dims "
                "(heads = max(1, hidden // 64)): use a multiple of 64, or an even number in [32, 126]"
            )
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume and --overwrite contradict each other: --resume continues the run in --out, "
                "--overwrite deletes it; pass one"
            )
        truncating = sampling_truncation(
            self.sample_top_k,
            self.top_p,
            self.min_p,
            names={"top_k": "--sample-top-k", "top_p": "--top-p", "min_p": "--min-p"},
        )
        if truncating and self.engine == "hf":
            settings = ", ".join(f"{name}={value!r}" for name, value in truncating.items())
            raise ValueError(
                f"{settings} truncates the sampling, which only --engine vllm replays (it returns each position's "
                "kept set); use --engine vllm, or sample from the whole distribution with --top-p 1 "
                "--sample-top-k -1 --min-p 0"
            )
        if self.uses_topk and self.top_k < 1:
            raise ValueError(
                f"--loss {self.loss} needs the rollout's top-K log-probs: --top-k must be >= 1, got {self.top_k}"
            )
        batch = self.prompts_per_step * self.group_size
        if self.num_minibatches > batch:
            raise ValueError(
                f"--num-minibatches={self.num_minibatches} exceeds the rollout batch of "
                f"prompts_per_step * group_size = {batch} sequences"
            )
        if self.model and not _looks_like_hub_id(self.model) and not Path(self.model).is_dir():
            raise ValueError(
                f"--model {self.model!r}: no such folder, and not a hub id of the form 'org/name'; "
                "pass a Hugging Face model folder or hub id, or leave it empty for the embedded model"
            )
        for name in ("data", "eval_data"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"--{flag_name(name)} {path!r}: no such file (expected a JSONL file)")
        if self.eval_data and not self.data:
            raise ValueError("--eval-data needs --data (the embedded task has its own held-out set)")
        if self.model and not self.data:
            raise ValueError(
                f"--model {self.model!r} needs --data (the embedded arithmetic task is for the embedded tiny "
                "model; --help under --data shows how to write it as JSONL)"
            )
        if self.data and not self.model:
            raise ValueError(
                f"--data {self.data!r} needs --model (the embedded tiny model knows only the embedded "
                "arithmetic task's characters); pass --model, or drop --data for the embedded task"
            )
        return self

    def to_dict(self) -> dict:
        """The settings as a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One ``name = value`` line per setting that applies to this run (printed at the start of a run): with
        ``--model`` the embedded model's and task's settings (``EMBEDDED_ONLY``) are left out."""
        shown = {name: value for name, value in self.to_dict().items() if not (self.model and name in EMBEDDED_ONLY)}
        lines = [f"  {flag_name(name):<28} {value!r}" for name, value in shown.items()]
        if self.model:
            lines.append(f"  ({len(EMBEDDED_ONLY)} settings of the embedded model and task do not apply to --model)")
        return "\n".join(lines)


# The ranges of the numeric settings, checked in this order by TrainConfig.validate (the first range a value
# leaves names the error: --rollout-logit-noise=-1 must be >= 0, =2000 in [0, MAX_LOGIT_NOISE]).
RANGES: tuple[tuple[Range, str], ...] = (
    (
        Range(1),
        "num_eval max_operand max_second_operand tiny_layers tiny_hidden warm_start_problems steps prompts_per_step "
        "max_new_tokens num_minibatches ppo_epochs eval_every eval_samples max_model_len rollout_weight_group",
    ),
    (
        Range(0),
        "warm_start_steps warmup_steps micro_batch_size save_every save_total_limit threads top_k rollout_lag "
        "sample_logprobs",
    ),
    (Range(0, low_open=True), "temperature eval_temperature lr warm_start_lr max_grad_norm ratio_cap"),
    (Range(0), "delta_low delta_high weight_decay rollout_logit_noise"),
    (
        Range(0, MAX_LOGIT_NOISE, why="sigma of the rollout logit noise; more would overflow the engine's logits"),
        "rollout_logit_noise",
    ),
    (Range(0, 1, high_open=True), "warm_start_label_smoothing"),
    (Range(0, 2**32, high_open=True, why="NumPy's seed range"), "seed"),
    (Range(2, why="group advantages compare samples of the same prompt"), "group_size"),
    (Range(0, 1, low_open=True), "vllm_gpu_memory_utilization"),
)


# Settings only the embedded tiny model and its arithmetic task read (their help says so); --model runs ignore them.
EMBEDDED_ONLY = tuple(
    f.name
    for f in dataclasses.fields(TrainConfig)
    if f.metadata["help"].startswith(("embedded model:", "embedded task:"))
)


def _check_type(name: str, kind, value) -> None:
    """Raise ``ValueError`` unless ``value`` fits the field's type (numbers: finite)."""
    kind, optional = inner_type(kind)
    if optional and value is None:
        return
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):
            raise ValueError(f"--{flag_name(name)} must be a finite number, got {value}")
    else:
        ok = isinstance(value, kind)
    if not ok:
        expected = kind.__name__ + (" or None" if optional else "")
        raise ValueError(f"--{flag_name(name)} must be {expected}, got {value!r} ({type(value).__name__})")


def inner_type(kind) -> tuple[type, bool]:
    """``(T, True)`` for a field typed ``Optional[T]``, else ``(kind, False)``."""
    if typing.get_origin(kind) is typing.Union:
        return next(a for a in typing.get_args(kind) if a is not type(None)), True
    return kind, False


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~")) and not Path(name).exists()


def config_fields() -> dict[str, dataclasses.Field]:
    """``TrainConfig``'s fields by name (the CLI's flags, in order)."""
    return {f.name: f for f in dataclasses.fields(TrainConfig)}


def flag_name(name: str) -> str:
    """A setting's command-line spelling, without the dashes: ``rollout_lag`` -> ``rollout-lag``."""
    return name.replace("_", "-")

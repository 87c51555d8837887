"""Command-line entry point of the reference RL trainer (``python -m dppo_ext.train`` / ``dppo-train``).

Default run (no flags): builds the embedded tiny model and arithmetic task, warm-starts the model
with a short supervised fine-tune, then trains it with DPPO (binary TV) from vLLM rollouts
(transformers ``generate`` when vLLM is absent). With ``--model`` and ``--data`` the same code
trains any Hugging Face causal LM on a JSONL task.

Outputs in ``--out``: ``dppo-run.json`` (the run manifest: every file and folder the trainer
wrote there), ``config.json``, ``inputs.json`` (SHA-256 of the data files), ``metrics.jsonl``,
``metrics.png``, ``summary.json``, ``checkpoint-<step>/`` (the newest ``--save-total-limit``),
``base_model/`` for the embedded model and ``tensorboard/`` with ``--report-to tensorboard``.
The rules of the folder (``dppo_ext.trainer.run_dir``, docs/run_folder.md):

- a fresh run needs an empty or missing ``--out``; ``--resume`` continues the run recorded in it
  from its newest complete checkpoint; ``--overwrite`` deletes exactly what its manifest lists
  and starts over. A non-empty folder without a manifest is refused untouched, except that
  ``--resume`` continues a run of a dppo-train older than the manifest after recognising each of
  that trainer's outputs by its content (``legacy_run_outputs``);
- ``--out`` may not be, contain or lie inside ``--model``, ``--data`` or ``--eval-data``;
- the setup (data, warm start, top-K check, engine start, model load, checkpoint restore) writes
  nothing into ``--out``: a failure or Ctrl-C before the first training step leaves the folder
  as it was (a folder the run created is removed again), and ``--overwrite`` deletes the
  previous run only once the new one has started;
- ``--resume --steps S`` below the newest checkpoint's step is an error that changes nothing; S
  equal to it trains nothing: a no-op when ``summary.json`` reports S steps, else the run's plot
  and summary are completed from its records (the run stopped after its last save).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dppo_ext.models.sft import WarmStartConfig, supervised_warm_start
from dppo_ext.models.tiny import TinyModelConfig, build_tiny_model
from dppo_ext.rollout import RolloutEngine, make_engine, vllm_available
from dppo_ext.rollout.vllm_logging import quiet_vllm_logging, verbose_vllm_logging
from dppo_ext.tasks import DataFormatError, Task, load_jsonl_task, make_arithmetic_task
from dppo_ext.trainer.checkpoint import (
    CHECKPOINT_PREFIX,
    LEGACY_DIRS,
    MODEL_DIR,
    NoCheckpointError,
    check_model_folder,
    checkpoint_step,
    find_resume_checkpoint,
    has_checkpoint,
    load_trainer_state,
)
from dppo_ext.trainer.checkpoint import (
    MANIFEST_FILE as CHECKPOINT_MANIFEST,
)
from dppo_ext.trainer.config import TrainConfig, parse_config, resume_config_changes, tiny_heads
from dppo_ext.trainer.loop import Trainer
from dppo_ext.trainer.metrics import DROPPED_FILE, MetricsFormatError, prepare_for_resume, read_metrics
from dppo_ext.trainer.plotting import plot_metrics
from dppo_ext.trainer.reporting import TENSORBOARD_DIR, check_report_to
from dppo_ext.trainer.run_dir import (
    EMBEDDED_MODEL_DIR,
    RunError,
    RunFolder,
    atomic_write_text,
    check_out_apart,
    fsync_dir,
    open_run_dir,
    temporary_sibling,
)

logger = logging.getLogger("dppo_ext.train")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_START_MARKER = "warm_start.json"
CONFIG_FILE = "config.json"
INPUTS_FILE = "inputs.json"  # SHA-256 of --data / --eval-data, checked on --resume
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"
SUMMARY_FILE = "summary.json"


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global RNGs."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else is passed to ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available on this machine; use --device cpu")
    return device


def build_task(config: TrainConfig) -> Task:
    """The embedded arithmetic task, or the JSONL task of ``--data`` / ``--eval-data``."""
    if config.data:
        return load_jsonl_task(
            config.data,
            eval_path=config.eval_data or None,
            num_eval=config.num_eval,
            verifier=config.verifier,
            seed=config.seed,
        )
    return make_arithmetic_task(
        max_operand=config.max_operand,
        max_second_operand=config.max_second_operand,
        num_eval=config.num_eval,
        num_sft=config.warm_start_problems,
        seed=config.seed,
    )


def warm_start_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings that make the embedded model's warm start (recorded in its ``warm_start.json``)."""
    names = ("tiny_layers", "tiny_hidden", "tiny_vocab_size", "warm_start_steps", "warm_start_problems",
             "warm_start_lr", "warm_start_label_smoothing", "max_operand", "max_second_operand", "num_eval", "seed")
    return {name: getattr(config, name) for name in names}


def warm_start_matches(folder: str | Path, config: TrainConfig) -> bool:
    """True when ``folder`` holds an embedded model warm-started with ``config``'s settings."""
    marker = Path(folder) / WARM_START_MARKER
    try:
        return marker.is_file() and json.loads(marker.read_text()).get("settings") == warm_start_settings(config)
    except (OSError, ValueError, AttributeError):
        return False


def build_embedded_model(folder: Path, config: TrainConfig, task: Task) -> Path:
    """Build the tiny model and warm-start it on ``task.sft`` into the new folder ``folder``.

    ``folder`` is a normal ``save_pretrained`` model + tokenizer with ``warm_start.json`` (the
    settings, final loss, seconds) written last. An interrupted build (an error or Ctrl-C) removes
    the folder; one killed outright leaves it without ``warm_start.json``, never reusable.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if folder.exists():
        shutil.rmtree(folder)
    try:
        heads = tiny_heads(config.tiny_hidden)
        build_tiny_model(
            folder,
            config=TinyModelConfig(hidden_size=config.tiny_hidden, num_layers=config.tiny_layers, num_heads=heads),
            seed=config.seed,
            vocab_size=config.tiny_vocab_size,
        )
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        start = time.perf_counter()
        logger.info("supervised warm start: %d steps on %d problems", config.warm_start_steps, len(task.sft))
        losses = supervised_warm_start(
            model, tokenizer, task.sft, WarmStartConfig(steps=config.warm_start_steps, lr=config.warm_start_lr,
                                             label_smoothing=config.warm_start_label_smoothing, seed=config.seed)
        )
        model.save_pretrained(folder)
        seconds = time.perf_counter() - start
        atomic_write_text(
            folder / WARM_START_MARKER,
            json.dumps({"settings": warm_start_settings(config), "final_loss": losses[-1] if losses else None,
                        "seconds": seconds}, indent=2),
        )
        fsync_dir(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    logger.info("warm start done in %.1f s (final loss %s)", seconds, f"{losses[-1]:.4f}" if losses else "n/a")
    return folder


def install_folder(built: Path, folder: Path) -> Path:
    """Rename the complete folder ``built`` to ``folder``, replacing what is there only once it is in place."""
    if folder.exists():
        old = temporary_sibling(folder, "old")
        os.rename(folder, old)
        os.rename(built, folder)
        shutil.rmtree(old)
    else:
        os.rename(built, folder)
    fsync_dir(folder.parent)
    return folder


def prepare_embedded_model(folder: Path, config: TrainConfig, task: Task) -> Path:
    """The warm-started embedded model in ``folder``: reused when its ``warm_start.json`` records
    ``config``'s settings, else built (``build_embedded_model``) in a temporary sibling that replaces
    ``folder`` only when complete, so an interrupted build never leaves a folder that looks reusable."""
    if warm_start_matches(folder, config):
        logger.info("reusing the warm-started embedded model in %s", folder)
        return folder
    built = build_embedded_model(temporary_sibling(folder), config, task)
    if folder.exists():
        logger.warning("rebuilding %s: it was built with other settings (%s)", folder, folder / WARM_START_MARKER)
    return install_folder(built, folder)


def engine_kind(config: TrainConfig) -> str:
    """The rollout engine ``--engine`` selects: ``auto`` is vllm when installed, else hf."""
    if config.engine == "auto":
        return "vllm" if vllm_available() else "hf"
    return config.engine


def make_rollout_engine(config: TrainConfig, model_path: str, device: torch.device):
    """The rollout engine of ``--engine`` on ``model_path``."""
    kind = engine_kind(config)
    kwargs: dict[str, Any] = {}
    if kind == "vllm":
        kwargs["gpu_memory_utilization"] = config.vllm_gpu_memory_utilization
        if config.uses_topk:
            kwargs["max_logprobs"] = max(20, config.top_k)
        if not config.verbose:
            kwargs["use_tqdm_on_load"] = False
    else:
        kwargs["device"] = str(device)
    return make_engine(
        kind, model_path, dtype=config.rollout_dtype, seed=config.seed, max_model_len=config.max_model_len, **kwargs
    )


def summarize(out_dir: Path, config: TrainConfig, engine_name: str, wall_s: float, train_s: float) -> dict[str, Any]:
    """Start/end held-out accuracy and timings from ``metrics.jsonl``."""
    evals = [(r["step"], r["eval_acc"]) for r in read_metrics(out_dir / METRICS_FILE) if r.get("eval_acc") is not None]
    start_acc = evals[0][1] if evals and evals[0][0] == 0 else None
    end_acc = evals[-1][1] if evals else None
    return {
        "loss": config.loss,
        "engine": engine_name,
        "steps": config.steps,
        "start_acc": start_acc,
        "end_acc": end_acc,
        "gain": None if start_acc is None or end_acc is None else end_acc - start_acc,
        "wall_s": wall_s,
        "train_s": train_s,
        "metrics": str(out_dir / METRICS_FILE),
        "plot": str(out_dir / PLOT_FILE),
    }


def check_resume_config(out_dir: Path, config: TrainConfig) -> None:
    """Refuse to resume with settings that differ from the run's ``config.json`` (what it trains)."""
    path = out_dir / CONFIG_FILE
    if not path.is_file():
        logger.warning("--resume: %s is missing; the settings cannot be compared with the original run's", path)
        return
    saved = _read_json_object(path)
    changes = resume_config_changes(saved, config)
    if changes:
        raise RunError(
            f"--resume: settings differ from the run's {path}: {'; '.join(changes)}. A resumed run continues with "
            "its original settings: pass the same flags (only --steps, --save-every, --save-total-limit, --threads, "
            "--device and --vllm-gpu-memory-utilization may change), or --overwrite to start over"
        )
    inputs_path = out_dir / INPUTS_FILE
    if inputs_path.is_file():
        saved_inputs = _read_json_object(inputs_path)
        for flag, now in data_fingerprints(config).items():
            before = saved_inputs.get(flag)
            if before is not None and before["sha256"] != now["sha256"]:
                raise RunError(
                    f"--resume: --{flag.replace('_', '-')} {now['path']!r} changed since the run started (its SHA-256 "
                    f"differs from the one in {inputs_path}); a resumed run must see the same problems: restore "
                    "the file, or pass --overwrite to start over"
                )


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    except ValueError as err:
        raise RunError(f"{path}: unreadable ({err}); the resumed run cannot be checked against it") from None
    return data


def data_fingerprints(config: TrainConfig) -> dict[str, dict[str, str]]:
    """``{flag: {"path", "sha256"}}`` of the ``--data`` / ``--eval-data`` files of ``config``."""
    fingerprints = {}
    for flag in ("data", "eval_data"):
        path = getattr(config, flag)
        if path:
            fingerprints[flag] = {"path": path, "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest()}
    return fingerprints


# Settings every dppo-train version wrote into config.json: with only known settings besides, the file is one.
_CONFIG_CORE = ("model", "data", "loss", "steps", "seed", "out")


def _json_object_or_none(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_train_config(path: Path) -> bool:
    data = _json_object_or_none(path)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    return data is not None and set(_CONFIG_CORE) <= data.keys() <= known


def _is_metrics_file(path: Path) -> bool:
    try:
        read_metrics(path, allow_truncated_tail=True)
    except (OSError, MetricsFormatError):
        return False
    return True


def _is_checkpoint_of_its_step(path: Path) -> bool:
    try:
        step = int(path.name[len(CHECKPOINT_PREFIX):])
        return (path / CHECKPOINT_MANIFEST).is_file() and checkpoint_step(path) == step
    except (RunError, ValueError):
        return False


# name: (kind, content check, what dppo-train writes there, whether a resumed run writes, reads or deletes it)
_LEGACY_OUTPUTS: dict[str, tuple[str, Any, str, bool]] = {
    CONFIG_FILE: ("file", _is_train_config, "its settings (a JSON object of dppo-train settings)", True),
    INPUTS_FILE: ("file", lambda p: (d := _json_object_or_none(p)) is not None
                  and all(isinstance(v, dict) and "sha256" in v for v in d.values()), "the data files' SHA-256", True),
    SUMMARY_FILE: ("file", lambda p: (d := _json_object_or_none(p)) is not None and {"loss", "steps"} <= d.keys(),
                   "the run's summary (a JSON object with 'loss' and 'steps')", True),
    METRICS_FILE: ("file", _is_metrics_file, "one JSON record per line, each with an integer 'step'", True),
    DROPPED_FILE: ("file", _is_metrics_file, "one JSON record per line, each with an integer 'step'", True),
    PLOT_FILE: ("file", lambda p: p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "a PNG plot", True),
    TENSORBOARD_DIR: ("dir", lambda p: all(f.name.startswith("events.out.tfevents.") for f in p.rglob("*")
                                           if f.is_file()), "TensorBoard event files only", True),
    EMBEDDED_MODEL_DIR: ("dir", lambda p: (p / WARM_START_MARKER).is_file(),
                         f"the embedded model with its {WARM_START_MARKER}", False),
    **{name: ("dir", has_checkpoint, "a checkpoint of the earlier layout", False) for name in LEGACY_DIRS},
}
_LEGACY_CHECKPOINT = ("dir", _is_checkpoint_of_its_step, "a complete checkpoint with its checkpoint.json", True)


def legacy_run_outputs(out_dir: Path) -> dict[str, str]:
    """``{name: kind}`` of what a dppo-train older than the run manifest wrote in ``out_dir``, each
    recognised by its content (``--resume`` of such a run records them in its new manifest).

    The folder is such a run only when its ``config.json`` is a dppo-train config: a JSON object
    whose keys are all settings of ``TrainConfig`` and include those every version wrote. Then an
    entry with the name of one of that trainer's outputs is adopted when it holds what the trainer
    writes there (a ``checkpoint-<step>/`` folder a ``checkpoint.json`` of that step, ``metrics.jsonl``
    records, ...). One that does not is the user's: refused when the resumed run would write, read
    or delete it (``config.json``, ``summary.json``, ``metrics.*``, ``inputs.json``, ``tensorboard/``,
    ``checkpoint-<step>/``), else left out (``base_model/``, the earlier ``checkpoint/`` folders).
    Every other entry is not adopted either, and stays untouched.

    Raises:
        RunError: the folder is not such a run, or one of those names holds something else (named);
            nothing is changed.
    """
    config = out_dir / CONFIG_FILE
    if config.is_symlink() or not config.is_file() or not _is_train_config(config):
        why = "has no config.json" if not config.exists() else "its config.json is not a dppo-train config"
        raise RunError(
            f"--resume: --out {str(out_dir)!r} has no dppo-run.json (the record of what dppo-train wrote there) and is "
            f"not a run of an earlier dppo-train either ({why}): nothing was changed; pass the --out of a run"
        )
    adopted = {}
    for path in sorted(out_dir.iterdir()):
        name = path.name
        if name.startswith(CHECKPOINT_PREFIX) and name[len(CHECKPOINT_PREFIX):].isdigit():
            kind, check, what, used = _LEGACY_CHECKPOINT
        elif name in _LEGACY_OUTPUTS:
            kind, check, what, used = _LEGACY_OUTPUTS[name]
        else:
            continue
        if not path.is_symlink() and path.is_dir() == (kind == "dir") and check(path):
            adopted[name] = kind
        elif used:
            raise RunError(
                f"--resume: --out {str(out_dir)!r} is a run of a dppo-train older than the run manifest, but "
                f"{str(path)!r} is not what that trainer writes there ({kind}: {what}), and the resumed run would "
                "use it; nothing was changed. Move it out of the folder and resume again"
            )
    return adopted


def run(
    config: TrainConfig, *, progress: bool = True, engine: RolloutEngine | None = None,
    base_model: str | Path | None = None,
) -> dict[str, Any]:
    """Run a full training job for a validated ``config``; return the summary dict.

    ``engine``: an already started rollout engine to reuse (e.g. one vLLM engine for a series of
    runs); its weights are replaced by the run's and the caller closes it. It must have been
    started with ``config.rollout_dtype``. Default: start one for this run and close it after.

    ``base_model``: for the embedded model, a folder that ``prepare_embedded_model`` built with
    this config's warm-start settings, to start from instead of building ``<out>/base_model``
    (a sweep shares one warm start among its runs). Not copied into ``--out``.

    A ``--resume --steps S`` run already at step S returns its ``summary.json`` with
    ``"nothing_to_do": True`` added (nothing is written).

    Raises:
        RunError: ``--out`` may not be used (not empty without a run manifest, holds a run without
            ``--resume``/``--overwrite``, overlaps an input, held by another trainer), ``--model``
            holds no readable model, ``--steps`` is below the resumed checkpoint, or
            (``CheckpointError``) ``--resume`` finds no usable checkpoint; the message names the
            file and what to do. ``--out`` is left as it was.
        DataFormatError: ``--data``/``--eval-data`` is malformed (file and line in the message).
    """
    wall_start = time.perf_counter()
    out_dir = Path(config.out)
    try:
        check_report_to(config.report_to)
    except ImportError as err:
        raise RunError(str(err)) from None
    set_library_verbosity(verbose=config.verbose)
    check_out_apart(config.out, {"--model": config.model, "--data": config.data, "--eval-data": config.eval_data})
    if config.model and Path(config.model).is_dir():
        check_model_folder(config.model, what="--model")
    if base_model is not None and not warm_start_matches(base_model, config):
        raise ValueError(f"run(base_model={str(base_model)!r}): it holds no embedded model warm-started with this "
                         f"config's settings ({WARM_START_MARKER}); build it with prepare_embedded_model")
    if config.resume and not out_dir.is_dir():
        raise NoCheckpointError(f"--resume: no complete checkpoint in {str(out_dir)!r}: the folder does not exist")
    device = resolve_device(config.device)
    # Inputs are checked before --out is touched: a run refused for bad data leaves no folder behind.
    task = build_task(config)
    logger.info("task %s: %d training / %d held-out problems", task.name, len(task.train), len(task.eval))
    with open_run_dir(out_dir, resume=config.resume, overwrite=config.overwrite, adopt=legacy_run_outputs) as folder:
        return _run_locked(config, task, device, folder, wall_start, progress=progress, engine=engine,
                           base_model=base_model)


def check_top_k(config: TrainConfig, model_path: str | None) -> None:
    """Refuse a ``--top-k`` larger than the model's vocabulary (the engines cannot return it)."""
    if not config.uses_topk or not model_path:
        return
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
    if vocab is not None and config.top_k > vocab:
        raise RunError(f"--top-k={config.top_k} exceeds the vocabulary of {model_path!r} ({vocab} tokens); "
                       f"expected 1 <= top_k <= {vocab}")


def _resume_point(config: TrainConfig, out_dir: Path) -> tuple[Path, int]:
    """The checkpoint ``--resume`` continues from and its step; refuse a ``--steps`` below that step."""
    checkpoint_dir = find_resume_checkpoint(out_dir)
    check_resume_config(out_dir, config)
    step = checkpoint_step(checkpoint_dir)
    if config.steps < step:
        raise RunError(
            f"--resume --steps {config.steps}: the newest checkpoint {str(checkpoint_dir)!r} is already at step "
            f"{step}, and a resumed run cannot go back; nothing was changed. Pass --steps {step} or more to continue "
            f"it (--steps {step}: nothing to train), or --overwrite to train {config.steps} steps from the start"
        )
    return checkpoint_dir, step


def _run_locked(
    config: TrainConfig, task: Task, device: torch.device, folder: RunFolder, wall_start: float, *, progress: bool,
    engine: RolloutEngine | None, base_model: str | Path | None,
) -> dict[str, Any]:
    # Set-up: until folder.commit() nothing is written into --out but temporaries (the warm start
    # builds in one), so a failure or Ctrl-C here leaves the folder as it was (RunFolder's rollback).
    out_dir = folder.path
    checkpoint_dir = None
    if config.resume:
        checkpoint_dir, step = _resume_point(config, out_dir)
        if step == config.steps:
            return _nothing_to_train(config, folder, checkpoint_dir, task.name, wall_start)
    check_top_k(config, str(checkpoint_dir / MODEL_DIR) if checkpoint_dir is not None else config.model or None)
    torch.set_num_threads(resolve_threads(config.threads))
    seed_everything(config.seed)
    built = None  # a new warm start, installed as <out>/base_model at commit
    keep: tuple[str, ...] = ()
    if checkpoint_dir is not None:
        policy_path = str(checkpoint_dir / MODEL_DIR)
    elif config.model:
        policy_path = config.model
    elif base_model is not None:
        policy_path = str(base_model)
    else:
        target = out_dir / EMBEDDED_MODEL_DIR
        if warm_start_matches(target, config):
            logger.info("reusing the warm-started embedded model in %s", target)
            policy_path, keep = str(target), (EMBEDDED_MODEL_DIR,)
        elif target.exists() and EMBEDDED_MODEL_DIR not in folder.outputs:
            raise RunError(f"{str(target)!r} was not written by this run's trainer (it is not in dppo-run.json) and "
                           "holds another model than this run's warm start; move it out of --out, or pass another "
                           "--out")
        else:
            built = build_embedded_model(temporary_sibling(target), config, task)
            policy_path = str(built)
        check_top_k(config, policy_path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    own_engine = engine is None
    if engine is None:
        engine = make_rollout_engine(config, policy_path, device)
    elif str(getattr(engine, "dtype", config.rollout_dtype)).removeprefix("torch.") != config.rollout_dtype:
        raise ValueError(f"run(engine=...): the engine runs in {engine.dtype}, but --rollout-dtype is {config.rollout_dtype}")
    try:
        # vLLM reseeds torch's global RNG while starting: seed (or restore) after the engine exists.
        seed_everything(config.seed)
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=TORCH_DTYPES[config.dtype]).to(device).eval()
        if not own_engine:
            engine.sync_weights(model)
        trainer = Trainer(config, model, tokenizer, task, engine, out_dir)
        if config.resume:
            trainer.restore(checkpoint_dir)
            logger.info("resumed from %s at step %d", checkpoint_dir, trainer.step)
        # The run starts: what it writes from here on stays (a later failure leaves a run to --resume).
        outputs = {CONFIG_FILE: "file", METRICS_FILE: "file"}
        if checkpoint_dir is None:
            outputs[INPUTS_FILE] = "file"
        if built is not None:
            outputs[EMBEDDED_MODEL_DIR] = "dir"
        if config.report_to == "tensorboard":
            outputs[TENSORBOARD_DIR] = "dir"
        folder.commit(outputs, keep=keep if built is None else (built.name,))
        if built is not None:
            install_folder(built, out_dir / EMBEDDED_MODEL_DIR)
        atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))
        if checkpoint_dir is None:
            atomic_write_text(out_dir / INPUTS_FILE, json.dumps(data_fingerprints(config), indent=2))
        result = trainer.run(progress=progress)
    finally:
        if own_engine:
            engine.close()
    return _write_summary(config, folder, engine.name, task.name, wall_start, result["elapsed_s"])


def _write_summary(
    config: TrainConfig, folder: RunFolder, engine_name: str, task_name: str, wall_start: float, train_s: float,
) -> dict[str, Any]:
    out_dir = folder.path
    folder.record(PLOT_FILE, "file")
    plot_metrics(out_dir / METRICS_FILE, out_dir / PLOT_FILE, title=f"{task_name}: {config.loss} ({engine_name})")
    summary = summarize(out_dir, config, engine_name, time.perf_counter() - wall_start, train_s)
    folder.record(SUMMARY_FILE, "file")
    atomic_write_text(out_dir / SUMMARY_FILE, json.dumps(summary, indent=2))
    return summary


def _nothing_to_train(
    config: TrainConfig, folder: RunFolder, checkpoint_dir: Path, task_name: str, wall_start: float,
) -> dict[str, Any]:
    """``--resume --steps S`` where the newest checkpoint is at step S: no engine, no training.

    A run whose ``summary.json`` reports S steps is complete: nothing is written. Otherwise the run
    stopped after its last save, before its summary: its records are repaired as on any resume
    (those of later steps move to ``metrics.dropped.jsonl``) and its config, plot and summary written.
    """
    out_dir = folder.path
    saved = _json_object_or_none(out_dir / SUMMARY_FILE)
    if saved is not None and saved.get("steps") == config.steps:
        logger.warning("--resume --steps %d: %s is already at step %d and its %s reports it; nothing to train, "
                       "nothing changed", config.steps, checkpoint_dir, config.steps, SUMMARY_FILE)
        return {**saved, "nothing_to_do": True}
    logger.warning("--resume --steps %d: %s is already at step %d; nothing to train, writing the run's missing %s",
                   config.steps, checkpoint_dir, config.steps, SUMMARY_FILE)
    folder.commit({CONFIG_FILE: "file"})
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))
    prepare_for_resume(out_dir / METRICS_FILE, config.steps)
    elapsed = float(load_trainer_state(checkpoint_dir)["elapsed_s"])
    return _write_summary(config, folder, engine_kind(config), task_name, wall_start, elapsed)


def resolve_threads(threads: int) -> int:
    """``--threads``: a positive count as given; 0 = the CPUs this process may run on."""
    if threads > 0:
        return threads
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def restart_with_passive_omp_waits(config: TrainConfig) -> None:
    """Restart the CLI once with ``OMP_WAIT_POLICY=PASSIVE`` when it will run more than one thread.

    OpenMP's default lets idle threads spin; on a CPU shared with other work a spinning thread holds a
    core that the thread it waits for needs, and the tiny model's forward/backward ran ~10x slower on 2
    threads than on 1 on this project's 2-core machine under load, while with passive waits 2 threads
    were ~2x faster than 1. The setting is read when OpenMP loads (with torch), hence the restart; a
    value already in the environment is kept.
    """
    if resolve_threads(config.threads) <= 1 or "OMP_WAIT_POLICY" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, "-m", "dppo_ext.train", *sys.argv[1:]])


def set_library_verbosity(*, verbose: bool) -> None:
    """Quiet (default) or verbose vLLM and transformers.

    Quiet: vLLM at WARNING without the warnings known to be benign here
    (``dppo_ext.rollout.vllm_logging``), no transformers / Hugging Face Hub progress bars.
    Verbose: vLLM at INFO with every warning, transformers at INFO, progress bars on.
    """
    from transformers.utils import logging as hf_logging

    if verbose:
        verbose_vllm_logging()
        hf_logging.set_verbosity_info()
        hf_logging.enable_progress_bar()
    else:
        quiet_vllm_logging()
        hf_logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
        return
    (enable_progress_bars if verbose else disable_progress_bars)()


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    try:
        config = parse_config(argv)
    except ValueError as err:
        print(f"dppo-train: error: {err}", file=sys.stderr)
        return 2
    if argv is None:  # the real command line (not a call from Python): it may restart itself once
        restart_with_passive_omp_waits(config)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print("dppo-train settings:\n" + config.describe(), flush=True)
    try:
        summary = run(config)
    except KeyboardInterrupt:
        print("dppo-train: interrupted (stopped during its set-up, a run leaves --out as it was; stopped while "
              "training, it continues with --resume from its newest checkpoint)", file=sys.stderr)
        return 130
    except (RunError, DataFormatError, MetricsFormatError) as err:
        print(f"dppo-train: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a setting the run cannot use (e.g. --num-eval beyond the data, --device cuda without one)
        logger.debug("dppo-train: the run stopped on a ValueError", exc_info=True)
        print(f"dppo-train: error: {err} (--log-level debug shows where it was raised)", file=sys.stderr)
        return 2
    if summary.get("nothing_to_do"):
        print(f"dppo-train: nothing to do: {config.out!r} is already trained to step {config.steps} (its "
              "summary.json); pass a larger --steps to train on", flush=True)
        return 0
    acc = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    print(
        f"dppo-train done: {summary['loss']} with {summary['engine']} rollouts, {summary['steps']} steps: "
        f"held-out accuracy {acc(summary['start_acc'])} -> {acc(summary['end_acc'])} "
        f"in {summary['wall_s']:.0f} s wall (plot: {summary['plot']})",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

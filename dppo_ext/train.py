"""Command-line entry point of the reference RL trainer (``python -m dppo_ext.train`` / ``dppo-train``).

Default run (no flags): builds the embedded tiny model and arithmetic task, warm-starts the model
with a short supervised fine-tune, then trains it with DPPO (binary TV) from vLLM rollouts
(transformers ``generate`` when vLLM is absent). With ``--model`` and ``--data`` the same code
trains any Hugging Face causal LM on a JSONL task.

Outputs in ``--out``: ``config.json``, ``inputs.json`` (SHA-256 of the data files),
``metrics.jsonl``, ``metrics.png``, ``summary.json``, ``checkpoint-<step>/`` (the newest
``--save-total-limit``) and ``base_model/`` for the embedded model. A non-empty ``--out`` is
refused unless ``--resume`` (continue from the newest complete checkpoint) or ``--overwrite``
(delete the previous outputs); one trainer at a time holds the folder's lock
(``dppo_ext.trainer.run_dir``).
"""

from __future__ import annotations

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
from dppo_ext.trainer.checkpoint import MODEL_DIR, NoCheckpointError, check_model_folder, find_resume_checkpoint
from dppo_ext.trainer.config import TrainConfig, parse_config, resume_config_changes, tiny_heads
from dppo_ext.trainer.loop import Trainer
from dppo_ext.trainer.metrics import MetricsFormatError, read_metrics
from dppo_ext.trainer.plotting import plot_metrics
from dppo_ext.trainer.reporting import check_report_to
from dppo_ext.trainer.run_dir import RunError, atomic_write_text, fsync_dir, open_run_dir

logger = logging.getLogger("dppo_ext.train")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_START_MARKER = "warm_start.json"
INPUTS_FILE = "inputs.json"  # SHA-256 of --data / --eval-data, checked on --resume


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


def prepare_embedded_model(folder: Path, config: TrainConfig, task: Task) -> Path:
    """Build the tiny model and warm-start it on ``task.sft`` into ``folder`` (reused when present).

    The folder is a normal ``save_pretrained`` model + tokenizer; ``warm_start.json`` records the
    settings it was built with, and a folder built with other settings is rebuilt. The build
    happens in a temporary sibling that replaces ``folder`` only when complete, so an
    interrupted build never leaves a folder that looks reusable.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = {
        "tiny_layers": config.tiny_layers,
        "tiny_hidden": config.tiny_hidden,
        "tiny_vocab_size": config.tiny_vocab_size,
        "warm_start_steps": config.warm_start_steps,
        "warm_start_problems": config.warm_start_problems,
        "warm_start_lr": config.warm_start_lr,
        "warm_start_label_smoothing": config.warm_start_label_smoothing,
        "max_operand": config.max_operand,
        "max_second_operand": config.max_second_operand,
        "num_eval": config.num_eval,
        "seed": config.seed,
    }
    marker = folder / WARM_START_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("settings") == settings:
        logger.info("reusing the warm-started embedded model in %s", folder)
        return folder
    heads = tiny_heads(config.tiny_hidden)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    build_tiny_model(
        tmp,
        config=TinyModelConfig(hidden_size=config.tiny_hidden, num_layers=config.tiny_layers, num_heads=heads),
        seed=config.seed,
        vocab_size=config.tiny_vocab_size,
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    start = time.perf_counter()
    logger.info("supervised warm start: %d steps on %d problems", config.warm_start_steps, len(task.sft))
    losses = supervised_warm_start(
        model, tokenizer, task.sft, WarmStartConfig(steps=config.warm_start_steps, lr=config.warm_start_lr,
                                         label_smoothing=config.warm_start_label_smoothing, seed=config.seed)
    )
    model.save_pretrained(tmp)
    seconds = time.perf_counter() - start
    atomic_write_text(
        tmp / WARM_START_MARKER,
        json.dumps({"settings": settings, "final_loss": losses[-1] if losses else None, "seconds": seconds}, indent=2),
    )
    fsync_dir(tmp)
    if folder.exists():
        logger.warning("rebuilding %s: it was built with other settings (%s)", folder, marker)
        old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
        os.rename(folder, old)
        os.rename(tmp, folder)
        shutil.rmtree(old)
    else:
        os.rename(tmp, folder)
    fsync_dir(folder.parent)
    logger.info("warm start done in %.1f s (final loss %s)", seconds, f"{losses[-1]:.4f}" if losses else "n/a")
    return folder


def make_rollout_engine(config: TrainConfig, model_path: str, device: torch.device):
    """The rollout engine of ``--engine`` on ``model_path``."""
    kind = config.engine
    if kind == "auto":
        kind = "vllm" if vllm_available() else "hf"
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
    evals = [(r["step"], r["eval_acc"]) for r in read_metrics(out_dir / "metrics.jsonl") if r.get("eval_acc") is not None]
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
        "metrics": str(out_dir / "metrics.jsonl"),
        "plot": str(out_dir / "metrics.png"),
    }


def check_resume_config(out_dir: Path, config: TrainConfig) -> None:
    """Refuse to resume with settings that differ from the run's ``config.json`` (what it trains)."""
    path = out_dir / "config.json"
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


def run(config: TrainConfig, *, progress: bool = True, engine: RolloutEngine | None = None) -> dict[str, Any]:
    """Run a full training job for a validated ``config``; return the summary dict.

    ``engine``: an already started rollout engine to reuse (e.g. one vLLM engine for a series of
    runs); its weights are replaced by the run's and the caller closes it. It must have been
    started with ``config.rollout_dtype``. Default: start one for this run and close it after.

    Raises:
        RunError: ``--out`` is not empty without ``--resume``/``--overwrite``, another trainer holds
            it, ``--model`` holds no readable model, or (``CheckpointError``) ``--resume`` finds
            no usable checkpoint; the message names the file and what to do.
        DataFormatError: ``--data``/``--eval-data`` is malformed (file and line in the message).
    """
    wall_start = time.perf_counter()
    out_dir = Path(config.out)
    try:
        check_report_to(config.report_to)
    except ImportError as err:
        raise RunError(str(err)) from None
    set_library_verbosity(verbose=config.verbose)
    if config.model and Path(config.model).is_dir():
        check_model_folder(config.model, what="--model")
    if config.resume and not out_dir.is_dir():
        raise NoCheckpointError(f"--resume: no complete checkpoint in {str(out_dir)!r}: the folder does not exist")
    device = resolve_device(config.device)
    # Inputs are checked before --out is touched: a run refused for bad data leaves no folder behind.
    task = build_task(config)
    logger.info("task %s: %d training / %d held-out problems", task.name, len(task.train), len(task.eval))
    with open_run_dir(out_dir, resume=config.resume, overwrite=config.overwrite):
        return _run_locked(config, task, device, out_dir, wall_start, progress=progress, engine=engine)


def check_top_k(config: TrainConfig, model_path: str | None) -> None:
    """Refuse a ``--top-k`` larger than the model's vocabulary (the engines cannot return it)."""
    if not config.uses_topk or not model_path:
        return
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(model_path), "vocab_size", None)
    if vocab is not None and config.top_k > vocab:
        raise RunError(f"--top-k={config.top_k} exceeds the vocabulary of {model_path!r} ({vocab} tokens); "
                       f"expected 1 <= top_k <= {vocab}")


def _run_locked(
    config: TrainConfig, task: Task, device: torch.device, out_dir: Path, wall_start: float, *, progress: bool,
    engine: RolloutEngine | None,
) -> dict[str, Any]:
    checkpoint_dir = None
    if config.resume:
        checkpoint_dir = find_resume_checkpoint(out_dir)
        check_resume_config(out_dir, config)
    check_top_k(config, str(checkpoint_dir / MODEL_DIR) if checkpoint_dir is not None else config.model or None)
    atomic_write_text(out_dir / "config.json", json.dumps(config.to_dict(), indent=2))
    if checkpoint_dir is None:
        atomic_write_text(out_dir / INPUTS_FILE, json.dumps(data_fingerprints(config), indent=2))
    torch.set_num_threads(resolve_threads(config.threads))
    seed_everything(config.seed)
    if checkpoint_dir is not None:
        policy_path = str(checkpoint_dir / MODEL_DIR)
    else:
        policy_path = config.model or str(prepare_embedded_model(out_dir / "base_model", config, task))
    if not config.model and checkpoint_dir is None:
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
        result = trainer.run(progress=progress)
    finally:
        if own_engine:
            engine.close()
    plot_metrics(out_dir / "metrics.jsonl", out_dir / "metrics.png", title=f"{task.name}: {config.loss} ({engine.name})")
    summary = summarize(out_dir, config, engine.name, time.perf_counter() - wall_start, result["elapsed_s"])
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


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
    except (RunError, DataFormatError, MetricsFormatError) as err:
        print(f"dppo-train: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a setting the run cannot use (e.g. --num-eval beyond the data, --device cuda without one)
        logger.debug("dppo-train: the run stopped on a ValueError", exc_info=True)
        print(f"dppo-train: error: {err} (--log-level debug shows where it was raised)", file=sys.stderr)
        return 2
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

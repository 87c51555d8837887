"""Command-line entry point of the reference RL trainer (``python -m dppo_ext.train`` / ``dppo-train``).

Default run (no flags): builds the embedded tiny model and arithmetic task, warm-starts the model
with a short supervised fine-tune, then trains it with DPPO (binary TV) from vLLM rollouts
(transformers ``generate`` when vLLM is absent). With ``--model`` and ``--data`` the same code
trains any Hugging Face causal LM on a JSONL task.

Outputs in ``--out``: ``config.json``, ``metrics.jsonl``, ``metrics.png``, ``summary.json``,
``checkpoint/`` (and ``base_model/`` for the embedded model).
"""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dppo_ext.models.sft import WarmStartConfig, supervised_warm_start
from dppo_ext.models.tiny import TinyModelConfig, build_tiny_model
from dppo_ext.rollout import make_engine, vllm_available
from dppo_ext.tasks import Task, load_jsonl_task, make_arithmetic_task
from dppo_ext.trainer.checkpoint import MODEL_DIR, has_checkpoint
from dppo_ext.trainer.config import TrainConfig, parse_config
from dppo_ext.trainer.loop import Trainer
from dppo_ext.trainer.metrics import read_metrics
from dppo_ext.trainer.plotting import plot_metrics

logger = logging.getLogger("dppo_ext.train")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WARM_START_MARKER = "warm_start.json"


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
    settings it was built with, and a folder built with other settings is rebuilt.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    settings = {
        "tiny_layers": config.tiny_layers,
        "tiny_hidden": config.tiny_hidden,
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
    heads = max(1, config.tiny_hidden // 64)
    build_tiny_model(
        folder,
        config=TinyModelConfig(hidden_size=config.tiny_hidden, num_layers=config.tiny_layers, num_heads=heads),
        seed=config.seed,
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
    marker.write_text(
        json.dumps({"settings": settings, "final_loss": losses[-1] if losses else None, "seconds": seconds}, indent=2)
    )
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


def run(config: TrainConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run a full training job for a validated ``config``; return the summary dict."""
    wall_start = time.perf_counter()
    out_dir = Path(config.out)
    checkpoint_dir = out_dir / "checkpoint"
    if config.resume and not has_checkpoint(checkpoint_dir):
        raise FileNotFoundError(f"--resume: no complete checkpoint in {checkpoint_dir}; run without --resume to start fresh")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    if config.threads:
        torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    seed_everything(config.seed)
    task = build_task(config)
    logger.info("task %s: %d training / %d held-out problems", task.name, len(task.train), len(task.eval))
    base_path = config.model or str(prepare_embedded_model(out_dir / "base_model", config, task))
    policy_path = str(checkpoint_dir / MODEL_DIR) if config.resume else base_path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = make_rollout_engine(config, policy_path, device)
    # vLLM logs two INFO lines per weight sync (every step); keep its warnings, drop the chatter.
    logging.getLogger("vllm").setLevel(logging.WARNING)
    try:
        # vLLM reseeds torch's global RNG while starting: seed (or restore) after the engine exists.
        seed_everything(config.seed)
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        model = AutoModelForCausalLM.from_pretrained(policy_path, dtype=TORCH_DTYPES[config.dtype]).to(device).eval()
        trainer = Trainer(config, model, tokenizer, task, engine, out_dir)
        if config.resume:
            trainer.restore(checkpoint_dir)
            logger.info("resumed from %s at step %d", checkpoint_dir, trainer.step)
        result = trainer.run(progress=progress)
    finally:
        engine.close()
    plot_metrics(out_dir / "metrics.jsonl", out_dir / "metrics.png", title=f"{task.name}: {config.loss} ({engine.name})")
    summary = summarize(out_dir, config, engine.name, time.perf_counter() - wall_start, result["elapsed_s"])
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
    except ValueError as err:
        print(f"dppo-train: error: {err}", file=sys.stderr)
        return 2
    print("dppo-train settings:\n" + config.describe(), flush=True)
    summary = run(config)
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

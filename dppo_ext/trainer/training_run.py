"""A training run in its opened, locked ``--out`` (``run_folder.RunFolder``), from set-up to summary: the set-up
(resume point, warm start, engine, model, checkpoint restore), the commit that starts it, the training, the summary;
and a ``--resume --steps S`` already at step S, which trains nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from dppo_ext.contract import MODEL_DTYPES
from dppo_ext.rollout import RolloutEngine
from dppo_ext.rollout.vllm_parity import policy_load_kwargs
from dppo_ext.tasks import Task
from dppo_ext.trainer.checkpoint import MODEL_DIR, load_trainer_state
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.embedded_model import build_embedded_model, warm_start_matches
from dppo_ext.trainer.engine import check_top_k, engine_kind, make_rollout_engine
from dppo_ext.trainer.loop import Trainer
from dppo_ext.trainer.metrics import prepare_for_resume
from dppo_ext.trainer.process import resolve_threads, seed_everything
from dppo_ext.trainer.reporting import TENSORBOARD_DIR
from dppo_ext.trainer.resume import data_fingerprints, resume_point
from dppo_ext.trainer.run_folder import RunFolder
from dppo_ext.trainer.run_folder.files import (
    CONFIG_FILE,
    EMBEDDED_MODEL_DIR,
    INPUTS_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    RunError,
    atomic_write_text,
    install_folder,
    json_object_or_none,
    temporary_sibling,
)
from dppo_ext.trainer.summary import write_summary

logger = logging.getLogger(__name__)


def train_in_folder(
    config: TrainConfig,
    task: Task,
    device: torch.device,
    folder: RunFolder,
    wall_start: float,
    *,
    progress: bool,
    engine: RolloutEngine | None,
    base_model: str | Path | None,
) -> dict[str, Any]:
    """Run ``config`` in the opened ``folder`` (``dppo_ext.train.run`` checked its inputs and opened it);
    return the summary. ``engine`` and ``base_model`` as in ``run``."""
    # Set-up: until folder.commit() nothing is written into --out but temporaries (the warm start
    # builds in one), so a failure or Ctrl-C here leaves the folder as it was (RunFolder's rollback).
    out_dir = folder.path
    checkpoint_dir = None
    if config.resume:
        checkpoint_dir, step = resume_point(config, out_dir)
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
            raise RunError(
                f"{str(target)!r} was not written by this run's trainer (it is not in dppo-run.json) and "
                "holds another model than this run's warm start; move it out of --out, or pass another "
                "--out"
            )
        else:
            built = build_embedded_model(temporary_sibling(target), config, task)
            policy_path = str(built)
        check_top_k(config, policy_path)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    own_engine = engine is None
    if engine is None:
        engine = make_rollout_engine(config, policy_path, device)
    elif str(getattr(engine, "dtype", config.rollout_dtype)).removeprefix("torch.") != config.rollout_dtype:
        raise ValueError(
            f"run(engine=...): the engine runs in {engine.dtype}, but --rollout-dtype is {config.rollout_dtype}"
        )
    try:
        # vLLM reseeds torch's global RNG while starting: seed (or restore) after the engine exists.
        seed_everything(config.seed)
        tokenizer = AutoTokenizer.from_pretrained(policy_path)
        model = (
            AutoModelForCausalLM.from_pretrained(
                policy_path, dtype=MODEL_DTYPES[config.dtype], **policy_load_kwargs(policy_path)
            )
            .to(device)
            .eval()
        )
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
            install_folder(built, out_dir / EMBEDDED_MODEL_DIR, replace=False)
            folder.seal()
        atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))
        if checkpoint_dir is None:
            atomic_write_text(out_dir / INPUTS_FILE, json.dumps(data_fingerprints(config), indent=2))
        result = trainer.run(progress=progress)
    finally:
        if own_engine:
            engine.close()
    return write_summary(config, folder, engine.name, task.name, wall_start, result["elapsed_s"])


def _nothing_to_train(
    config: TrainConfig,
    folder: RunFolder,
    checkpoint_dir: Path,
    task_name: str,
    wall_start: float,
) -> dict[str, Any]:
    """``--resume --steps S`` where the newest checkpoint is at step S: no engine, no training.

    A run whose ``summary.json`` reports S steps is complete: nothing is written. Otherwise the run
    stopped after its last save, before its summary: its records are repaired as on any resume
    (those of later steps move to ``metrics.dropped.jsonl``) and its config, plot and summary written.
    """
    out_dir = folder.path
    saved = json_object_or_none(out_dir / SUMMARY_FILE)
    if saved is not None and saved.get("steps") == config.steps:
        logger.warning(
            "--resume --steps %d: %s is already at step %d and its %s reports it; nothing to train, nothing changed",
            config.steps,
            checkpoint_dir,
            config.steps,
            SUMMARY_FILE,
        )
        return {**saved, "nothing_to_do": True}
    logger.warning(
        "--resume --steps %d: %s is already at step %d; nothing to train, writing the run's missing %s",
        config.steps,
        checkpoint_dir,
        config.steps,
        SUMMARY_FILE,
    )
    folder.commit({CONFIG_FILE: "file"})
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))
    prepare_for_resume(out_dir / METRICS_FILE, config.steps)
    elapsed = float(load_trainer_state(checkpoint_dir)["elapsed_s"])
    return write_summary(config, folder, engine_kind(config), task_name, wall_start, elapsed)

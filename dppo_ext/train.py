"""Command-line entry point of the reference RL trainer (``python -m dppo_ext.train`` / ``dppo-train``).

Default run (no flags): builds the embedded tiny model and arithmetic task, warm-starts the model
with a short supervised fine-tune, then trains it with DPPO (binary TV) from vLLM rollouts
(transformers ``generate`` when vLLM is absent). With ``--model`` and ``--data`` the same code
trains any Hugging Face causal LM on a JSONL task.

Outputs in ``--out`` and the rules of that folder (what a run writes, deletes and never touches; fresh,
``--resume``, ``--overwrite``; a set-up that fails changes nothing): docs/run_folder.md, enforced by
``dppo_ext.trainer.run_folder``.

This module is the entry point (``run``: check the inputs, open ``--out``; ``main``: the CLI); the work is in
``dppo_ext.trainer``, one job per module: ``process`` (seeds, device, threads, library verbosity), ``task``,
``embedded_model`` (the warm start), ``engine`` (the rollout engine), ``resume`` (what ``--resume`` checks and
adopts), ``training_run`` (the run in its opened folder: set-up, start, training), ``summary``, ``loop`` (the RL
steps) and the run folder (``run_folder``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dppo_ext.rollout import RolloutEngine
from dppo_ext.tasks import DataFormatError, Task
from dppo_ext.trainer.checkpoint import NoCheckpointError, check_model_folder
from dppo_ext.trainer.cli import parse_config
from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.embedded_model import WARM_START_MARKER, warm_start_matches
from dppo_ext.trainer.metrics import MetricsFormatError
from dppo_ext.trainer.process import resolve_device, restart_with_passive_omp_waits, set_library_verbosity
from dppo_ext.trainer.reporting import check_report_to
from dppo_ext.trainer.resume import legacy_run_outputs
from dppo_ext.trainer.run_folder import open_run_folder
from dppo_ext.trainer.run_folder.files import RunError
from dppo_ext.trainer.run_folder.plan import check_out_apart
from dppo_ext.trainer.task import build_task
from dppo_ext.trainer.training_run import train_in_folder

__all__ = ["main", "run"]

logger = logging.getLogger("dppo_ext.train")


def run(
    config: TrainConfig,
    *,
    progress: bool = True,
    engine: RolloutEngine | None = None,
    base_model: str | Path | None = None,
    task: Callable[[Task], Task] | None = None,
) -> dict[str, Any]:
    """Run a full training job for a validated ``config``; return the summary dict.

    ``task``: a function given the task ``config`` describes (the embedded arithmetic task, or ``--data``'s) that
    returns the one to train on, e.g. the same problems with another reward (an experiment's task). Default: train
    on the config's task as it is.

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
    task_for = task
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
        raise ValueError(
            f"run(base_model={str(base_model)!r}): it holds no embedded model warm-started with this "
            f"config's settings ({WARM_START_MARKER}); build it with prepare_embedded_model"
        )
    if config.resume and not out_dir.is_dir():
        raise NoCheckpointError(f"--resume: no complete checkpoint in {str(out_dir)!r}: the folder does not exist")
    device = resolve_device(config.device)
    # Inputs are checked before --out is touched: a run refused for bad data leaves no folder behind.
    task = build_task(config)
    if task_for is not None:
        task = task_for(task)
        if not isinstance(task, Task):
            raise TypeError(f"run(task=...) must return a dppo_ext.tasks.Task, got {type(task).__name__}")
    logger.info("task %s: %d training / %d held-out problems", task.name, len(task.train), len(task.eval))
    with open_run_folder(out_dir, resume=config.resume, overwrite=config.overwrite, adopt=legacy_run_outputs) as folder:
        return train_in_folder(
            config, task, device, folder, wall_start, progress=progress, engine=engine, base_model=base_model
        )


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
        print(
            "dppo-train: interrupted (stopped during its set-up, a run leaves --out as it was; stopped while "
            "training, it continues with --resume from its newest checkpoint)",
            file=sys.stderr,
        )
        return 130
    except (RunError, DataFormatError, MetricsFormatError) as err:
        print(f"dppo-train: error: {err}", file=sys.stderr)
        return 2
    except (
        ValueError
    ) as err:  # a setting the run cannot use (e.g. --num-eval beyond the data, --device cuda without one)
        logger.debug("dppo-train: the run stopped on a ValueError", exc_info=True)
        print(f"dppo-train: error: {err} (--log-level debug shows where it was raised)", file=sys.stderr)
        return 2
    if summary.get("nothing_to_do"):
        print(
            f"dppo-train: nothing to do: {config.out!r} is already trained to step {config.steps} (its "
            "summary.json); pass a larger --steps to train on",
            flush=True,
        )
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

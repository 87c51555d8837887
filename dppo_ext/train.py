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

This module is the entry point (``run``: check the inputs, open ``--out``; ``main``: the CLI); the work is in
``dppo_ext.trainer``, one job per module: ``process`` (seeds, device, threads, library verbosity), ``task``,
``embedded_model`` (the warm start), ``engine`` (the rollout engine), ``resume`` and ``legacy_run`` (what
``--resume`` checks and adopts), ``locked_run`` (a run in its locked folder), ``summary``, ``run_files`` (the
outputs' names), ``loop`` (the RL steps) and the run folder's modules (``run_dir``). The names this module held
before that split are still importable from it.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

from dppo_ext.models.sft import supervised_warm_start
from dppo_ext.rollout import RolloutEngine
from dppo_ext.tasks import DataFormatError
from dppo_ext.trainer.atomic_files import install_folder
from dppo_ext.trainer.checkpoint import NoCheckpointError, check_model_folder
from dppo_ext.trainer.config import TrainConfig, parse_config
from dppo_ext.trainer.embedded_model import (
    WARM_START_MARKER,
    build_embedded_model,
    prepare_embedded_model,
    warm_start_matches,
    warm_start_settings,
)
from dppo_ext.trainer.engine import check_top_k, engine_kind, make_rollout_engine
from dppo_ext.trainer.errors import RunError
from dppo_ext.trainer.legacy_run import legacy_run_outputs
from dppo_ext.trainer.locked_run import run_locked
from dppo_ext.trainer.metrics import MetricsFormatError
from dppo_ext.trainer.overlap import check_out_apart
from dppo_ext.trainer.process import (
    resolve_device,
    resolve_threads,
    restart_with_passive_omp_waits,
    seed_everything,
    set_library_verbosity,
)
from dppo_ext.trainer.reporting import check_report_to
from dppo_ext.trainer.resume import check_resume_config, data_fingerprints
from dppo_ext.trainer.run_files import CONFIG_FILE, INPUTS_FILE, METRICS_FILE, PLOT_FILE, SUMMARY_FILE
from dppo_ext.trainer.run_folder import open_run_dir
from dppo_ext.trainer.summary import summarize
from dppo_ext.trainer.task import build_task

# The CLI, and the names this module held before the trainer was split into dppo_ext.trainer's modules.
__all__ = [
    "CONFIG_FILE",
    "INPUTS_FILE",
    "METRICS_FILE",
    "PLOT_FILE",
    "SUMMARY_FILE",
    "WARM_START_MARKER",
    "build_embedded_model",
    "build_task",
    "check_resume_config",
    "check_top_k",
    "data_fingerprints",
    "engine_kind",
    "install_folder",
    "legacy_run_outputs",
    "main",
    "make_rollout_engine",
    "prepare_embedded_model",
    "resolve_device",
    "resolve_threads",
    "restart_with_passive_omp_waits",
    "run",
    "seed_everything",
    "set_library_verbosity",
    "summarize",
    "supervised_warm_start",
    "warm_start_matches",
    "warm_start_settings",
]

logger = logging.getLogger("dppo_ext.train")


def run(
    config: TrainConfig,
    *,
    progress: bool = True,
    engine: RolloutEngine | None = None,
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
        raise ValueError(
            f"run(base_model={str(base_model)!r}): it holds no embedded model warm-started with this "
            f"config's settings ({WARM_START_MARKER}); build it with prepare_embedded_model"
        )
    if config.resume and not out_dir.is_dir():
        raise NoCheckpointError(f"--resume: no complete checkpoint in {str(out_dir)!r}: the folder does not exist")
    device = resolve_device(config.device)
    # Inputs are checked before --out is touched: a run refused for bad data leaves no folder behind.
    task = build_task(config)
    logger.info("task %s: %d training / %d held-out problems", task.name, len(task.train), len(task.eval))
    with open_run_dir(out_dir, resume=config.resume, overwrite=config.overwrite, adopt=legacy_run_outputs) as folder:
        return run_locked(
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

"""A short run of the reference trainer on the GPU (scripts/gpu_check.sh's trainer step).

The embedded task and model (a tiny character-level Llama, warm-started on a disjoint slice of the
arithmetic task), rolled out with the transformers engine (no vLLM on the GPU machine), trained with
DPPO on CUDA for a few steps; it records the seconds per RL step and the held-out accuracy before and
after from the run's own metrics.jsonl and summary.json.

    python scripts/gpu_trainer_check.py --out DIR [--json trainer.json] [--steps 20] [--dry-run]

--dry-run (any machine): build and validate the trainer's command line with the trainer's own parser,
then stop before the first GPU call (the run itself).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dppo_ext.trainer.cli import parse_config


def trainer_argv(out: Path, steps: int) -> list[str]:
    """The run: the embedded default's settings, except the engine, the device and a short schedule. An
    existing --out (an earlier attempt) is handed to the trainer's own --overwrite, which removes only what a
    run of the trainer wrote there."""
    argv = [
        "--engine",
        "hf",
        "--device",
        "cuda",
        "--steps",
        str(steps),
        "--eval-every",
        str(max(1, steps // 2)),
        "--num-eval",
        "200",
        "--eval-samples",
        "1",
        "--save-every",
        "0",
        "--out",
        str(out),
    ]
    return argv + (["--overwrite"] if out.exists() and any(out.iterdir()) else [])


def per_step_seconds(metrics: Path) -> list[float]:
    """Wall seconds of each RL step, from the cumulative elapsed_s of consecutive records."""
    elapsed = [
        r["elapsed_s"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r.get("step", 0) > 0 and "elapsed_s" in r
    ]
    return [b - a for a, b in zip(elapsed, elapsed[1:])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the run's output folder (replaced)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="validate the command line, stop before the GPU")
    args = ap.parse_args()
    argv = trainer_argv(args.out, args.steps)
    config = parse_config(argv)  # the trainer's own validation of every flag
    print(f"trainer: python -m dppo_ext.train {' '.join(argv)}")
    print(
        f"  loss {config.loss}, engine {config.engine}, device {config.device}, steps {config.steps}, "
        f"{config.prompts_per_step} prompts x {config.group_size} samples per step"
    )
    if args.dry_run:
        print("dry run: stopped before the first GPU call (the trainer run)")
        return 0
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dppo_ext.train", *argv], check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        print(f"the trainer exited with {proc.returncode} after {wall:.0f}s", file=sys.stderr)
        return proc.returncode
    summary = json.loads((args.out / "summary.json").read_text())
    steps = per_step_seconds(args.out / "metrics.jsonl")
    result = {
        "device": "cuda",
        "engine": summary["engine"],
        "steps": summary["steps"],
        "wall_s": wall,
        "train_s": summary["train_s"],
        "seconds_per_step_median": statistics.median(steps) if steps else None,
        "held_out_accuracy_before": summary["start_acc"],
        "held_out_accuracy_after": summary["end_acc"],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m experiments.sanity``: run a sweep (resumable), collect its data, draw the report."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from dppo_ext.trainer.losses import LOSSES

from . import collapse, precision, staleness
from .conditions import (
    ARMS,
    CONDITIONS,
    GRID,
    QUICK,
    QUICK_CONDITION,
    QUICK_METHODS,
    Run,
    condition_methods,
    run_config,
)
from .report import report
from .sweep import _finished, collect, launch_workers, work_through

logger = logging.getLogger("experiments.sanity")

DATA = "experiments/sanity/results/dosed/data"
REPORT_DIR = "experiments/sanity/results/dosed"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.sanity",
        description="The DPPO paper's stability sanity test at laptop scale: a dosed training-inference mismatch "
        "x methods x seeds (docs/sanity.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=None,
        choices=list(ARMS),
        help="arms to run (their conditions); default: the grid, " + " ".join(GRID),
    )
    parser.add_argument(
        "--conditions",
        nargs="+",
        default=None,
        choices=list(CONDITIONS),
        help="conditions to run instead of --arms (see experiments/sanity/conditions.py)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        choices=list(LOSSES),
        help="losses to compare (default: each condition's own; --quick: " + ", ".join(QUICK_METHODS) + ")",
    )
    parser.add_argument(
        "--seeds",
        nargs="+",
        type=int,
        default=None,
        help="seeds (default: each condition's own, 0 1 2 for the grid; --quick: 0)",
    )
    parser.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the condition's)")
    parser.add_argument("--jobs", type=int, default=2, help="runs side by side (one torch thread each)")
    parser.add_argument("--work", default="runs/sanity", help="run folders (checkpoints, logs; not committed)")
    parser.add_argument("--data", default=DATA, help="collected per-run data files")
    parser.add_argument("--report-dir", default=REPORT_DIR, help="figures and tables")
    parser.add_argument(
        "--engine", default=None, choices=("auto", "vllm", "hf"), help="rollout engine (default: the condition's)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"CI smoke test: {QUICK_CONDITION}, {', '.join(QUICK_METHODS)}, seed 0, {QUICK['steps']} "
        "steps, tiny warm start",
    )
    parser.add_argument("--report-only", action="store_true", help="only redraw figures and tables from --data")
    parser.add_argument(
        "--experiment",
        default="dosed",
        choices=("dosed", "staleness", "collapse", "precision"),
        help="dosed: the dosed-mismatch experiment (docs/sanity.md); staleness: the staleness ladder "
        "(experiments/sanity/results/staleness/PREREGISTRATION.md; its runs are chosen by --phases or --pilot); "
        "collapse: the collapse replication, design A seed-major (experiments/sanity/collapse/PREREGISTRATION.md; "
        "--seeds limits it); precision: the precision-dose pilot, seed-major "
        "(experiments/sanity/precision/PREREGISTRATION.md; --seeds limits it)",
    )
    parser.add_argument(
        "--phases",
        nargs="+",
        default=None,
        choices=list(staleness.PHASES),
        help="staleness: the phases to run, in order (default: A)",
    )
    parser.add_argument("--pilot", action="store_true", help="staleness: run the pilot (seed 100) instead")
    parser.add_argument(
        "--eval-noise",
        action="store_true",
        help="staleness: evaluate the finished pilot runs' final weights with several sampling seeds "
        f"(writes {staleness.EVAL_NOISE})",
    )
    parser.add_argument(
        "--rare-token-check",
        action="store_true",
        help="staleness: build the rare-token arm's warm starts (--seeds, default the pilot seed) and measure the "
        f"good token's probability under them (writes {staleness.RARE_TOKEN_MU})",
    )
    parser.add_argument("--nice", type=int, default=0, help="niceness increment of the worker processes")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: a worker's spec file
    return parser


def planned_runs(args: argparse.Namespace) -> list[Run]:
    """The runs the arguments ask for, seed-major (a sweep stopped early leaves whole seed blocks)."""
    if args.quick:
        conditions = args.conditions or [QUICK_CONDITION]
    elif args.conditions:
        conditions = args.conditions
    else:
        conditions = list(dict.fromkeys(c for arm in args.arms for c in ARMS[arm])) if args.arms else list(GRID)
    methods = args.methods or (list(QUICK_METHODS) if args.quick else None)
    by_condition = {c: (args.seeds or ([0] if args.quick else list(CONDITIONS[c].seeds))) for c in conditions}
    seeds = sorted({s for seeds in by_condition.values() for s in seeds})
    return [
        Run(c, m, s) for s in seeds for c in conditions if s in by_condition[c] for m in condition_methods(c, methods)
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        runs = [Run(*r) for r in spec["runs"]]
        data = Path(spec["data"]) if spec.get("data") else None
        return 1 if work_through(runs, Path(spec["work"]), spec["overrides"], Path(spec["status"]), data) else 0
    if args.experiment == "staleness":
        return staleness_main(args)
    if args.experiment in ("collapse", "precision"):
        return preregistered_main(args)
    data, report_dir = Path(args.data), Path(args.report_dir)
    failed: list[str] = []
    if not args.report_only:
        if args.jobs < 1:
            print(f"sanity: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
            return 2
        overrides: dict[str, Any] = dict(QUICK) if args.quick else {}
        if args.steps is not None:
            overrides["steps"] = args.steps
        if args.engine is not None:
            overrides["engine"] = args.engine
        work = Path(args.work)
        runs = planned_runs(args)
        try:
            configs = {run: run_config(run, work, overrides) for run in runs}
        except ValueError as err:
            print(f"sanity: error: {err}", file=sys.stderr)
            return 2
        for config in configs.values():
            Path(config.out).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # finished runs are skipped here, so a sweep with nothing left starts no worker
        todo = [run for run in runs if not _finished(configs[run])]
        results = [{"run": run.name, "status": "skipped", "seconds": 0.0} for run in runs if run not in todo]
        if todo:
            results += launch_workers(todo, work, overrides, args.jobs)
        for run in runs:
            if (Path(configs[run].out) / "metrics.jsonl").is_file():
                collect(run, configs[run], data)
        wall = time.perf_counter() - start
        counts = {s: sum(r["status"] == s for r in results) for s in ("fresh", "resumed", "skipped", "failed")}
        logger.info("sweep of %d runs done in %.0f s wall (%s)", len(runs), wall, counts)
        with (work / "sweep_log.jsonl").open("a") as handle:
            handle.write(
                json.dumps(
                    {"runs": len(runs), "wall_s": wall, **counts, "argv": argv if argv is not None else sys.argv[1:]}
                )
                + "\n"
            )
        failed = [r["run"] for r in results if r["status"] == "failed"]
    for path in report(data, report_dir):
        print(f"wrote {path}")
    if failed:
        print(
            f"sanity: {len(failed)} run(s) failed (see <run folder>.train.log beside each): {', '.join(failed)}",
            file=sys.stderr,
        )
        return 1
    return 0


def staleness_main(args: argparse.Namespace) -> int:
    """The staleness experiment: its runs (skipping those whose committed data file is complete), each collected
    as it finishes; or the pilot's evaluation noise; then its report from the committed files."""
    data = Path(staleness.PILOT_DATA if args.pilot else args.data if args.data != DATA else staleness.DATA)
    report_dir = Path(args.report_dir if args.report_dir != REPORT_DIR else staleness.REPORT_DIR)
    pilot_data = data if args.pilot else Path(staleness.PILOT_DATA)
    work = Path(args.work)
    failed: list[str] = []
    if args.eval_noise:
        staleness.measure_eval_noise(staleness.pilot_runs(), work, Path(staleness.EVAL_NOISE))
    elif args.rare_token_check:
        staleness.measure_rare_token_mu(args.seeds or [staleness.PILOT_SEED], work, Path(staleness.RARE_TOKEN_MU))
    elif not args.report_only:
        runs = staleness.pilot_runs() if args.pilot else staleness.planned_runs(args.phases or ["A"], args.seeds)
        failed = _train_incomplete("staleness", runs, data, work, args)
    for path in staleness.report(
        Path(staleness.DATA) if args.pilot else data, pilot_data, Path(staleness.EVAL_NOISE), report_dir
    ):
        print(f"wrote {path}")
    if failed:
        print(f"sanity: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _train_incomplete(name: str, runs: list, data: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """Train the ``runs`` whose data file under ``data`` is not complete (each collected as it finishes); the names
    of the runs that failed."""
    overrides: dict[str, Any] = {} if args.steps is None else {"steps": args.steps}
    configs = {run: run_config(run, work, overrides) for run in runs}
    todo = [
        run
        for run in runs
        if not staleness.data_file_complete(
            data / run.condition / run.method / f"seed{run.seed}.jsonl", configs[run].steps
        )
    ]
    logger.info("%d of %d runs to train (%d have complete data files)", len(todo), len(runs), len(runs) - len(todo))
    start = time.perf_counter()
    results = launch_workers(todo, work, overrides, args.jobs, data=data, nice=args.nice) if todo else []
    counts = {s: sum(r["status"] == s for r in results) for s in ("fresh", "resumed", "skipped", "failed")}
    logger.info("%s sweep: %d runs in %.0f s wall (%s)", name, len(todo), time.perf_counter() - start, counts)
    return [r["run"] for r in results if r["status"] == "failed"]


def preregistered_main(args: argparse.Namespace) -> int:
    """The collapse replication or the precision pilot: its runs seed-major (skipping those whose data file is
    complete), each collected as it finishes; then its report from the data files alone."""
    module = collapse if args.experiment == "collapse" else precision
    data = Path(args.data if args.data != DATA else module.DATA)
    report_dir = Path(args.report_dir if args.report_dir != REPORT_DIR else module.REPORT_DIR)
    failed: list[str] = []
    if not args.report_only:
        if args.jobs < 1:
            print(f"sanity: error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
            return 2
        work = Path(args.work)
        runs = module.planned_runs(args.seeds)
        failed = _train_incomplete(args.experiment, runs, data, work, args)
    written = (
        collapse.report(data, report_dir, Path(staleness.DATA))
        if module is collapse
        else precision.report(data, report_dir)
    )
    for path in written:
        print(f"wrote {path}")
    if failed:
        print(f"sanity: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0

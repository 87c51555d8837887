"""Running a sweep: worker processes, resuming, the shared warm starts, collecting the data.

Runs are trained by ``jobs`` worker processes (``python -m experiments.sanity --worker``), one
torch thread each, each keeping one rollout engine for all its runs (the process and engine
start-up are paid once per worker). A finished run (its ``summary.json`` reports the requested
steps) is skipped, an interrupted one continues from its last checkpoint (the trainer's
``--resume``), one without a checkpoint starts over. The embedded model's supervised warm start
is built once per distinct setting (one per seed and vocabulary) and shared by the runs that use it.

``collect`` turns a run's ``metrics.jsonl`` into the committed data file (``data_file_rows``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dppo_ext.trainer.config import TrainConfig
from dppo_ext.trainer.mechanism import MU_BIN_EDGES
from dppo_ext.trainer.run_folder.files import atomic_write_text

from .conditions import CONDITIONS, Run, run_config
from .host import host_info
from .rare_token import train as train_rare_token

logger = logging.getLogger("experiments.sanity")

REPO = Path(__file__).resolve().parents[2]
HOST_SUFFIX = ".host.jsonl"  # beside the run folder, as the log: the trainer owns what is inside it

# Per-step fields kept in the collected data (the rest of metrics.jsonl stays in the run folder).
COLUMNS = (
    "step",
    "reward",
    "eval_acc",
    "mismatch_mean",
    "mismatch_max",
    "masked_frac",
    "masked_frac_first",
    "masked_frac_later",
    "drift_mean",
    "drift_max",
    "bad_update_frac",
    "neg_high_removed",
    "neg_high_tokens",
    "bad_neg_frac",
    "bad_neg_cross_frac",
    "pre_mismatch_mean",
    "pre_mismatch_max",
    "entropy_mean",
    "ratio_max",
    "loss",
    "grad_norm",
    "clipped_updates",
    "optimizer_steps",
    "trained_seqs",
    "rollout_s",
    "update_s",
)
# Counts by rollout-probability bin, summed over each evaluation window (the steps since the previous
# evaluation) and stored on the evaluation's row; per step they stay in metrics.jsonl.
BIN_COLUMNS = ("masked_by_mu_pos", "masked_by_mu_neg", "tokens_by_mu_pos", "tokens_by_mu_neg")
EXACT = ("reward", "eval_acc")  # fractions of a few hundred samples: kept exactly
DIGITS = 3  # significant digits of the other collected floats


def _finished(config: TrainConfig) -> bool:
    summary = Path(config.out) / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("steps") == config.steps


def _resumable(config: TrainConfig) -> bool:
    """True when the trainer's ``--resume`` would find a usable checkpoint in the run folder."""
    from dppo_ext.trainer.checkpoint import CheckpointError, NoCheckpointError, find_resume_checkpoint

    if not Path(config.out).is_dir():
        return False
    try:
        find_resume_checkpoint(config.out)
    except NoCheckpointError:
        return False
    except CheckpointError as err:
        logger.warning("%s: starting over (%s)", config.out, err)
        return False
    return True


WARM_START_KEYS = (
    "seed",
    "tiny_layers",
    "tiny_hidden",
    "tiny_vocab_size",
    "warm_start_steps",
    "warm_start_problems",
    "warm_start_lr",
    "warm_start_label_smoothing",
    "max_operand",
    "max_second_operand",
    "num_eval",
)


def ensure_base_model(config: TrainConfig, work: Path) -> Path:
    """The warm-started embedded model ``config``'s run starts from (the trainer's ``base_model=``).

    The warm start is built once per distinct setting under ``<work>/_base_models`` by whichever
    worker needs it first (a lock folder keeps a second worker waiting instead of building it
    again); every run of that setting starts from it, and the trainer checks its recorded settings.
    """
    import torch

    from dppo_ext.trainer.embedded_model import WARM_START_MARKER, prepare_embedded_model
    from dppo_ext.trainer.process import seed_everything
    from dppo_ext.trainer.task import build_task

    key = json.dumps({k: getattr(config, k) for k in WARM_START_KEYS}, sort_keys=True)
    folder = work / "_base_models" / f"seed{config.seed}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    lock = folder.with_name(folder.name + ".lock")
    folder.parent.mkdir(parents=True, exist_ok=True)
    while not (folder / WARM_START_MARKER).is_file():
        try:
            lock.mkdir()
        except FileExistsError:  # another worker is building it
            time.sleep(2.0)
            continue
        try:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # a tiny model: more threads only contend on a shared CPU
            seed_everything(config.seed)
            prepare_embedded_model(folder, config, build_task(config))
            torch.set_num_threads(threads)
        finally:
            lock.rmdir()
    return folder


def _fresh_folder(config: TrainConfig) -> None:
    """Remove a run folder of the sweep that has no checkpoint to resume from (an interrupted attempt's)."""
    if Path(config.out).is_dir():
        shutil.rmtree(config.out)


def beside(config: TrainConfig, suffix: str) -> Path:
    """A file of the sweep's own beside a run folder: ``<work>/<condition>/<method>/seed<N><suffix>``."""
    out = Path(config.out)
    return out.with_name(out.name + suffix)


def _engine_key(config: TrainConfig) -> tuple:
    """Runs that can share one started rollout engine (same kind, dtype, vocabulary and log-prob width)."""
    return config.engine, config.rollout_dtype, config.tiny_vocab_size, config.uses_topk and config.top_k > 20


def work_through(
    runs: list[Run], work: Path, overrides: dict[str, Any], status_path: Path, data: Path | None = None
) -> int:
    """Train ``runs`` one after another in this process, sharing one rollout engine among them.

    A worker of the sweep: skips finished runs, resumes interrupted ones, and appends one JSON
    line ``{"run", "status", "seconds"}`` per run to ``status_path`` (status: skipped, fresh,
    resumed or failed). With ``data``, a run that finishes is collected there at once (atomically), so a
    sweep stopped later keeps every finished run's data file. Returns the number of failed runs.
    """
    import torch

    from dppo_ext.train import run as train_run
    from dppo_ext.trainer.engine import make_rollout_engine
    from dppo_ext.trainer.process import resolve_device

    engine, engine_key, failed = None, None, 0
    for run in runs:
        config = run_config(run, work, overrides)
        start, cpu_start = time.perf_counter(), time.process_time()
        if _finished(config):
            status = "skipped"
        else:
            resume = _resumable(config)
            base_model = ensure_base_model(config, work)
            if not resume:
                _fresh_folder(config)  # what an interrupted attempt left (the trainer refuses a non-empty --out)
            config = dataclasses.replace(config, resume=resume)
            torch.set_num_threads(config.threads)
            if engine is None or _engine_key(config) != engine_key:
                if engine is not None:
                    engine.close()
                engine = make_rollout_engine(config, str(base_model), resolve_device(config.device))
                engine_key = _engine_key(config)
            beside(config, ".train.log").parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(beside(config, ".train.log"))
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(handler)
            try:
                with beside(config, HOST_SUFFIX).open("a") as handle:
                    handle.write(json.dumps({"attempt": "resumed" if resume else "fresh", **host_info()}) + "\n")
                if CONDITIONS[run.condition].task == "rare_token":
                    train_rare_token(config, engine=engine, base_model=None if resume else base_model)
                else:
                    train_run(config, progress=False, engine=engine, base_model=None if resume else base_model)
                status = "resumed" if resume else "fresh"
                if data is not None:  # this process's CPU time for the run (its warm start too, if it built it)
                    cost = {"cpu_s": time.process_time() - cpu_start, "wall_s": time.perf_counter() - start}
                    collect(run, config, data, cost=cost)
            except Exception:  # one failed run must not stop the others; the sweep reports it
                logger.exception("%s failed", run.name)
                status, failed = "failed", failed + 1
            finally:
                logging.getLogger().removeHandler(handler)
                handler.close()
        with status_path.open("a") as handle:
            handle.write(json.dumps({"run": run.name, "status": status, "seconds": time.perf_counter() - start}) + "\n")
    if engine is not None:
        engine.close()
    return failed


def worker_env() -> dict[str, str]:
    """A worker's environment: one thread, in-process vLLM with a small KV cache, this repository importable."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=path,
    )


def lower_priority(nice: int) -> None:
    """Raise this process's niceness by ``nice``; where the sweep leads its own session, its autogroup's too.

    Linux schedules autogroups (one per session) against each other before niceness counts, so a sweep started
    with ``setsid`` would take its autogroup's full share whatever its niceness. The autogroup is raised only when
    the sweep (this worker's parent) leads the session: it then holds nothing but the sweep."""
    os.nice(nice)
    autogroup = Path("/proc/self/autogroup")
    if os.getsid(0) == os.getppid() and autogroup.exists():
        try:
            autogroup.write_text(str(min(19, max(-20, nice))))
        except OSError:  # not permitted (a lower value than now, or a kernel without autogroups): niceness alone
            pass


def launch_workers(
    runs: list[Run], work: Path, overrides: dict[str, Any], jobs: int, data: Path | None = None, nice: int = 0
) -> list[dict[str, Any]]:
    """Split ``runs`` over ``jobs`` worker processes (one torch thread each), wait, return the status lines.

    ``data``: collect each run into it as soon as it finishes (``work_through``); ``nice``: the workers' niceness
    increment (``os.nice``), so a long sweep yields the CPU to other work."""
    from tqdm.auto import tqdm

    logs = work / "_workers" / f"sweep-{os.getpid()}"  # two sweeps may share a work folder (different runs)
    logs.mkdir(parents=True, exist_ok=True)
    procs, status_paths = [], []
    jobs = min(jobs, len(runs))
    for i in range(jobs):
        # every jobs-th run of the seed-major list: the workers walk through the seeds side by side, so a sweep
        # stopped early leaves whole seed blocks finished
        share = runs[i::jobs]
        spec = logs / f"worker{i}.json"
        status = logs / f"worker{i}.status.jsonl"
        status.write_text("")
        spec.write_text(
            json.dumps(
                {
                    "runs": [[r.condition, r.method, r.seed] for r in share],
                    "work": str(work),
                    "overrides": overrides,
                    "status": str(status),
                    "data": None if data is None else str(data),
                }
            )
        )
        with (logs / f"worker{i}.log").open("a") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "experiments.sanity", "--worker", str(spec)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=worker_env(),
                    cwd=REPO,
                    preexec_fn=(lambda: lower_priority(nice)) if nice else None,
                )
            )
        status_paths.append(status)

    def statuses() -> list[dict[str, Any]]:
        return [json.loads(line) for path in status_paths for line in path.read_text().splitlines() if line.strip()]

    with tqdm(total=len(runs), desc="sanity runs", disable=None) as bar:
        while any(proc.poll() is None for proc in procs):
            time.sleep(2.0)
            done = statuses()
            bar.update(len(done) - bar.n)
            if done:
                bar.set_postfix_str(f"{done[-1]['run']}: {done[-1]['status']} {done[-1]['seconds']:.0f}s")
        bar.update(len(statuses()) - bar.n)
    for i, proc in enumerate(procs):
        if proc.returncode not in (0, 1):
            tail = (logs / f"worker{i}.log").read_text().splitlines()[-15:]
            raise RuntimeError(
                f"sweep worker {i} exited with {proc.returncode}; last lines of its log:\n" + "\n".join(tail)
            )
    return statuses()


# ---------------------------------------------------------------------------- collection
def _round(value: Any, digits: int = DIGITS) -> Any:
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        return float(f"{value:.{digits}g}")
    return value


def data_file_rows(records: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per record (``COLUMNS`` then ``BIN_COLUMNS``), floats to ``DIGITS`` significant digits (``EXACT``
    ones kept); the bin
    counts summed over the steps since the previous evaluation, on the evaluation's row (None elsewhere)."""
    rows = []
    window = {key: [0] * (len(MU_BIN_EDGES) - 1) for key in BIN_COLUMNS}
    for record in records:
        row = [_round(record.get(key), 12 if key in EXACT else DIGITS) for key in COLUMNS]
        for key in BIN_COLUMNS:
            for b, count in enumerate(record.get(key) or ()):
                window[key][b] += int(count)
        if record.get("eval_acc") is not None and record["step"] > 0:
            row += [list(window[key]) for key in BIN_COLUMNS]
            window = {key: [0] * (len(MU_BIN_EDGES) - 1) for key in BIN_COLUMNS}
        else:
            row += [None] * len(BIN_COLUMNS)
        rows.append(row)
    return rows


def collect(run: Run, config: TrainConfig, data: Path, cost: dict[str, float] | None = None) -> Path:
    """Write ``run``'s data file ``<data>/<condition>/<method>/seed<k>.jsonl``.

    Line 1: ``{"meta": {run, config, hosts (one per attempt), columns, mu_bin_edges}}`` (and ``cost``, the
    worker's measured ``cpu_s`` / ``wall_s`` for the run, when given); then one JSON array per metrics record, in
    ``columns`` order (``data_file_rows``).
    """
    from dppo_ext.trainer.metrics import read_metrics

    out = Path(config.out)
    target = data / run.condition / run.method / f"seed{run.seed}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    host_file = beside(config, HOST_SUFFIX)
    hosts = (
        [json.loads(line) for line in host_file.read_text().splitlines() if line.strip()] if host_file.is_file() else []
    )
    settings = {k: v for k, v in config.to_dict().items() if k not in ("out", "resume", "overwrite")}
    meta = {
        "run": run.name,
        "condition": run.condition,
        "method": run.method,
        "seed": run.seed,
        "config": settings,
        "hosts": hosts,
        "columns": [*COLUMNS, *BIN_COLUMNS],
        "mu_bin_edges": list(MU_BIN_EDGES),
        **({"cost": {k: round(v, 1) for k, v in cost.items()}} if cost else {}),
    }
    rows = data_file_rows(read_metrics(out / "metrics.jsonl"))
    # atomically: a reader (or a sweep stopped mid-write) never sees a half-written file
    return atomic_write_text(target, json.dumps({"meta": meta}) + "\n" + "".join(json.dumps(r) + "\n" for r in rows))


def read_data_file(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(meta, records)`` of a collected data file; each record a dict of the non-null columns.

    The earlier sweeps' files (one record dict a line, no meta line) read as ``({}, records)``.
    """
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or not isinstance(lines[0], dict) or "meta" not in lines[0]:  # the earlier sweeps: one dict a line
        return {}, lines
    meta = lines[0]["meta"]
    return meta, [{k: v for k, v in zip(meta["columns"], row) if v is not None} for row in lines[1:]]

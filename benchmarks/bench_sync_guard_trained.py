"""The sync guard's float32 |log pi - log mu| along a real training run, and what explains its largest values.

benchmarks/bench_sync_guard.py measures the guard on tiny random models (at most 7.6e-6 in float32). A model trained
for a few hundred RL steps has positions whose float32 forward is far worse conditioned. This trains one run of
the staleness experiment (experiments/sanity, default ``stale64/pg_is/seed12``: lag 64, so every evaluation pushes
the current weights into vLLM and the lagged ones back) with the guard measuring but not stopping the run, and prints:

- the distribution of the guard's largest |log pi - log mu| over all syncs of the run;
- for every sync above ``--outlier`` (default 1e-5, beyond anything seen on random models): the token where it
  occurred, vLLM's and the trainer's float32 log-prob each against the trainer's model in float64, and whether
  every directly comparable engine parameter equals the trainer's;
- the run's ``drift_mean`` (|pi_new - mu| of the sampled tokens after each step's update): at lag 0
  (``--condition stale0``) how far one RL step moves them, the smallest staleness a guard could be asked to catch.

    python benchmarks/bench_sync_guard_trained.py                         # ~4 min on one core
    python benchmarks/bench_sync_guard_trained.py --condition stale0 --out /tmp/guard.json

The run's folder goes to ``--work`` (default a temporary folder); ``--out`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# What the experiment's workers run with (experiments/sanity/sweep.py, worker_env), set before torch and vLLM load.
for key, value in dict(
    OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", TOKENIZERS_PARALLELISM="false"
).items():
    os.environ.setdefault(key, value)

import torch  # noqa: E402

import dppo_ext.rollout.sync_guard as sync_guard  # noqa: E402


class Recorder:
    """Wraps ``SyncGuard.check``: records every check and never raises on a difference (measuring only)."""

    def __init__(self, outlier: float) -> None:
        self.outlier = outlier
        self.checks: list[float] = []
        self.outliers: list[dict] = []
        self.original = sync_guard.SyncGuard.check

    def install(self) -> None:
        recorder = self

        def check(guard, llm, score, **kwargs):
            tolerances = dict(sync_guard.SYNC_TOLERANCES)
            sync_guard.SYNC_TOLERANCES.update({d: (float("inf"), 0.0) for d in tolerances})
            try:
                result = recorder.original(guard, llm, score, **kwargs)
            finally:
                sync_guard.SYNC_TOLERANCES.update(tolerances)
            if result is not None:
                recorder.checks.append(result.max_diff)
                if result.max_diff > recorder.outlier:
                    recorder.explain(guard, llm, score, kwargs, result.max_diff)
            return result

        sync_guard.SyncGuard.check = check

    def explain(self, guard, llm, score, kwargs, max_diff: float) -> None:
        ids = guard.probe
        mu = sync_guard.engine_logprobs(llm, ids)
        model = score.args[0]  # functools.partial(model_logprobs, model)
        pi32 = sync_guard.model_logprobs(model, ids).double()
        pi64 = sync_guard.model_logprobs(copy.deepcopy(model).double(), ids).double()
        worst = int((mu - pi32).abs().argmax())
        plan, tensors = kwargs.get("plan"), kwargs.get("trainer_tensors")
        stale = sync_guard.stale_parameters(llm, plan, tensors) if plan is not None and tensors else None
        self.outliers.append(
            {
                "check": len(self.checks),
                "max_diff": max_diff,
                "token": worst + 1,
                "tokens": len(ids) - 1,
                "log_pi": float(pi64[worst]),
                "vllm_vs_float64": float((mu - pi64)[worst]),
                "trainer_float32_vs_float64": float((pi32 - pi64)[worst]),
                "other_tokens_max_diff": float(torch.cat([(mu - pi32)[:worst], (mu - pi32)[worst + 1 :]]).abs().max())
                if len(ids) > 2
                else 0.0,
                "stale_parameters": stale,
            }
        )


def main() -> None:
    from experiments.sanity import sweep
    from experiments.sanity.conditions import CONDITIONS, Run

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--condition", default="stale64", choices=[c for c in CONDITIONS if c.startswith("stale")])
    parser.add_argument("--method", default="pg_is")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument("--outlier", type=float, default=1e-5)
    parser.add_argument("--work", type=Path, default=None, help="run folder root (default: a temporary folder)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    recorder = Recorder(args.outlier)
    recorder.install()
    run = Run(args.condition, args.method, args.seed)
    with tempfile.TemporaryDirectory(prefix="dppo-guard-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if sweep.work_through([run], work, {}, work / "status.jsonl", None):
            raise SystemExit(f"the run {run.name} failed: see {work}/{run.name}.train.log")
        config = sweep.run_config(run, work, {})
        records = [json.loads(line) for line in (Path(config.out) / "metrics.jsonl").read_text().splitlines()]
    drift = [r["drift_mean"] for r in records if r.get("drift_mean") is not None]
    checks = sorted(recorder.checks)
    figures = {
        "run": run.name,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "syncs": len(checks),
        "max_diff": {
            "median": statistics.median(checks),
            "p99": checks[min(len(checks) - 1, int(0.99 * len(checks)))],
            "max": checks[-1],
        },
        "float32_tolerance": sync_guard.SYNC_TOLERANCES[torch.float32],
        "outliers": recorder.outliers,
        "drift_mean_per_step": {"min": min(drift), "median": statistics.median(drift), "max": max(drift)},
    }
    print(
        f"{run.name} ({figures['torch_cpu_capability']}): {len(checks)} syncs, the guard's largest |log pi - log mu| "
        f"median {figures['max_diff']['median']:.2g}, p99 {figures['max_diff']['p99']:.2g}, "
        f"max {checks[-1]:.2g}; float32 accepts {figures['float32_tolerance'][0]:g} + "
        f"{figures['float32_tolerance'][1]:g} |log pi|"
    )
    for o in recorder.outliers:
        print(
            f"  sync {o['check']}: {o['max_diff']:.2g} at token {o['token']} of {o['tokens']} "
            f"(log pi {o['log_pi']:.2f}); vLLM - float64 {o['vllm_vs_float64']:+.2g}, trainer float32 - float64 "
            f"{o['trainer_float32_vs_float64']:+.2g}; other tokens <= {o['other_tokens_max_diff']:.2g}; "
            f"stale engine parameters: {o['stale_parameters']}"
        )
    d = figures["drift_mean_per_step"]
    print(
        f"  drift_mean (|pi_new - mu| after each step's update; at lag 0 one step's move): {d['min']:.2g}-"
        f"{d['max']:.2g}, median {d['median']:.2g}"
    )
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()

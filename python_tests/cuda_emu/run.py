"""Run the emulated CUDA kernels' checks by hand or from CI (.ci/run).

    python python_tests/cuda_emu/run.py [fiber] [asan] [tsan] [traffic] [mutations] [-- PYTEST_ARGS...]

  fiber      the whole test grid, fibers, plain -O1 build
  asan       a subset under AddressSanitizer (libasan preloaded into Python)
  tsan       a small subset under ThreadSanitizer, one OS thread per CUDA thread (libtsan preloaded,
             address-space randomization off for the child, as TSan's fixed shadow mapping needs)
  traffic    the test_traffic_* tests on a build that counts every global-memory load and store: each
             kernel moves the minimum, and the bytes per logit match benchmarks/results/cuda_traffic.json
  mutations  mutation_check.py: planted kernel bugs must each be caught (add --tsan-mutant to also
             require a TSan race report for each missing-__syncthreads mutant)

Each step builds its emulator library first (cached under build/cuda_emu/) and reports how long
the build and the run took. Exit status 0 only when every step passed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import emu_build  # noqa: E402

STEPS = ("fiber", "asan", "tsan", "traffic", "mutations")


def pytest_step(step: str, extra: list[str]) -> int:
    variant = {"fiber": "plain"}.get(step, step)
    t0 = time.monotonic()
    emu_build.build(variant)
    t_build = time.monotonic() - t0
    env = dict(
        os.environ, DPPO_CUDA_EMU=step, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("DPPO_CUDA_SPLIT", None)
    env.update(emu_build.sanitizer_env(variant))
    cmd = []
    if step == "tsan":
        env["OMP_NUM_THREADS"] = "1"  # torch's own (uninstrumented) OpenMP threads stay out of the picture
        cmd += emu_build.tsan_prefix()
    # -s: a sanitizer reports on fd 2 and aborts; pytest's output capture would swallow the report.
    cmd += [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_cuda_emu.py"), *extra]
    if step == "traffic":
        cmd += ["-k", "traffic"]
    if variant != "plain":
        cmd.append("-s")  # a sanitizer's report, the traffic table
    t1 = time.monotonic()
    rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
    print(f"[cuda_emu] {step}: build {t_build:.0f}s, tests {time.monotonic() - t1:.0f}s, exit {rc}", flush=True)
    return rc


def main() -> None:
    args = sys.argv[1:]
    extra = []
    if "--" in args:
        extra = args[args.index("--") + 1 :]
        args = args[: args.index("--")]
    tsan_mutant = "--tsan-mutant" in args
    steps = [a for a in args if a != "--tsan-mutant"] or ["fiber"]
    bad = [s for s in steps if s not in STEPS]
    if bad:
        raise SystemExit(f"unknown step(s) {bad}: choose from {STEPS}")
    failed = []
    for step in steps:
        t0 = time.monotonic()
        if step == "mutations":
            cmd = [sys.executable, str(HERE / "mutation_check.py")] + (["--tsan"] if tsan_mutant else [])
            rc = subprocess.run(cmd, cwd=REPO).returncode
            print(f"[cuda_emu] mutations: {time.monotonic() - t0:.0f}s, exit {rc}", flush=True)
        else:
            rc = pytest_step(step, extra)
        if rc != 0:
            failed.append(step)
    if failed:
        raise SystemExit(f"[cuda_emu] FAILED: {', '.join(failed)}")
    print(f"[cuda_emu] passed: {', '.join(steps)}")


if __name__ == "__main__":
    main()

"""scripts/gpu_check.sh's plumbing, on a machine without a GPU: its dry run (GPU_CHECK_DRY_RUN=1) runs
every step's driver up to the driver's first GPU call, so a broken flag, import, path or step wiring shows
here rather than in the few minutes of a GPU session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = ["build", "import", "selfcheck", "pytest", "memcheck", "bandwidth", "liger", "trainer", "racecheck"]


def _stand_in_liger_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel named liger_kernel: what travels in .whl/ for the liger step, without the real one
    (the GPU machine reaches no package index, and neither need CI)."""
    folder.mkdir()
    wheel = folder / "liger_kernel-0.0.1-py3-none-any.whl"
    info = "liger_kernel-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("liger_kernel/__init__.py", "")
        zf.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: liger-kernel\nVersion: 0.0.1\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(
            f"{info}/RECORD", f"liger_kernel/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
        )
    return wheel


@pytest.mark.slow
@pytest.mark.skipif(not list((REPO / "dppo_ext").glob("_C*.so")), reason="needs the built dppo_ext._C")
def test_gpu_check_dry_run_reaches_every_step(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DPPO_CUDA_SPLIT",)}
    env.update(
        GPU_CHECK_DRY_RUN="1",
        OUT=str(tmp_path),
        PYTHON=sys.executable,
        TORCH_CUDA_ARCH_LIST="9.0",
        GPU_CHECK_WHEELS=str(_stand_in_liger_wheel(tmp_path / "wheels").parent),
        TMPDIR=str(tmp_path),
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary) == STEPS, summary
    assert all(s["status"] == "dry run ok" for s in summary.values()), summary
    logs = {step: (tmp_path / f"{step}.log").read_text() for step in STEPS}
    for step in ("import", "selfcheck", "memcheck", "liger", "trainer", "racecheck"):
        assert "dry run: stopped before the first GPU call" in logs[step], (step, logs[step][-2000:])
    assert "the vocabulary-parallel check stopped before its first GPU call" in logs["selfcheck"], logs["selfcheck"]
    assert "needs_cuda" in logs["pytest"] or "collected" in logs["pytest"], logs["pytest"][-2000:]
    assert "PREDICTED (not measured)" in logs["bandwidth"], logs["bandwidth"][-2000:]
    # The carried wheel is installed for the liger step alone, and the comparison imports it from there (unless this
    # environment has liger_kernel already).
    if "installed in" not in logs["liger"]:
        assert "installing liger_kernel-0.0.1-py3-none-any.whl" in logs["liger"], logs["liger"][-2000:]
        assert f"liger_kernel importable: {tmp_path}/gpu_check_liger_site/" in logs["liger"], logs["liger"][-2000:]
    predicted = json.loads((tmp_path / "gpu_bandwidth_predicted.json").read_text())
    assert predicted["predicted"] and all(r["predicted_ms"] > 0 for r in predicted["rows"]), predicted

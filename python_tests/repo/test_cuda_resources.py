"""scripts/cuda_resources.py, the CUDA build's resource report (CI runs it on the real build log in
scripts/ci_cuda_build.sh and fails on any spill): its reading of ptxas' report and its occupancy."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cuda_resources.py"
spec = importlib.util.spec_from_file_location("cuda_resources", SCRIPT)
cuda_resources = importlib.util.module_from_spec(spec)
sys.modules["cuda_resources"] = cuda_resources
spec.loader.exec_module(cuda_resources)

# ptxas -v as nvcc 13.0 prints it (two kernels of cuda/dppo_loss.cu for sm_90, one for sm_80, and a
# non-inlined device function whose stack line must not be taken for a kernel's).
FWD = (
    "_ZN4dppo40_GLOBAL__N__2b65d104_8_kinst_cu_09f8ff8024dppo_loss_forward_kernelIffLb1EEEvNS0_13ForwardParamsIT_T0_EE"
)
FIN = (
    "_ZN4dppo40_GLOBAL__N__2b65d104_8_kinst_cu_09f8ff8031dppo_loss_forward_finish_kernelIddLb0EEEvNS0_13"
    "ForwardParamsIT_T0_EEPKS4_l"
)
LOG = f"""\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '{FWD}' for 'sm_90'
ptxas info    : Function properties for {FWD}
    16 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 16 bytes cumulative stack size, 352 bytes smem
ptxas info    : Compile time = 6182.414 ms
ptxas info    : Compiling entry function '{FIN}' for 'sm_90'
ptxas info    : Function properties for _Z6helperv
    40 bytes stack frame, 32 bytes spill stores, 32 bytes spill loads
ptxas info    : Function properties for {FIN}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 56 registers, used 1 barriers, 224 bytes smem
ptxas info    : Compiling entry function '{FWD}' for 'sm_80'
ptxas info    : Function properties for {FWD}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 77 registers, used 1 barriers, 352 bytes smem
"""


def test_parse_ptxas_reads_every_kernel_and_arch():
    kernels = {(k.name, k.arch): k for k in cuda_resources.parse_ptxas(LOG)}
    assert set(kernels) == {
        ("dppo_loss_forward_kernel<float, float, true>", "sm_90"),
        ("dppo_loss_forward_kernel<float, float, true>", "sm_80"),
        ("dppo_loss_forward_finish_kernel<double, double, false>", "sm_90"),
    }
    fwd = kernels[("dppo_loss_forward_kernel<float, float, true>", "sm_90")]
    assert (fwd.registers, fwd.spill_stores, fwd.spill_loads, fwd.stack, fwd.smem) == (64, 16, 16, 16, 352)
    fin = kernels[("dppo_loss_forward_finish_kernel<double, double, false>", "sm_90")]
    assert (fin.registers, fin.spill_stores, fin.stack, fin.smem) == (56, 0, 0, 224)  # not the helper's 40 / 32


def test_occupancy_follows_the_register_file():
    """256 threads at 64 registers: 2048 registers a warp, 32 warps fit, 4 blocks = 50 %; at 77 registers
    (rounded up to 80 per thread by the 256-register warp allocation) 25 warps fit, 3 blocks = 37.5 %; the
    128-thread finishing kernel at 56 registers: 36 warps, 9 blocks = 56.25 %."""
    ks = {(k.name.split("<")[0], k.arch): k for k in cuda_resources.parse_ptxas(LOG)}
    for k in ks.values():
        cuda_resources.occupancy(k)
    sm90, sm80 = ks[("dppo_loss_forward_kernel", "sm_90")], ks[("dppo_loss_forward_kernel", "sm_80")]
    assert (sm90.threads, sm90.blocks_per_sm, sm90.occupancy) == (256, 4, 0.5)
    assert (sm80.blocks_per_sm, sm80.occupancy) == (3, 0.375)
    fin = ks[("dppo_loss_forward_finish_kernel", "sm_90")]
    assert (fin.threads, fin.blocks_per_sm, fin.occupancy, fin.limited_by) == (128, 9, 0.5625, "registers")


@pytest.mark.slow
def test_fail_on_spill(tmp_path):
    log = tmp_path / "build.log"
    log.write_text(LOG)
    cmd = [sys.executable, str(SCRIPT), str(log), "--fail-on-spill"]
    proc = subprocess.run(cmd + ["--json", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "SPILL: dppo_loss_forward_kernel<float, float, true> on sm_90: 16 bytes" in proc.stderr
    assert "1 of 3 spill" in proc.stdout
    log.write_text(
        LOG.replace("16 bytes spill stores, 16 bytes spill loads", "0 bytes spill stores, 0 bytes spill loads")
    )
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    log.write_text("ninja: no work to do\n")  # a build without -Xptxas -v must not pass as "no spills"
    assert subprocess.run(cmd, capture_output=True).returncode == 1

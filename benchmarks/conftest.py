"""pytest-benchmark suite of the op-level microbenchmarks (test_bench_*.py): shared setup.

Not collected by the test suite (pyproject's ``testpaths`` is python_tests). Every saved run records the
host's SIMD level and the instruction set dppo_ext's CPU kernels ran with, next to pytest-benchmark's own
machine description, so ``--benchmark-compare`` shows when two runs came from different hosts.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib.machine import cpu_simd  # noqa: E402


def pytest_benchmark_update_machine_info(config, machine_info: dict) -> None:
    import torch

    import dppo_ext

    machine_info["cpu_simd"] = cpu_simd()
    machine_info["dppo_ext_cpu_capability"] = dppo_ext.cpu_capability
    machine_info["torch"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["loadavg"] = os.getloadavg()

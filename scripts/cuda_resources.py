"""Resource usage of every CUDA kernel of a build: registers, spills, shared memory, occupancy.

Reads ptxas' report (the build log of a build with `nvcc -Xptxas -v`, which scripts/ci_cuda_build.sh
makes through NVCC_APPEND_FLAGS) and prints, for every kernel instantiation and every architecture it
was compiled for: registers per thread, spill stores and loads, stack frame, static shared memory, the
threads per block the launch policy gives it (csrc/cuda/launch_policy.cuh) and the theoretical
occupancy that follows (resident blocks per SM from the register, shared-memory, thread and block
limits of the architecture; warps resident / the SM's maximum).

    python scripts/cuda_resources.py BUILD_LOG [--json OUT] [--fail-on-spill]

Exit status 1 with --fail-on-spill when any kernel spills (or when the log holds no kernel at all).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

# Threads per block of each kernel as the launch policy launches it (csrc/cuda/launch_policy.cuh's table;
# python_tests/cuda_emu checks these against the emulated launches).
BLOCK_THREADS = {
    "dppo_loss_forward_kernel": 256,
    "dppo_loss_forward_partial_kernel": 256,
    "dppo_loss_forward_finish_kernel": 128,
    "dppo_loss_backward_kernel": 256,
    "dppo_loss_backward_kept_kernel": 256,
    "vp_stats_kernel": 256,
    "vp_epilogue_kernel": 128,
}

# Per-SM limits (CUDA C Programming Guide, compute capabilities table): registers, register allocation unit
# (per warp), shared memory usable by blocks, shared memory the system reserves per block, threads, blocks.
ARCH_LIMITS = {
    "sm_80": dict(regs=65536, reg_unit=256, smem=167936, smem_reserved=1024, threads=2048, blocks=32, warps=64),
    "sm_90": dict(regs=65536, reg_unit=256, smem=233472, smem_reserved=1024, threads=2048, blocks=32, warps=64),
}


@dataclass
class Kernel:
    name: str  # demangled, without namespaces and parameters
    mangled: str
    arch: str
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    smem: int = 0
    threads: int | None = None
    blocks_per_sm: int | None = None
    occupancy: float | None = None
    limited_by: str = ""


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> short name ("dppo_loss_forward_kernel<float, float, true>"), with c++filt when present."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    out = {}
    demangled = names
    if tool and names:
        proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False)
        if proc.returncode == 0 and len(proc.stdout.splitlines()) == len(names):
            demangled = proc.stdout.splitlines()
    for mangled, full in zip(names, demangled):
        short = re.sub(r"\(anonymous namespace\)::|dppo::|c10::", "", full)
        short = re.sub(r"^void ", "", short)
        if ">(" in short:
            short = short[: short.index(">(") + 1]
        out[mangled] = short
    return out


def parse_ptxas(log: str) -> list[Kernel]:
    """The kernels of ptxas -v output: one entry per (function, arch) block of "Compiling entry function"."""
    kernels: list[Kernel] = []
    current: Kernel | None = None
    props_of = ""  # the function the next "bytes stack frame" line describes
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            current = Kernel(name=m.group(1), mangled=m.group(1), arch=m.group(2))
            kernels.append(current)
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props_of = m.group(1)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and props_of == current.mangled:  # (not a non-inlined device function's)
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            current.smem = int(s.group(1)) if s else 0
            current = None  # the "Used" line closes the function's block
    # A build compiles each translation unit once per arch; keep one entry per (kernel, arch).
    unique = {(k.mangled, k.arch): k for k in kernels}
    names = demangle(sorted({k.mangled for k in unique.values()}))
    for k in unique.values():
        k.name = names.get(k.mangled, k.mangled)
    return sorted(unique.values(), key=lambda k: (k.name, k.arch))


def occupancy(k: Kernel) -> None:
    """Fill in the launch policy's threads per block and the theoretical occupancy on k.arch."""
    base = k.name.split("<")[0]
    k.threads = BLOCK_THREADS.get(base)
    lim = ARCH_LIMITS.get(k.arch)
    if k.threads is None or lim is None:
        return
    warps = math.ceil(k.threads / 32)
    regs_per_warp = math.ceil(max(k.registers, 1) * 32 / lim["reg_unit"]) * lim["reg_unit"]
    limits = {
        "registers": (lim["regs"] // regs_per_warp) // warps,
        "threads": lim["threads"] // k.threads,
        "blocks": lim["blocks"],
        "shared memory": lim["smem"] // (k.smem + lim["smem_reserved"]),
    }
    k.limited_by = min(limits, key=lambda key: limits[key])
    k.blocks_per_sm = limits[k.limited_by]
    k.occupancy = k.blocks_per_sm * warps / lim["warps"]


def table(kernels: list[Kernel]) -> str:
    head = (
        f"{'kernel':58s} {'arch':6s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s} {'smem':>5s} "
        f"{'block':>5s} {'blocks/SM':>9s} {'occupancy':>9s}  limited by"
    )
    rows = [head, "-" * len(head)]
    for k in kernels:
        occ = f"{100 * k.occupancy:8.1f}%" if k.occupancy is not None else f"{'?':>9s}"
        rows.append(
            f"{k.name:58s} {k.arch:6s} {k.registers:4d} {f'{k.spill_stores}/{k.spill_loads}':>11s} "
            f"{k.stack:5d} {k.smem:5d} {k.threads or 0:5d} {k.blocks_per_sm or 0:9d} {occ}  {k.limited_by}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path, help="build log with ptxas -v output")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--fail-on-spill", action="store_true", help="exit 1 when any kernel spills")
    args = ap.parse_args(argv)
    kernels = parse_ptxas(args.log.read_text(errors="replace"))
    for k in kernels:
        occupancy(k)
    print(table(kernels))
    archs = sorted({k.arch for k in kernels})
    spills = [k for k in kernels if k.spill_stores or k.spill_loads]
    unknown = sorted({k.name for k in kernels if k.threads is None})
    print(
        f"\n{len({k.name for k in kernels})} kernel instantiations x {len(archs)} archs ({', '.join(archs)}): "
        f"{len(spills)} of {len(kernels)} spill"
    )
    if unknown:
        print(f"no launch configuration known for: {', '.join(unknown)} (add them to BLOCK_THREADS)")
    if args.json:
        args.json.write_text(json.dumps([asdict(k) for k in kernels], indent=1) + "\n")
    if args.fail_on_spill and (spills or not kernels or unknown):
        for k in spills:
            print(
                f"SPILL: {k.name} on {k.arch}: {k.spill_stores} bytes stored, {k.spill_loads} bytes loaded "
                f"at {k.registers} registers",
                file=sys.stderr,
            )
        if not kernels:
            print(f"no ptxas report in {args.log} (was the build made with -Xptxas -v?)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

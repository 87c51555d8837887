"""Build and load the CPU emulation of the CUDA kernels (torch.ops.dppo_cuda_emu.*).

One translation unit, emu_ops.cpp, compiles the op bodies and kernels headers nvcc compiles
(csrc/cuda/entry_points.cuh and every header it includes), unchanged, with the host compiler against
the emulation layer cuda_emu.h and the CPU torch's headers, plus the emulator's engine and controls,
into one shared library with an op namespace of its own. A test tool: it is built into
build/cuda_emu/ (or a folder given), never into the wheel.

Variants: ``plain`` (-O1, FMA contraction as nvcc), ``asan`` (AddressSanitizer), ``tsan`` (ThreadSanitizer),
``traffic`` (every global-memory access counted, cuda_emu_traffic.h). Sanitized libraries need the sanitizer
runtime preloaded into Python: see ``sanitizer_env``.

    python python_tests/cuda_emu/emu_build.py [--variant plain|asan|tsan] [--csrc DIR] [--out DIR]

prints the library's path (rebuilt only when a source, flag, compiler or torch changed).

Most of a build is parsing torch's headers. With g++, each variant first precompiles the part of emu_ops.cpp that
no tree under test can change (its leading includes: cuda_emu.h, ATen, torch/library.h, the standard headers) into
build/cuda_emu/pch-<variant>-<hash>/, keyed by the variant's flags, the compiler, torch and every emulator header,
and every build of that variant (the repo's and each mutant's) then starts from it (``-include``, ``-Winvalid-pch``).
The library is byte for byte the one a build without it makes; a header g++ refuses is parsed as text, and said so.
``DPPO_CUDA_EMU_PCH=0`` builds without it.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VARIANTS = ("plain", "asan", "tsan", "traffic")
LIB_NAME = "dppo_cuda_emu.so"
SOURCES = ("emu_ops.cpp",)
KERNEL_HEADERS = (
    "entry_points.cuh",
    "launch_policy.cuh",
    "common.cuh",
    "dppo_loss_forward_kernels.cuh",
    "dppo_loss_backward_kernels.cuh",
    "vocab_parallel_kernels.cuh",
)


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


def _flags(variant: str) -> list[str]:
    # Floating-point contraction both ways: the plain (fiber) build contracts a * b + c into an FMA wherever it
    # can, as nvcc does by default (-ffp-contract=fast with FMA instructions; g++ contracts only with
    # -fexpensive-optimizations, off at -O1), so a plain `*` where the kernels need an intrinsic's separate
    # rounding (__fmul_rn, kept unfused by cuda_emu.h) shows; the sanitizer and traffic builds keep every
    # operation rounded on its own (-ffp-contract=off).
    flags = [
        "-std=c++20",
        "-O1",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        "-Wall",
        "-Wno-unknown-pragmas",
        "-pthread",
        "-U_FORTIFY_SOURCE",
    ]  # fiber switches _longjmp between stacks, which fortify forbids
    contract = ["-ffp-contract=fast", "-mfma", "-fexpensive-optimizations"]
    flags += contract if variant == "plain" else ["-ffp-contract=off"]
    if variant == "plain":
        flags.append("-g0")
    elif variant == "asan":
        flags += ["-g1", "-fsanitize=address", "-fno-omit-frame-pointer"]
    elif variant == "tsan":
        flags += ["-g1", "-fsanitize=thread"]
    elif variant == "traffic":
        # Every load and store becomes a call into cuda_emu_traffic.h's hooks (no sanitizer runtime).
        flags += [
            "-g0",
            "-DCUDA_EMU_TRAFFIC",
            "-fsanitize=kernel-address",
            "--param=asan-stack=0",
            "--param=asan-globals=0",
            "--param=asan-instrumentation-with-call-threshold=0",
            "--param=asan-instrument-allocas=0",
        ]
    else:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return flags


def _inputs(csrc: Path) -> list[Path]:
    files = sorted(HERE.glob("*.h")) + sorted(HERE.glob("*.cpp")) + sorted((HERE / "stubs").rglob("*.h"))
    files += sorted(csrc.glob("*.h")) + sorted((csrc / "cuda").glob("*.cuh"))
    return files


def _compile_args(variant: str, csrc: Path | None) -> list[str]:
    """The compiler, flags and include folders; the tree under test's cuda/ folder only when csrc is given."""
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [_cxx(), *_flags(variant), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", str(HERE / "stubs")]
    if csrc is not None:
        cmd += ["-I", str(csrc / "cuda")]
    cmd += ["-I", str(HERE)]
    for inc in cpp_extension.include_paths():
        cmd += ["-isystem", inc]
    return cmd


def command(variant: str, csrc: Path, out: Path, pch: Path | None = None) -> list[str]:
    """The compiler command line that builds the emulator library at `out` (from the precompiled `pch` header
    when given: see `precompiled_header`)."""
    from torch.utils import cpp_extension

    cmd = _compile_args(variant, csrc)
    if pch is not None:
        cmd += ["-include", str(pch), "-Winvalid-pch"]
    cmd += [str(HERE / src) for src in SOURCES] + ["-o", str(out)]
    for lib in cpp_extension.library_paths():
        cmd += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch"]
    return cmd


def _pch_text() -> str:
    """emu_ops.cpp's leading #include lines, up to the first that is neither a system header nor the
    emulator's own (the first from the tree under test): what every build of a variant parses alike."""
    lines = []
    for line in (HERE / SOURCES[0]).read_text().splitlines():
        if not line.strip() or line.startswith("//"):
            continue
        m = re.match(r'#include\s+(<[^>]+>|"([^"]+)")', line)
        if m is None or (m.group(2) is not None and not (HERE / m.group(2)).is_file()):
            break
        lines.append(f"#include {m.group(1)}")
    return "".join(f"{line}\n" for line in lines)


def precompiled_header(variant: str, quiet: bool = False) -> Path | None:
    """Builds (if not current) the variant's precompiled header and returns the header to pass to `-include`
    (its .gch beside it), or None: not g++, DPPO_CUDA_EMU_PCH=0, or it did not compile (the build then parses
    everything as text and reports the error itself)."""
    import torch

    cxx_version = subprocess.run([_cxx(), "--version"], capture_output=True, text=True, check=True).stdout
    if os.environ.get("DPPO_CUDA_EMU_PCH", "1") == "0" or "Free Software Foundation" not in cxx_version:
        return None
    text = _pch_text()
    # g++ itself refuses a .gch made by another compiler or with other flags or macros (-Winvalid-pch then says so
    # and the header is parsed as text), but not one whose headers have changed since: the key holds their contents.
    args = [a for a in _compile_args(variant, None) if a != "-shared"]
    h = hashlib.sha256()
    for f in sorted(HERE.glob("*.h")) + sorted((HERE / "stubs").rglob("*.h")):
        h.update(str(f.relative_to(HERE)).encode())
        h.update(f.read_bytes())
    h.update("\0".join([*args, text, cxx_version, torch.__version__, str(torch.version.git_version)]).encode())
    digest = h.hexdigest()[:16]
    folder = REPO / "build" / "cuda_emu" / f"pch-{variant}-{digest}"
    header, gch = folder / "emu_pch.h", folder / "emu_pch.h.gch"
    folder.mkdir(parents=True, exist_ok=True)
    # One builder at a time: flock holds between processes and between threads (each open() is its own lock).
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if gch.is_file() and header.is_file() and header.read_text() == text:
            return header
        header.write_text(text)
        tmp = folder / f"emu_pch.h.gch.tmp{os.getpid()}"
        if not quiet:
            print(f"[cuda_emu] precompiling the {variant} emulator's headers ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([*args, "-x", "c++-header", str(header), "-o", str(tmp)], capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            print(f"[cuda_emu] no precompiled header ({proc.stderr[-2000:]})", file=sys.stderr, flush=True)
            return None
        os.replace(tmp, gch)
        if not quiet:
            print(f"[cuda_emu] precompiled {gch} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        return header


def build(variant: str = "plain", csrc: Path | None = None, out_dir: Path | None = None, quiet: bool = False) -> Path:
    """Builds (if not current) and returns the path of the emulator library."""
    import torch

    csrc = Path(csrc or REPO / "csrc").resolve()
    for header in KERNEL_HEADERS:
        if not (csrc / "cuda" / header).is_file():
            raise FileNotFoundError(f"no cuda/{header} under csrc={csrc}")
    h = hashlib.sha256()
    for f in _inputs(csrc):
        h.update(str(f.relative_to(f.anchor)).encode())
        h.update(f.read_bytes())
    cxx_version = subprocess.run([_cxx(), "--version"], capture_output=True, text=True, check=True).stdout
    h.update(" ".join(_flags(variant) + [cxx_version, torch.__version__, str(csrc)]).encode())
    digest = h.hexdigest()[:16]
    out_dir = Path(out_dir or REPO / "build" / "cuda_emu" / f"{variant}-{digest}")
    lib = out_dir / LIB_NAME
    if lib.is_file() and (out_dir / "hash").is_file() and (out_dir / "hash").read_text() == digest:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (LIB_NAME + f".tmp{os.getpid()}")
    pch = precompiled_header(variant, quiet)
    cmd = command(variant, csrc, tmp, pch)
    if not quiet:
        print(f"[cuda_emu] building the {variant} emulator ({csrc}) ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the CUDA emulator build failed ({' '.join(cmd)}):\n{proc.stderr[-6000:]}")
    if pch is not None and f"{pch.name}.gch" in proc.stderr:  # -Winvalid-pch: g++ refused it, parsed the text
        print(f"[cuda_emu] {pch}.gch not used, built without it:\n{proc.stderr[-2000:]}", file=sys.stderr, flush=True)
    os.replace(tmp, lib)
    (out_dir / "hash").write_text(digest)
    if not quiet:
        print(f"[cuda_emu] built {lib} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return lib


def load(variant: str = "plain", csrc: Path | None = None, out_dir: Path | None = None):
    """Builds if needed, loads the library into this process and returns torch.ops.dppo_cuda_emu.
    One emulator library per process (its op namespace can be registered once)."""
    import torch

    lib = build(variant, csrc, out_dir)
    torch.ops.load_library(str(lib))
    ops = torch.ops.dppo_cuda_emu
    if ops.sanitizer() != {"plain": "none", "asan": "address", "tsan": "thread", "traffic": "traffic"}[variant]:
        raise RuntimeError(f"{lib} is not the {variant} build (sanitizer {ops.sanitizer()!r})")
    ops.shared_vars()  # a function-local static of the kernels' namespace that is not __shared__ stops here
    return ops


def sanitizer_env(variant: str) -> dict[str, str]:
    """Environment additions that let Python load a sanitized emulator (the sanitizer runtime must
    be the first library loaded, hence LD_PRELOAD). Empty for the plain build."""
    if variant in ("plain", "traffic"):
        return {}
    # libstdc++ too: Python does not link it, and a sanitizer that starts before it is loaded cannot
    # intercept __cxa_throw (the first C++ exception then aborts the process).
    paths = []
    for name in ({"asan": "libasan.so", "tsan": "libtsan.so"}[variant], "libstdc++.so"):
        path = subprocess.run(
            [_cxx(), f"-print-file-name={name}"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if not os.path.isabs(path):
            raise RuntimeError(f"{_cxx()} does not know where {name} is (got {path!r})")
        paths.append(os.path.realpath(path))
    env = {"LD_PRELOAD": " ".join(paths)}
    if variant == "asan":
        # Python and torch leak by design at exit; the test run is about the kernels' memory accesses.
        env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=1:halt_on_error=1"
    else:
        env["TSAN_OPTIONS"] = "halt_on_error=1:abort_on_error=1:report_signal_unsafe=0"
    return env


def tsan_prefix() -> list[str]:
    """ThreadSanitizer maps its shadow at fixed addresses; with the kernel's default ASLR entropy
    (mmap_rnd_bits 32 on x86-64) it fails at start. `setarch -R` turns randomization off for the child."""
    return ["setarch", os.uname().machine, "-R"] if shutil.which("setarch") else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=VARIANTS, default="plain")
    ap.add_argument("--csrc", type=Path, default=None, help="the csrc tree to compile (default: the repo's)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: build/cuda_emu/<variant>-<hash>)")
    args = ap.parse_args()
    print(build(args.variant, args.csrc, args.out))


if __name__ == "__main__":
    main()

"""Build script for dppo_ext's native library `dppo_ext._C`.

The CPU kernels are always built. The CUDA kernels are built when the installed torch has CUDA and
a CUDA toolkit is found (CUDA_HOME, or torch's guess), whether or not a GPU is visible.

Environment overrides:
  DPPO_FORCE_CUDA=1        fail if the CUDA kernels cannot be built (instead of a CPU-only build)
  DPPO_DISABLE_CUDA=1      build the CPU kernels only
  TORCH_CUDA_ARCH_LIST     CUDA archs (default "8.0;9.0+PTX": Ampere, Hopper, plus PTX)
  DPPO_CPU_CAPABILITY      avx512 | avx2 | default (default: the best the build machine supports)
  DPPO_DEBUG=1             -O0 -g, line info in device code
  MAX_JOBS                 parallel compile jobs (ninja)
"""

import os
import re
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
DEFAULT_ARCHS = "8.0;9.0+PTX"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _cpu_capability() -> str:
    """Pick the at::vec width for the CPU kernels from the build machine's CPU flags."""
    requested = os.environ.get("DPPO_CPU_CAPABILITY", "").lower()
    if requested:
        if requested not in ("avx512", "avx2", "default"):
            sys.exit(f"DPPO_CPU_CAPABILITY must be avx512, avx2 or default, got {requested!r}")
        return requested
    try:
        flags = set(re.findall(r"\b\w+\b", Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0]))
    except (OSError, IndexError):
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "default"


def _find_cuda_home():
    """CUDA_HOME, else the toolkit folder whose lib64 holds libcudart (not the folder above a
    symlinked nvcc, which is what torch guesses when nvcc lives in a general bin folder)."""
    from torch.utils import cpp_extension

    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = cpp_extension.shutil.which("nvcc") if hasattr(cpp_extension, "shutil") else None
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent.parent))
    candidates += ["/usr/local/cuda", cpp_extension.CUDA_HOME]
    for cand in candidates:
        if cand and (Path(cand) / "bin" / "nvcc").exists() and any(
            (Path(cand) / lib / "libcudart.so").exists() for lib in ("lib64", "lib", "targets/x86_64-linux/lib")
        ):
            return str(Path(cand).resolve())
    return None


def build_extensions():
    import torch
    from torch.utils import cpp_extension

    cpu_cap = _cpu_capability()
    # torch >= 2.14's headers require C++20; older ones build as C++17.
    torch_minor = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    std = "-std=c++20" if torch_minor >= (2, 14) else "-std=c++17"
    # -ffp-contract=off: z * (1/T) - max must round the product on its own; an FMA keeps the
    # product's residual, which for |z| ~ 1e30 is itself huge and overflows exp().
    cxx = ["-O3" if not _env_flag("DPPO_DEBUG") else "-O0", std, "-fopenmp", "-ffp-contract=off",
           f"-DDPPO_VERSION=\"{VERSION}\"", f"-DDPPO_TORCH_VERSION=\"{torch.__version__}\""]
    if _env_flag("DPPO_DEBUG"):
        cxx.append("-g")
    if cpu_cap == "avx512":
        cxx += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-DDPPO_CPU_CAPABILITY=\"avx512\""]
    elif cpu_cap == "avx2":
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2",
                "-DDPPO_CPU_CAPABILITY=\"avx2\""]
    else:
        cxx += ["-DCPU_CAPABILITY=DEFAULT", "-DDPPO_CPU_CAPABILITY=\"default\""]

    sources = ["csrc/ops.cpp", "csrc/bindings.cpp"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cpu").glob("*.cpp"))
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cuda").glob("*.cu"))

    with_cuda = False
    reason = ""
    if _env_flag("DPPO_DISABLE_CUDA"):
        reason = "DPPO_DISABLE_CUDA=1"
    elif torch.version.cuda is None:
        reason = f"torch {torch.__version__} is a CPU build"
    elif not cuda_sources:
        reason = "no csrc/cuda/*.cu sources"
    else:
        cuda_home = _find_cuda_home()
        if cuda_home is None:
            reason = "no CUDA toolkit found (set CUDA_HOME to the folder whose lib64 holds libcudart.so)"
        else:
            os.environ["CUDA_HOME"] = cuda_home
            cpp_extension.CUDA_HOME = cuda_home
            with_cuda = True
    if not with_cuda and _env_flag("DPPO_FORCE_CUDA"):
        sys.exit(f"DPPO_FORCE_CUDA=1 but the CUDA kernels cannot be built: {reason}")

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    nvcc = ["-O3" if not _env_flag("DPPO_DEBUG") else "-O0", std, "--use_fast_math",
            "--expt-relaxed-constexpr", "-lineinfo", f"-DDPPO_VERSION=\"{VERSION}\""]
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        cxx.append("-DDPPO_WITH_CUDA")
        nvcc.append("-DDPPO_WITH_CUDA")
        cxx.append(f"-DDPPO_CUDA_ARCH_LIST=\"{archs}\"")
        ext = cpp_extension.CUDAExtension(
            "dppo_ext._C", sources + cuda_sources, include_dirs=[str(ROOT / "csrc")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc}, extra_link_args=["-fopenmp"])
    else:
        ext = cpp_extension.CppExtension(
            "dppo_ext._C", sources, include_dirs=[str(ROOT / "csrc")],
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])

    print("=" * 72)
    print(f"dppo_ext {VERSION} build summary")
    print(f"  torch            : {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"  CPU kernels      : yes, at::vec capability {cpu_cap}")
    print(f"  CUDA kernels     : {'yes' if with_cuda else 'no'}" + (f" ({reason})" if reason else ""))
    if with_cuda:
        print(f"  CUDA_HOME        : {os.environ['CUDA_HOME']}")
        print(f"  CUDA archs       : {archs}")
    print("=" * 72)
    return [ext], cpp_extension.BuildExtension.with_options(use_ninja=True)


ext_modules, build_ext = build_extensions()
setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})

"""Build script for dppo_ext's native library `dppo_ext._C`.

The library is compiled against the torch that is installed in the environment, so it must be
built with pip's --no-build-isolation (pip's default isolated build would fetch another torch):

    pip install "setuptools>=77" ninja      # plus the torch you want (CPU or CUDA build)
    pip install --no-build-isolation .      # or -e . for a development checkout

The CPU kernels are always built, once per x86 instruction set (default, AVX2, AVX-512; the
running CPU picks one at import, see csrc/cpu/dispatch.h). The CUDA kernels are built when the
installed torch has CUDA and a CUDA toolkit is found (CUDA_HOME, or torch's guess), whether or not
a GPU is visible. Building a source distribution (python -m build --sdist) needs no torch.

Environment overrides:
  DPPO_FORCE_CUDA=1        fail if the CUDA kernels cannot be built (instead of a CPU-only build)
  DPPO_DISABLE_CUDA=1      build the CPU kernels only
  TORCH_CUDA_ARCH_LIST     CUDA archs (default "8.0;9.0+PTX": Ampere, Hopper, plus PTX)
  DPPO_DEBUG=1             -O0 -g, line info in device code
  MAX_JOBS                 parallel compile jobs (ninja)
At run time, DPPO_CPU_CAPABILITY=default|avx2|avx512 overrides the CPU kernels' instruction set.
"""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import setuptools
from setuptools import setup

ROOT = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "dppo_ext" / "_version.py").read_text(), re.M).group(1)
DEFAULT_ARCHS = "8.0;9.0+PTX"
MIN_SETUPTOOLS = (77, 0)  # the SPDX `license = "Apache-2.0"` string in pyproject.toml (PEP 639)
INSTALL_HINT = (
    'pip install "setuptools>=77" ninja && pip install --no-build-isolation <the path or URL you gave pip> '
    "(in a clone: -e .)"
)

# Compiled once per instruction set (CPU_CAPABILITY), in that order: the baseline build links
# first, so an inline function that several builds emit resolves to its baseline copy.
CPU_ISA_SOURCES = ["csrc/cpu/dppo_loss.cpp", "csrc/cpu/vocab_parallel.cpp"]
CPU_ISA_BUILDS = [
    ("DEFAULT", []),
    ("AVX2", ["-mavx2", "-mfma", "-mf16c"]),
    # (torch's vec512 headers trip GCC's maybe-uninitialized and unknown-pragma warnings by the
    # thousand lines; silenced for that build only.)
    (
        "AVX512",
        [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-Wno-maybe-uninitialized",
            "-Wno-unknown-pragmas",
        ],
    ),
]
# Commands that compile the library (an sdist, egg_info or dist_info needs no torch).
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install", "bdist_egg"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _fail(msg: str) -> None:
    sys.stderr.write("\n" + "=" * 72 + f"\ndppo_ext: {msg}\n" + "=" * 72 + "\n\n")
    sys.exit(1)


def _torch_outside_build_env():
    """The torch version this interpreter sees without pip's build isolation (None if none)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")}
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _check_build_environment() -> None:
    """Stop before compiling anything when the build cannot produce a library that imports."""
    have = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if have < MIN_SETUPTOOLS:
        _fail(f"setuptools {setuptools.__version__} is too old to build dppo_ext (need >= 77).\nRun: {INSTALL_HINT}")
    try:
        import torch  # noqa: F401
    except ImportError:
        outside = _torch_outside_build_env()
        if outside:
            _fail(
                f"torch is not visible to this build, but torch {outside} is installed in {sys.prefix}.\n"
                "pip is building in an isolated environment (its default); dppo_ext's native library must be\n"
                "compiled against the torch you run, so build it with --no-build-isolation:\n"
                f"  {INSTALL_HINT}"
            )
        _fail(
            "torch is not installed. dppo_ext's native library is compiled against the installed torch\n"
            "(>= 2.11, the CPU or the CUDA build you want): install it first, then build without isolation:\n"
            f"  pip install torch && {INSTALL_HINT}"
        )


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
        if (
            cand
            and (Path(cand) / "bin" / "nvcc").exists()
            and any(
                (Path(cand) / lib / "libcudart.so").exists() for lib in ("lib64", "lib", "targets/x86_64-linux/lib")
            )
        ):
            return str(Path(cand).resolve())
    return None


def _cpu_isa_builds():
    """The instruction sets to compile the CPU kernels for: all three on x86-64, else the baseline."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        return CPU_ISA_BUILDS
    return CPU_ISA_BUILDS[:1]


def build_extensions():
    import torch
    from torch.utils import cpp_extension

    isa_builds = _cpu_isa_builds()
    isa_names = [name for name, _ in isa_builds]
    # torch >= 2.14's headers require C++20; older ones build as C++17.
    torch_minor = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    std = "-std=c++20" if torch_minor >= (2, 14) else "-std=c++17"
    # -ffp-contract=off: z * (1/T) - max must round the product on its own; an FMA keeps the
    # product's residual, which for |z| ~ 1e30 is itself huge and overflows exp().
    cxx = [
        "-O3" if not _env_flag("DPPO_DEBUG") else "-O0",
        std,
        "-fopenmp",
        "-ffp-contract=off",
        f'-DDPPO_VERSION="{VERSION}"',
        f'-DDPPO_TORCH_VERSION="{torch.__version__}"',
    ]
    cxx += [f"-DDPPO_CPU_HAVE_{name}" for name in isa_names if name != "DEFAULT"]
    if _env_flag("DPPO_DEBUG"):
        cxx.append("-g")

    isa_sources = set(CPU_ISA_SOURCES)
    cpu_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cpu").glob("*.cpp"))
    sources = ["csrc/ops.cpp", "csrc/bindings.cpp"] + [s for s in cpu_sources if s not in isa_sources]
    cuda_sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc/cuda").glob("*.cu"))
    headers = sorted(str(p.relative_to(ROOT)) for ext in ("*.h", "*.cuh") for p in (ROOT / "csrc").rglob(ext))

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
        _fail(f"DPPO_FORCE_CUDA=1 but the CUDA kernels cannot be built: {reason}")

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    nvcc = [
        "-O3" if not _env_flag("DPPO_DEBUG") else "-O0",
        std,
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-lineinfo",
        f'-DDPPO_VERSION="{VERSION}"',
    ]
    common = dict(include_dirs=[str(ROOT / "csrc")], extra_link_args=["-fopenmp"], depends=CPU_ISA_SOURCES + headers)
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        cxx.append("-DDPPO_WITH_CUDA")
        nvcc.append("-DDPPO_WITH_CUDA")
        cxx.append(f'-DDPPO_CUDA_ARCH_LIST="{archs}"')
        ext = cpp_extension.CUDAExtension(
            "dppo_ext._C", sources + cuda_sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **common
        )
    else:
        ext = cpp_extension.CppExtension("dppo_ext._C", sources, extra_compile_args={"cxx": cxx}, **common)

    class BuildExtension(cpp_extension.BuildExtension.with_options(use_ninja=True)):
        """torch's BuildExtension, plus the CPU kernel files compiled once per instruction set.

        Each build goes to its own folder (same source, different flags) and is linked after the
        extension's own objects, baseline first."""

        def build_extension(self, extension):
            base = extension.extra_compile_args
            base_cxx = list(base["cxx"] if isinstance(base, dict) else base)
            objects = []
            for name, flags in isa_builds:
                objects += self.compiler.compile(
                    CPU_ISA_SOURCES,
                    output_dir=os.path.join(self.build_temp, f"cpu_{name.lower()}"),
                    macros=list(extension.define_macros) + [("CPU_CAPABILITY", name), (f"CPU_CAPABILITY_{name}", None)],
                    include_dirs=extension.include_dirs,
                    debug=self.debug,
                    extra_postargs={"cxx": base_cxx + flags, "nvcc": []},
                    depends=extension.depends,
                )
            extension.extra_objects = objects
            super().build_extension(extension)

    print("=" * 72)
    print(f"dppo_ext {VERSION} build summary")
    print(f"  torch            : {torch.__version__} (CUDA {torch.version.cuda})")
    print(
        f"  CPU kernels      : yes, one build per instruction set: {', '.join(n.lower() for n in isa_names)}"
        " (chosen at run time)"
    )
    print(f"  CUDA kernels     : {'yes' if with_cuda else 'no'}" + (f" ({reason})" if reason else ""))
    if with_cuda:
        print(f"  CUDA_HOME        : {os.environ['CUDA_HOME']}")
        print(f"  CUDA archs       : {archs}")
    print("=" * 72)
    return [ext], BuildExtension


if BUILD_COMMANDS & set(sys.argv[1:]):
    _check_build_environment()
    ext_modules, build_ext = build_extensions()
    setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
else:
    setup()

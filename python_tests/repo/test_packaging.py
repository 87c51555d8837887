"""pip install behaves like any other package.

- A build that cannot produce an importable library stops before compiling, with one message
  that says what to run (pip's default isolated build would compile against another torch).
- At import: a missing native library, or one built against another torch than the one loaded,
  is reported as exactly that with the build command; the pure-Python parts import without it.
- The sdist carries every source (headers and the .cu included) and a wheel builds from it; the
  wheel imports and runs from where it is unpacked.
- License, typing marker, changelog, and one install line everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import dppo_ext
from dppo_ext import _native

REPO = Path(__file__).resolve().parents[2]
INSTALL = "pip install --no-build-isolation -e ."
PREREQS = 'pip install "setuptools>=77" ninja'


def _tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    return [f for f in out.split("\0") if f and (REPO / f).is_file()]


def _copy_tree(dst: Path) -> Path:
    """The repository's sources (tracked and untracked-not-ignored files; no build outputs)."""
    for f in _tracked_files():
        (dst / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, dst / f)
    return dst


def _copy_package(dst: Path, with_library: bool) -> Path:
    pkg = Path(dppo_ext.__file__).resolve().parent
    shutil.copytree(pkg, dst / "dppo_ext", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if with_library:
        shutil.copy2(_native.library.__file__, dst / "dppo_ext")
    return dst


# An editable install of dppo_ext (pip install -e .) adds a finder that resolves dppo_ext._C to
# that checkout's library even when dppo_ext itself comes from elsewhere: the child drops it, so
# it sees only the copy under test, as a user's environment would.
_ISOLATE = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path "
    "if not getattr(f, '__module__', '').startswith('__editable__')]\n"
)


def _python(code: str, path: Path, **env: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a child whose dppo_ext is the one under ``path`` (cwd there, not the repo)."""
    code = _ISOLATE + code
    child_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DPPO_CPU_CAPABILITY")}
    child_env.update(PYTHONPATH=str(path), **env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=path, env=child_env, capture_output=True, text=True, timeout=300
    )


def _last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""


# ---- import-time errors -----------------------------------------------------------------------


@pytest.mark.slow
def test_pure_python_parts_import_without_native_library(tmp_path):
    root = _copy_package(tmp_path, with_library=False)
    proc = _python(
        "import torch, dppo_ext, dppo_ext.reference as ref, dppo_ext.tasks, dppo_ext.models, dppo_ext.contract\n"
        "from dppo_ext.trainer.config import TrainConfig\n"
        "TrainConfig(loss='dppo_topk_kl', top_k=4, loss_agg_mode='token-sum').validate()\n"
        "out = ref.dppo_loss_reference(torch.randn(3, 5), torch.tensor([0, 1, 2]), torch.full((3,), -1.6),\n"
        "                              torch.ones(3), mode='binary_tv')\n"
        "assert out['loss'].shape == (3,)\n"
        "print(dppo_ext.__version__, dppo_ext.__file__)",
        root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    version, where = proc.stdout.split()
    assert version == dppo_ext.__version__ and Path(where).is_relative_to(root)


@pytest.mark.slow
def test_package_constants_need_no_native_library(tmp_path):
    """The package face's constants and aggregation helpers are pure Python: they import, and work, without
    dppo_ext._C, and do not load it."""
    root = _copy_package(tmp_path, with_library=False)
    proc = _python(
        "import sys, torch, dppo_ext\n"
        "from dppo_ext import AGG_MODES, DEFAULT_DELTAS, MODE_ALIASES, MODES, aggregate_loss, micro_batch_scale\n"
        "assert MODES[0] == 'binary_tv' and MODE_ALIASES['dppo_tv'] == 'binary_tv'\n"
        "assert set(DEFAULT_DELTAS) == set(MODES)\n"
        "mask = torch.tensor([[1, 1, 0], [1, 0, 0]])\n"
        "assert aggregate_loss(torch.ones(2, 3), mask, 'token-sum').item() == 3.0\n"
        "assert micro_batch_scale('token-mean', mask[:1], 3, 2).item() == 2 / 3\n"
        "assert 'token-mean' in AGG_MODES and 'dppo_ext._C' not in sys.modules, sorted(sys.modules)\n",
        root,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_native_library_imports_first(tmp_path):
    """``import dppo_ext._C`` before anything else works: the package loads torch, whose libraries the native
    library links against, instead of failing with the loader's 'libc10.so: cannot open shared object file'."""
    root = _copy_package(tmp_path, with_library=True)
    code = "import dppo_ext._C as lib\nimport torch\nprint(lib.torch_version, torch.ops.dppo.dppo_loss_forward)"
    proc = _python(code, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == torch.__version__


@pytest.mark.slow
@pytest.mark.parametrize(
    "statement",
    ["from dppo_ext import dppo_loss", "import dppo_ext.ops", "import dppo_ext; dppo_ext.fused_linear_dppo_loss"],
)
def test_missing_native_library_says_how_to_build(tmp_path, statement):
    root = _copy_package(tmp_path, with_library=False)
    proc = _python(statement, root)
    assert proc.returncode != 0
    assert "circular import" not in proc.stderr
    last = _last_line(proc)
    assert last.startswith("ImportError: dppo_ext's native library dppo_ext._C is not built (no _C*.so in "), last
    assert last.endswith(
        f"Build it against the torch you run (torch {torch.__version__}), from the dppo_ext source folder: {INSTALL}"
    ), last


def _other_release(version: str) -> str:
    """A torch version string of the same length whose release (X.Y.Z) differs."""
    release, _, local = version.partition("+")
    last = "8" if release[-1] == "9" else "9"
    return release[:-1] + last + (f"+{local}" if local else "")


def _patch(path: Path, old: bytes, new: bytes) -> int:
    assert len(old) == len(new)
    data = path.read_bytes()
    count = data.count(old)
    path.write_bytes(data.replace(old, new))
    return count


@pytest.mark.slow
def test_library_built_against_another_torch_release(tmp_path):
    """A _C whose recorded torch differs from the loaded one in its release: refused, named, and
    the rebuild command given (the copy really is ABI-compatible, so only the check can refuse)."""
    root = _copy_package(tmp_path, with_library=True)
    so = next((root / "dppo_ext").glob("_C*.so"))
    fake = _other_release(torch.__version__)
    assert _patch(so, torch.__version__.encode() + b"\0", fake.encode() + b"\0") >= 1
    proc = _python("import dppo_ext; dppo_ext.dppo_loss", root)
    assert proc.returncode != 0
    last = _last_line(proc)
    assert re.search(
        rf"ImportError: dppo_ext._C \(.*_C.*\.so\) was built against torch {re.escape(fake)}, but torch "
        rf"{re.escape(torch.__version__)} is loaded;",
        last,
    ), last
    assert last.endswith(f"from the dppo_ext source folder: {INSTALL}"), last


@pytest.mark.slow
def test_library_that_cannot_load_names_the_torch_it_was_built_for(tmp_path):
    """The reported case: a _C built against another torch fails to load at all (there, on a
    missing libc10_cuda.so); the error names both torch versions, the loader's reason and the fix."""
    root = _copy_package(tmp_path, with_library=True)
    so = next((root / "dppo_ext").glob("_C*.so"))
    fake = _other_release(torch.__version__)
    assert (
        _patch(
            so,
            b"dppo_ext-built-with-torch=" + torch.__version__.encode() + b"\0",
            b"dppo_ext-built-with-torch=" + fake.encode() + b"\0",
        )
        == 1
    )
    assert _patch(so, b"libc10.so\0", b"libc1X.so\0") >= 1  # a needed library the loader cannot find
    proc = _python("from dppo_ext import dppo_loss", root)
    assert proc.returncode != 0
    last = _last_line(proc)
    assert re.search(
        rf"was built against torch {re.escape(fake)}, but torch {re.escape(torch.__version__)} is loaded, "
        r"so it cannot be loaded \(libc1X\.so: cannot open shared object file",
        last,
    ), last
    assert last.endswith(f"from the dppo_ext source folder: {INSTALL}"), last


def test_library_reports_its_build():
    lib = _native.library
    assert lib.__version__ == dppo_ext.__version__
    assert lib.torch_version == torch.__version__
    assert dppo_ext.cuda_compiled is lib.cuda_compiled


# ---- build-time errors ------------------------------------------------------------------------


@pytest.mark.slow
def test_isolated_build_stops_before_compiling(tmp_path):
    """pip's default build runs setup.py where the user's torch is invisible (pip hides the
    environment's site-packages): simulated by a torch that cannot be imported. The build stops
    at once with the --no-build-isolation advice, naming the torch that is installed."""
    src = _copy_tree(tmp_path / "src")
    hidden = tmp_path / "hidden"
    (hidden / "torch").mkdir(parents=True)
    (hidden / "torch" / "__init__.py").write_text("raise ImportError('torch is hidden by the build isolation')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(hidden)
    proc = subprocess.run(
        [sys.executable, "setup.py", "bdist_wheel"], cwd=src, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (
        f"torch is not visible to this build, but torch {torch.__version__} is installed" in proc.stderr
        and "build it with --no-build-isolation" in proc.stderr
        and f"{PREREQS} && pip install --no-build-isolation <the path or URL you gave pip>" in proc.stderr
    ), proc.stderr[-2000:]
    assert not (src / "build").exists(), "nothing may be compiled before the message"


def _build_backend(src: Path, kind: str, outdir: Path, env: dict[str, str]) -> Path:
    """``python -m build --<kind> --no-isolation`` when the build package is installed, else the
    same PEP 517 hook of setuptools.build_meta that it calls."""
    outdir.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec("build")
    if spec is not None and spec.origin is not None:  # (a build/ output folder is a namespace package)
        cmd = [
            sys.executable,
            "-m",
            "build",
            f"--{kind}",
            "--no-isolation",
            "--skip-dependency-check",
            "--outdir",
            str(outdir),
            str(src),
        ]
    else:
        cmd = [sys.executable, "-c", f"import setuptools.build_meta as m; m.build_{kind}({str(outdir)!r})"]
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (artifact,) = outdir.glob("*.tar.gz" if kind == "sdist" else "*.whl")
    return artifact


@pytest.mark.slow
def test_sdist_builds_a_wheel_that_imports_and_runs(tmp_path):
    src = _copy_tree(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DPPO_CPU_CAPABILITY")}
    # The sdist needs no torch: build it with torch hidden.
    hidden = tmp_path / "hidden"
    (hidden / "torch").mkdir(parents=True)
    (hidden / "torch" / "__init__.py").write_text("raise ImportError('no torch for an sdist')\n")
    sdist = _build_backend(src, "sdist", tmp_path / "dist", dict(env, PYTHONPATH=str(hidden)))
    assert sdist.name == f"dppo_ext-{dppo_ext.__version__}.tar.gz"

    with tarfile.open(sdist) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
        tar.extractall(tmp_path / "unpacked", filter="data")
    sources = {f for f in _tracked_files() if f.startswith("csrc/")}
    assert sources and sources <= names, f"missing from the sdist: {sorted(sources - names)}"
    for f in (
        "LICENSE",
        "CHANGELOG.md",
        "README.md",
        "pyproject.toml",
        "setup.py",
        "dppo_ext/py.typed",
        "dppo_ext/_version.py",
    ):
        assert f in names, f
    assert not [n for n in names if n.endswith((".so", ".o", ".pyc"))]

    wheel = _build_backend(
        tmp_path / "unpacked" / sdist.name.removesuffix(".tar.gz"),
        "wheel",
        tmp_path / "wheels",
        dict(env, MAX_JOBS=os.environ.get("MAX_JOBS", "2")),
    )
    with zipfile.ZipFile(wheel) as whl:
        files = whl.namelist()
        metadata = whl.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        whl.extractall(tmp_path / "site")
    assert any(re.fullmatch(r"dppo_ext/_C\..*\.so", f) for f in files), files
    assert "dppo_ext/py.typed" in files
    assert not [f for f in files if f.startswith(("experiments/", "dppo_ext/experiments/"))], files  # repo-only
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in files), files
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {dppo_ext.__version__}" in metadata

    proc = _python(
        "import sys, torch, dppo_ext\n"
        f"sys.path.append({str(REPO / 'python_tests')!r})\n"
        "from dppo_testing import sample_inputs, reference_outputs\n"
        "from dppo_ext import dppo_loss_per_row\n"
        "inputs = sample_inputs('cpu', torch.float64, 'binary_tv', 'v129')\n"
        "out = dppo_loss_per_row(**inputs)\n"
        "ref = reference_outputs(inputs)\n"
        "torch.testing.assert_close(out.loss, ref['loss'])\n"
        "torch.testing.assert_close(out.lse, ref['lse'])\n"
        "print(dppo_ext.__file__)",
        tmp_path / "site",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---- metadata and documentation ----------------------------------------------------------------


def test_license_typing_and_changelog():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Typing :: Typed" in project["classifiers"]
    assert "torch" not in " ".join(tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"])
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert (Path(dppo_ext.__file__).parent / "py.typed").is_file()
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[?{re.escape(dppo_ext.__version__)}\]?", changelog, re.M), "no section for this version"


def _install_lines() -> list[tuple[str, str]]:
    """(file, line) for every line of README, docs and examples that pip-installs dppo_ext itself."""
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").glob("*"))]
    found = []
    for f in files:
        if not f.is_file():
            continue
        for line in f.read_text().splitlines():
            if re.search(r"pip install\b[^`]*?(\s-e\s|\s\.(\s|$|`)|\s\"?\.\[|dppo_ext)", line):
                found.append((str(f.relative_to(REPO)), line))
    return found


def test_every_documented_install_line_is_the_same():
    lines = _install_lines()
    assert any(f == "README.md" for f, _ in lines)
    ok = re.compile(r'pip install --no-build-isolation -e (\.|"\.\[[a-z,-]+\]")(?=\s|$|`)')
    bad = [(f, line) for f, line in lines if not ok.search(line)]
    assert not bad, (
        "install lines that differ from '" + INSTALL + "': " + "; ".join(f"{f}: {line.strip()}" for f, line in bad)
    )
    readme = (REPO / "README.md").read_text()
    assert PREREQS in readme, "the README must say what the build needs before the install line"
    assert _native.BUILD_COMMAND == INSTALL

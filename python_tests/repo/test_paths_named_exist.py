"""Every repository path the docs and the code's comments name exists.

A pointer such as ``csrc/op_schemas.h`` or ``python_tests/dppo_testing/`` in README.md, docs/*.md, or a comment or
docstring of a .py/.h/.cpp/.cu/.cuh/.sh file goes stale silently when a file moves; this test finds each one and
checks it. A path with ``*`` is a glob and must match something. CHANGELOG.md is left out: it records old paths on
purpose. Paths under generated output folders (runs/, build/, ...) are skipped: they exist only after a run.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("dppo_ext", "csrc", "python_tests", "benchmarks", "docs", "examples", "scripts", "experiments")
# A path starts at one of the top folders (not inside another path or URL: no word character, dot, slash or dash
# before it) and runs over path characters; a trailing dot or dash is sentence punctuation.
PATH_RE = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_FOLDERS) + r")/[\w.*/-]*[\w*/])")
# Folders whose contents a run or a build writes; a path into one names an output, not a repository file.
GENERATED = {"runs", "build", "dist", "__pycache__", ".pytest_cache", "outputs"}
SKIP_DIRS = {".git", "build", "dist", "runs", "__pycache__", "node_modules"}
CODE_SUFFIXES = {".py", ".h", ".cpp", ".cu", ".cuh", ".sh"}
# A path after an output option of a command line is what the command will write.
OUTPUT_OPTION_RE = re.compile(r"--out(?:-dir|put)?[ =]$")
# Paths of other repositories that share our folder names, with where the docs name them.
OTHER_REPOSITORIES = {
    "examples/dppo_trainer": "verl-project/verl's DPPO example folder (docs/names.md's sources)",
}
C_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _files() -> list[Path]:
    """README.md, docs/*.md and every code file of the repository (no virtual environments or build output)."""
    found = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for path in sorted(REPO.rglob("*")):
        rel = path.relative_to(REPO).parts
        if any(part in SKIP_DIRS or part.startswith(".venv") for part in rel[:-1]):
            continue
        if path.suffix in CODE_SUFFIXES and path.is_file():
            found.append(path)
    return found


def _python_prose(source: str) -> str:
    """The comments and docstrings of a Python source: the prose that names paths (string literals in code are
    code, and their paths are checked by running it)."""
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def prose(path: Path) -> str:
    """The part of ``path`` a reader takes as prose: all of a Markdown file, the comments (and Python docstrings)
    of a code file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        return text
    if path.suffix == ".py":
        return _python_prose(text)
    if path.suffix == ".sh":
        return "\n".join(line[line.index("#") :] for line in text.splitlines() if "#" in line)
    return "\n".join(C_COMMENT_RE.findall(text))


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names (``csrc/ops.h``, ``python_tests/repo/``, ``benchmarks/*.py``), less
    the outputs of the command lines it shows (``--out-dir benchmarks/results/cuda``)."""
    return {
        m.group(1).rstrip("/")
        for m in PATH_RE.finditer(text)
        if not OUTPUT_OPTION_RE.search(text[max(0, m.start() - 12) : m.start()])
    }


def exists(name: str) -> bool:
    if "*" in name:
        return any(REPO.glob(name))
    return (REPO / name).exists()


def _skipped(name: str) -> bool:
    return name in OTHER_REPOSITORIES or any(part in GENERATED for part in name.split("/"))


def test_the_scanner_finds_paths_and_only_paths():
    text = (
        "see `csrc/op_schemas.h`, python_tests/repo/. and benchmarks/*.py; "
        "not https://github.com/verl-project/verl/docs/x.md nor verl/scripts/y.py "
        "nor the output of `bench.py --out-dir benchmarks/results/new`"
    )
    assert named_paths(text) == {"csrc/op_schemas.h", "python_tests/repo", "benchmarks/*.py"}
    assert _python_prose('"""docs/a.md"""\nx = "docs/b.md"  # docs/c.md\n') == "# docs/c.md\ndocs/a.md"
    assert not exists("python_tests/no_such_file.py") and exists("python_tests/repo/*.py")


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_named_exists(path):
    missing = sorted(n for n in named_paths(prose(path)) if not _skipped(n) and not exists(n))
    assert not missing, f"{path.relative_to(REPO)} names paths that do not exist: {missing}"

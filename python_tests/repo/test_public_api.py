"""The public API is what README.md and docs/ name, at the path they give it; every one of those names imports.

``DOCUMENTED`` is that list, read from the docs: a name they give with its module (``dppo_ext.rollout.
vllm_rollout_tensors``, ``from dppo_ext.vocab_parallel import even_vocab_offsets``) at that module, a name they
use without one (``DPPOLoss``, ``gathered_bytes_per_row``) where the surrounding text puts it. Names have one home
and move freely before the first release; a move that drops a documented name fails here, and a dotted name or
import the docs add without entering it here fails too, so the list and the docs stay the same.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

DOCUMENTED = {
    "dppo_ext": [
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "DPPOLoss",
        "DPPOOutputs",
        "FusedLinearDPPOLoss",
        "MASK_DIRECTIONS",
        "MODES",
        "MODE_ALIASES",
        "SequenceMask",
        "__version__",
        "aggregate_loss",
        "cpu_cached_bytes",
        "cpu_capability",
        "cuda_compiled",
        "dppo_loss",
        "dppo_loss_per_row",
        "dppo_metrics",
        "empty_cpu_cache",
        "fused_linear_dppo_loss",
        "fused_linear_dppo_loss_per_row",
        "icepop_deltas",
        "micro_batch_scale",
    ],
    "dppo_ext.vocab_parallel": [
        "even_vocab_offsets",
        "gathered_bytes_per_row",
        "vocab_parallel_offsets",
    ],
    "dppo_ext.reference": ["dppo_loss_full_reference"],
    "dppo_ext.rollout": ["kept_ids_by_rule", "ranked_topk_rows", "vllm_rollout_tensors"],
    "dppo_ext.models.lm_head": ["widened_head"],
    "dppo_ext.models.tiny": ["build_tiny_model"],
    "dppo_ext.integrations.trl": ["DPPOGRPOConfig", "DPPOGRPOTrainer"],
    "dppo_ext.integrations.verl.config": ["validate"],
    "dppo_ext.integrations.verl.loss": ["ppo_loss"],
    "dppo_ext.integrations.verl.policy_loss_config": ["DPPOPolicyLossConfig"],
    "dppo_ext.train": ["main", "run"],
    "dppo_ext._C": ["cuda_compiled"],
}
# Modules the docs name as a whole (``python -m dppo_ext.train``, "``dppo_ext.integrations.trl`` plugs ...").
DOCUMENTED_MODULES = {
    "dppo_ext.reference",
    "dppo_ext.rollout",
    "dppo_ext.rollout.weight_sync",
    "dppo_ext.vocab_parallel",
} | set(DOCUMENTED)


def _import(module: str):
    """``module``, or a skip when a third-party package it needs is not installed (verl, tensordict)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name is None or err.name.split(".")[0] == "dppo_ext":
            raise
        pytest.skip(f"{module} needs {err.name}, which is not installed")


@pytest.mark.parametrize("module, name", [(m, n) for m, names in DOCUMENTED.items() for n in names])
def test_every_documented_name_imports_from_its_documented_path(module, name):
    assert hasattr(_import(module), name), f"the docs name {module}.{name}, which does not exist"


def _doc_references() -> set[tuple[str, str | None]]:
    """``(module, name)`` of every ``from dppo_ext... import ...`` line and dotted ``dppo_ext.`` name in the docs
    (``name`` None: the dotted name is a module)."""
    found = set()
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for module, names in re.findall(r"^\s*from (dppo_ext[\w.]*) import ([\w, ]+)$", text, flags=re.M):
            found.update((module, n.strip()) for n in names.split(","))
        for dotted in re.findall(r"\bdppo_ext(?:\.\w+)+", text):
            parts = dotted.split(".")
            module = next(
                (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in DOCUMENTED_MODULES),
                None,
            )
            assert module is not None, f"{doc.name} names {dotted}, which is not in DOCUMENTED"
            rest = parts[len(module.split(".")) :]
            found.add((module, rest[0] if rest else None))
    return found


def test_the_list_holds_every_dotted_name_and_import_of_the_docs():
    missing = sorted(
        f"{module}.{name}" for module, name in _doc_references() if name is not None and name not in DOCUMENTED[module]
    )
    assert not missing, f"the docs name {missing}: add them to DOCUMENTED (or fix the docs)"


@pytest.mark.parametrize("package", ["dppo_ext", "dppo_ext.integrations.trl"])
def test_a_lazy_table_names_what_its_type_checking_block_imports(package):
    """A package face loads some names on first use from a table (``_LAZY``); type checkers see them in its
    ``if TYPE_CHECKING:`` block. The two lists must hold the same names from the same submodules."""
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    imported = {alias.asname or alias.name: node.module for node in block.body for alias in node.names}
    assert imported == module._LAZY
    assert set(module._LAZY) <= set(module.__all__)

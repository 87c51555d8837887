"""The package's layout stays as docs/contract.md and the house style describe it, read from the source (AST):

- no import circle between dppo_ext's modules (module-level imports);
- no private name (``_x``) imported from, or read off, another dppo_ext module; a private MODULE (``_rows``) is
  fine, its names are the package's own;
- the library layer imports strictly downward (contract <- _autograd <- _rows <- aggregation <- _lm_head_tiles, and
  contract <- _vocab_split <- _agreement / _dtensor; none of them, nor ops, imports a front end: loss, fused_linear,
  vocab_parallel), and none of its modules imports a dppo_ext module inside a function (an import there would
  hide a circle);
- every public name that moved still imports from its old path, the deprecated ones with a DeprecationWarning.
"""

from __future__ import annotations

import ast
import functools
import importlib
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dppo_ext"
LIBRARY = (
    "contract",
    "_autograd",
    "_rows",
    "aggregation",
    "_lm_head_tiles",
    "_vocab_split",
    "_agreement",
    "_dtensor",
    "ops",
    "_fused_autograd",
    "loss",
    "fused_linear",
    "vocab_parallel",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` in ``module`` reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(MODULES[module].read_text())


def _imports(module: str, body_only: bool) -> list[tuple[ast.AST, str, list[str]]]:
    """``(node, imported module, names)`` of every import of a dppo_ext module in ``module``: at module level
    (``if`` blocks included, ``TYPE_CHECKING`` excluded) or, with ``body_only=False``, anywhere."""
    tree = _tree(module)
    if body_only:
        nodes = []
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.If):
                if ast.unparse(node.test) != "TYPE_CHECKING":
                    stack.extend(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                stack.extend(node.body + node.orelse + node.finalbody)
            else:
                nodes.append(node)
    else:
        nodes = list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            if source.split(".")[0] != "dppo_ext":
                continue
            names = [a.name for a in node.names]
            submodules = [f"{source}.{n}" for n in names if f"{source}.{n}" in MODULES]
            found.append((node, source, [n for n in names if f"{source}.{n}" not in MODULES]))
            found.extend((node, sub, []) for sub in submodules)
        elif isinstance(node, ast.Import):
            found.extend((node, a.name, []) for a in node.names if a.name.split(".")[0] == "dppo_ext")
    return [f for f in found if f[1] in MODULES]


def _graph() -> dict[str, set[str]]:
    """Module -> the dppo_ext modules it imports at module level (importing ``a.b`` also runs ``a``)."""
    graph = {}
    for module in MODULES:
        deps = set()
        for _node, source, _names in _imports(module, body_only=True):
            parts = source.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        deps.discard(module)
        graph[module] = {d for d in deps if d in MODULES and not module.startswith(d + ".")}
    return graph


def test_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import circle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # the library layer imports strictly downward, in this order
    order = ["dppo_ext." + m for m in ("contract", "_autograd", "_rows", "aggregation", "_lm_head_tiles")]
    for i, module in enumerate(order):
        assert not graph[module] & set(order[i + 1 :]), f"{module} imports a module above it: {graph[module]}"
    split = ["dppo_ext." + m for m in ("_vocab_split", "_agreement", "_dtensor")]
    assert not graph[split[0]] & set(split[1:]), f"{split[0]} imports a module above it: {graph[split[0]]}"
    agreement, dtensor = split[1:]
    assert dtensor not in graph[agreement] and agreement not in graph[dtensor], "two separate jobs import each other"
    front_ends = {"dppo_ext.loss", "dppo_ext.fused_linear", "dppo_ext.vocab_parallel"}
    for module in order + split + ["dppo_ext.ops", "dppo_ext._fused_autograd"]:
        assert not graph[module] & front_ends, f"{module} imports a front end: {graph[module] & front_ends}"


def test_no_private_name_crosses_a_module_border():
    crossings = []
    for module, path in MODULES.items():
        imported_modules = {}
        for node, source, names in _imports(module, body_only=False):
            crossings.extend(
                f"{path.name}:{node.lineno}: {n} from {source}"
                for n in names
                if n.startswith("_") and not n.startswith("__")
            )
            if isinstance(node, ast.ImportFrom):
                imported_modules.update({a.asname or a.name: source for a in node.names if source.endswith(a.name)})
            else:
                imported_modules.update({a.asname or a.name: a.name for a in node.names})
        for node in ast.walk(_tree(module)):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)):
                continue
            source = imported_modules.get(node.value.id)
            private = node.attr.startswith("_") and not node.attr.startswith("__")
            if source is not None and private and f"{source}.{node.attr}" not in MODULES:
                crossings.append(f"{path.name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not crossings, "private names used across modules:\n" + "\n".join(crossings)


@pytest.mark.parametrize("module", LIBRARY)
def test_library_imports_no_package_module_inside_a_function(module):
    name = f"dppo_ext.{module}"
    top = {id(node) for node, _source, _names in _imports(name, body_only=True)}
    inner = [
        f"line {node.lineno}: {source}"
        for node, source, _names in _imports(name, body_only=False)
        if id(node) not in top
    ]
    assert not inner, f"{name} imports dppo_ext modules inside functions: {inner}"


# Names that moved in the library's restructuring, at the paths they used to have.
OLD_PATHS = {
    "dppo_ext": [
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "DPPOLoss",
        "DPPOOutputs",
        "FusedLinearDPPOLoss",
        "MODES",
        "MODE_ALIASES",
        "aggregate_loss",
        "cuda_compiled",
        "dppo_loss",
        "dppo_loss_backward",
        "dppo_loss_per_row",
        "dppo_metrics",
        "fused_linear_dppo_loss",
        "fused_linear_dppo_loss_per_row",
    ],
    "dppo_ext.contract": [
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "IGNORE_INDEX",
        "MODES",
        "MODE_ALIASES",
        "NORM_AGG_MODES",
        "TOPK_MODES",
        "canonical_mode",
        "check_aggregation",
        "check_settings",
        "check_token_ids",
        "resolve_deltas",
    ],
    "dppo_ext.loss": [
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "DPPOLoss",
        "IGNORE_INDEX",
        "NORM_AGG_MODES",
        "aggregate_loss",
        "broadcast_advantages",
        "check_aggregation",
        "dppo_loss",
        "dppo_metrics",
    ],
    "dppo_ext.ops": [
        "DPPOOutputs",
        "MODES",
        "MODE_ALIASES",
        "canonical_mode",
        "check_inplace_backward",
        "check_no_functorch",
        "dppo_loss_backward",
    ],
    "dppo_ext.fused_linear": [
        "FusedLinearDPPOLoss",
        "FusedLinearPlan",
        "fused_linear_dppo_loss",
        "fused_linear_dppo_loss_per_row",
        "plan_chunks",
    ],
    "dppo_ext.vocab_parallel": [
        "dtensor_vocab_shard",
        "even_vocab_offsets",
        "gathered_bytes_per_row",
        "is_dtensor",
        "replicated_local",
        "vocab_parallel_offsets",
    ],
    "dppo_ext.reference": [
        "AGG_MODES",
        "DEFAULT_DELTAS",
        "LOG_RATIO_CLAMP",
        "MASS_FLOOR",
        "MODES",
        "OUTPUT_KEYS",
        "TOPK_MODES",
        "accumulation_dtype",
        "aggregate_loss_reference",
        "dppo_loss_reference",
    ],
    "dppo_ext.trainer.losses": ["LOSSES", "LOSS_ALIASES", "LossSpec", "canonical_loss"],
    # the trainer's CLI module, split into dppo_ext.trainer's modules (one job each)
    "dppo_ext.train": [
        "CONFIG_FILE",
        "INPUTS_FILE",
        "METRICS_FILE",
        "PLOT_FILE",
        "SUMMARY_FILE",
        "WARM_START_MARKER",
        "build_embedded_model",
        "build_task",
        "check_resume_config",
        "check_top_k",
        "data_fingerprints",
        "engine_kind",
        "install_folder",
        "legacy_run_outputs",
        "main",
        "make_rollout_engine",
        "prepare_embedded_model",
        "resolve_device",
        "resolve_threads",
        "restart_with_passive_omp_waits",
        "run",
        "seed_everything",
        "set_library_verbosity",
        "summarize",
        "supervised_warm_start",
        "warm_start_matches",
        "warm_start_settings",
    ],
    "dppo_ext.trainer.loop": ["EvalResult", "PromptSampler", "Trainer"],
    # the run folder's pieces, split into one module per job (errors, atomic_files, run_lock, manifest, ...)
    "dppo_ext.trainer.run_dir": [
        "EMBEDDED_MODEL_DIR",
        "KINDS",
        "LOCK_FILE",
        "MANIFEST_FILE",
        "MANIFEST_FORMAT",
        "SETUP",
        "STARTED",
        "TEMPORARY_TAGS",
        "Adopt",
        "RunError",
        "RunFolder",
        "RunLock",
        "atomic_write_bytes",
        "atomic_write_text",
        "check_out_apart",
        "forget_output",
        "fsync_dir",
        "open_run_dir",
        "read_manifest",
        "record_output",
        "temporary_sibling",
    ],
}
DEPRECATED = {("dppo_ext.reference", "LOSS_AGG_MODES")}


@pytest.mark.parametrize("module", sorted(OLD_PATHS))
def test_old_import_paths_still_work(module):
    mod = importlib.import_module(module)
    missing = [name for name in OLD_PATHS[module] if not hasattr(mod, name)]
    assert not missing, f"{module} lost {missing}"
    assert (
        importlib.import_module("dppo_ext.fused_linear").plan_chunks
        is importlib.import_module("dppo_ext._lm_head_tiles").plan_chunks
    )
    assert importlib.import_module("dppo_ext.ops").MODES is importlib.import_module("dppo_ext.contract").MODES


@pytest.mark.parametrize("module, name", sorted(DEPRECATED))
def test_deprecated_names_warn_and_work(module, name):
    from dppo_ext.contract import AGG_MODES

    with pytest.warns(DeprecationWarning, match=name):
        value = getattr(importlib.import_module(module), name)
    assert value == AGG_MODES


def test_deprecated_backward_wrapper_warns_and_matches_the_op():
    """ops.dppo_loss_backward (arguments in its own order) still computes the backward op's gradient."""
    import torch

    from dppo_ext import dppo_loss_per_row
    from dppo_ext.ops import dppo_loss_backward

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=g, dtype=torch.float64)
    tokens = torch.tensor([0, 3, -100, 10, 7])
    rollout = torch.log_softmax(logits, -1).gather(1, tokens.clamp(min=0)[:, None])[:, 0] - 0.1
    out = dppo_loss_per_row(logits, tokens, rollout, torch.randn(5, generator=g, dtype=torch.float64))
    grad_target = torch.randn(5, generator=g, dtype=torch.float64)
    want = torch.ops.dppo.dppo_loss_backward(grad_target, None, logits, tokens, out.lse, None, 1.0)
    with pytest.warns(DeprecationWarning, match="dppo_loss_backward is deprecated"):
        got = dppo_loss_backward(grad_target, logits, tokens, out.lse)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        inplace = logits.clone()
        assert dppo_loss_backward(grad_target, inplace, tokens, out.lse, out=inplace) is inplace
    torch.testing.assert_close(inplace, want, rtol=0, atol=0)

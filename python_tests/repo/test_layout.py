"""The package's layout stays as docs/contract.md and the house style describe it, read from the source (AST):

- no import circle between dppo_ext's modules (module-level imports);
- no private name (``_x``) imported from, or read off, another dppo_ext module; a private MODULE (``_rows``) is
  fine, its names are the package's own;
- the library layer imports strictly downward (contract <- _autograd <- _rows <- aggregation <- _lm_head_tiles, and
  contract <- _vocab_split <- _agreement / _dtensor; none of them, nor ops, imports a front end: loss, fused_linear,
  vocab_parallel), and none of its modules imports a dppo_ext module inside a function (an import there would
  hide a circle);
- every library file is at most ``MAX_LINES`` long (one job per file), but for the ``LONG_FILES`` named with why;
- experiments/, benchmarks/ and examples/ are clients of dppo_ext's public face: none of them imports a private
  name or module of it (``_x`` anywhere in the path) or reads a private name off what it imported, except the
  few ``CLIENT_EXCEPTIONS``, each named with its reason.
"""

from __future__ import annotations

import ast
import functools
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


REPO = PACKAGE.parent
CLIENTS = ("experiments", "benchmarks", "examples")
# Private dppo_ext names a client still reads: {file: {dotted name: why}}. A name that is gone from its file fails
# the test too, so that the list only shrinks.
CLIENT_EXCEPTIONS = {
    "benchmarks/bench_fused_linear.py": {
        "dppo_ext._lm_head_tiles.plan_chunks": "records each fused case's chunk plan; the plan has no public home "
        "yet (its front end, fused_linear.py, would be it)",
    },
    "benchmarks/fused_linear_accuracy.py": {
        "dppo_ext._lm_head_tiles.plan_chunks": "prints the chunk rows of the automatic plan; as above",
    },
    "benchmarks/bench_mask_family.py": {
        f"dppo_ext._rows.{name}": "times the penalty and sequence mask composed on the op's rows on their own, an "
        "internal step (compose_rows takes the resolved settings and the per-row inputs)"
        for name in ("LossSettings", "RowInputs")
    },
    "benchmarks/bench_vocab_parallel_header.py": {
        f"dppo_ext.{name}": "times the call header of every vocab-parallel forward on its own, an internal step"
        for name in (
            "_agreement.Rendezvous",
            "_agreement.call_header",
            "_agreement.check_agreement",
            "_rows.LossSettings",
            "_rows.RowInputs",
            "_vocab_split.comm_device",
        )
    },
}


def _private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def _client_crossings(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of every private dppo_ext name ``path`` imports or reads off an imported name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    bound: dict[str, str] = {}  # local name -> the dppo_ext name it was imported as
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "dppo_ext":
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = dotted
                if _private(dotted):
                    found.append((node.lineno, dotted))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "dppo_ext":
                    continue
                bound[alias.asname or "dppo_ext"] = alias.name if alias.asname else "dppo_ext"
                if _private(alias.name):
                    found.append((node.lineno, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root, chain = node.value, []
            while isinstance(root, ast.Attribute):
                chain.insert(0, root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append((node.lineno, ".".join([bound[root.id], *chain, node.attr])))
    return sorted(set(found))


def _client_files() -> list[Path]:
    return sorted(p for folder in CLIENTS for p in (REPO / folder).rglob("*.py"))


def test_clients_use_only_the_public_face():
    crossings, used = [], set()
    for path in _client_files():
        name = path.relative_to(REPO).as_posix()
        allowed = CLIENT_EXCEPTIONS.get(name, {})
        for line, dotted in _client_crossings(path):
            if dotted in allowed:
                used.add((name, dotted))
            else:
                crossings.append(f"{name}:{line}: {dotted}")
    assert not crossings, "private dppo_ext names used outside the package:\n" + "\n".join(crossings)
    listed = {(name, dotted) for name, names in CLIENT_EXCEPTIONS.items() for dotted in names}
    assert listed <= used, f"CLIENT_EXCEPTIONS lists names no longer used: {sorted(listed - used)}"


def test_the_client_rule_sees_every_way_to_reach_a_private_name(tmp_path):
    """A negative control: each spelling of a private import or read is found (and a public one is not)."""
    sample = tmp_path / "client.py"
    sample.write_text(
        "import dppo_ext\n"
        "import dppo_ext._native\n"
        "import dppo_ext.rollout.weight_sync as ws\n"
        "from dppo_ext import _C, dppo_loss\n"
        "from dppo_ext.integrations.verl._import_hooks import when_imported\n"
        "from dppo_ext.rollout.vllm_engine import _model_logprobs\n"
        "def f():\n"
        "    from dppo_ext._lm_head_tiles import plan_chunks\n"
        "    return ws._stale_parameters, dppo_ext._native.library, ws.SyncGuard._check, dppo_ext.__version__\n"
    )
    assert set(_client_crossings(sample)) == {
        (2, "dppo_ext._native"),
        (4, "dppo_ext._C"),
        (5, "dppo_ext.integrations.verl._import_hooks.when_imported"),
        (6, "dppo_ext.rollout.vllm_engine._model_logprobs"),
        (8, "dppo_ext._lm_head_tiles.plan_chunks"),
        (9, "dppo_ext.rollout.weight_sync._stale_parameters"),
        (9, "dppo_ext._native"),
        (9, "dppo_ext.rollout.weight_sync.SyncGuard._check"),
    }


MAX_LINES = 450
# Library files still longer, each with why; an entry that is no longer needed fails the test, so the list shrinks.
LONG_FILES: dict[str, str] = {}


def test_every_library_file_is_at_most_max_lines():
    lengths = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in MODULES.values()}
    too_long = {name: n for name, n in lengths.items() if n > MAX_LINES and name not in LONG_FILES}
    assert not too_long, f"library files over {MAX_LINES} lines (split them by job): {too_long}"
    unneeded = [name for name in LONG_FILES if lengths.get(name, 0) <= MAX_LINES]
    assert not unneeded, f"LONG_FILES lists files that are no longer over {MAX_LINES} lines: {unneeded}"

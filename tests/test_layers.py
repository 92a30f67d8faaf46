"""The package's import graph: no cycles, no private names borrowed across modules (docs/design.md §4, layers).

Every module under ``flashrange/`` is read with :mod:`ast` (nothing is
imported, so modules being written, optional dependencies and GPU-only code
are all seen), including imports inside functions. Edges go from a module to
each ``flashrange`` module it names: ``import flashrange.x``,
``from . import x`` (a submodule ``x``, else the package's ``__init__``),
``from .x import y`` (module ``x``; ``x.y`` when that is a module itself).
Importing a submodule also runs its parent packages' ``__init__``; Python
allows that cycle (the parent is already being imported), so it is not an
edge here.

Private names (one leading underscore) are a module's own business: another
module may not import them (``from .x import _y``) nor reach them through a
module it imported (``x._y``). ``from __future__`` and dunders
(``__version__``) are allowed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "flashrange"
PKG_DIR = ROOT / PACKAGE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG_DIR.rglob("*.py")) if "__pycache__" not in p.parts}


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """Absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not _is_package(module):
        base = base[:-1]  # a plain module's package
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Imports(ast.NodeVisitor):
    """Edges, private imports and private attribute uses of one module."""

    def __init__(self, module: str):
        self.module = module
        self.edges: dict[str, int] = {}  # target module -> first line
        self.private: list[str] = []
        self.aliases: dict[str, str] = {}  # local name -> flashrange module it is bound to

    def _edge(self, target: str, line: int):
        if target in MODULES and target != self.module:
            self.edges.setdefault(target, line)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                self._edge(alias.name, node.lineno)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    self.aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        if node.module == "__future__":
            return
        source = _resolve(self.module, node.level, node.module)
        if not (source == PACKAGE or source.startswith(PACKAGE + ".")):
            return
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in MODULES:  # ``from . import ops``: the submodule itself
                self._edge(sub, node.lineno)
                self.aliases[alias.asname or alias.name] = sub
                continue
            self._edge(source, node.lineno)
            if alias.name != "*" and _private(alias.name):
                self.private.append(f"{self.module}:{node.lineno} imports {alias.name} from {source}")
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and _private(node.attr):
            bound = self.aliases.get(node.value.id)
            if bound is not None and bound != self.module:
                self.private.append(f"{self.module}:{node.lineno} uses {node.value.id}.{node.attr} ({bound})")
        self.generic_visit(node)


def _scan():
    graph, private = {}, []
    for name, path in MODULES.items():
        visitor = _Imports(name)
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        graph[name] = visitor.edges
        private.extend(visitor.private)
    return graph, private


def _cycles(graph):
    """Strongly connected components with more than one module (or a self-loop), as sorted lists."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _describe(cycle, graph):
    lines = []
    for a in cycle:
        for b in cycle:
            if b in graph[a]:
                lines.append(f"  {a} -> {b} (line {graph[a][b]})")
    return "\n".join(lines)


def test_every_module_is_walked():
    graph, _ = _scan()
    for expected in ("flashrange", "flashrange.ops", "flashrange.reference", "flashrange.kernels.forward",
                     "flashrange.kernels.backward", "flashrange.kernels.plan", "flashrange.compat"):
        assert expected in graph
    # Function-local imports count: ops reaches the kernels only from inside its CUDA kernels.
    assert "flashrange.kernels.forward" in graph["flashrange.ops"]
    assert "flashrange.kernels.backward" in graph["flashrange.ops"]


def test_import_graph_has_no_cycle():
    graph, _ = _scan()
    cycles = _cycles(graph)
    assert not cycles, "import cycles in flashrange:\n" + "\n\n".join(_describe(c, graph) for c in cycles)


def test_no_private_name_crosses_modules():
    _, private = _scan()
    assert not private, "private names used across flashrange modules:\n" + "\n".join(private)


# ------------------------------------------------------------------- the checker itself


def _scan_source(files: dict[str, str]):
    """Run the checks on made-up modules (``{"flashrange.x": source}``)."""
    saved = dict(MODULES)
    MODULES.clear()
    MODULES.update({name: Path(f"/virtual/{name.replace('.', '/')}.py") for name in files})
    MODULES[PACKAGE] = Path("/virtual/flashrange/__init__.py")
    try:
        graph, private = {}, []
        for name, src in files.items():
            v = _Imports(name)
            v.visit(ast.parse(src))
            graph[name] = v.edges
            private.extend(v.private)
        return graph, private
    finally:
        MODULES.clear()
        MODULES.update(saved)


@pytest.mark.parametrize(
    "files, n_cycles, n_private",
    [
        pytest.param({"flashrange.a": "from .b import x", "flashrange.b": "def f():\n    from .a import y"}, 1, 0,
                     id="cycle-through-function-local-import"),
        pytest.param({"flashrange.a": "from . import b", "flashrange.b": "import flashrange.a as a"}, 1, 0,
                     id="cycle-through-module-imports"),
        pytest.param({"flashrange.a": "from .b import x", "flashrange.b": "from __future__ import annotations"}, 0, 0,
                     id="no-cycle"),
        pytest.param({"flashrange.a": "from .b import _x", "flashrange.b": "_x = 1"}, 0, 1, id="private-import"),
        pytest.param({"flashrange.a": "from . import b\nb._x()", "flashrange.b": "def _x(): pass"}, 0, 1,
                     id="private-attribute"),
        pytest.param({"flashrange.a": "from .b import __all__, x", "flashrange.b": "x = 1"}, 0, 0, id="dunder-ok"),
    ],
)
def test_checker_catches_what_it_should(files, n_cycles, n_private):
    graph, private = _scan_source(files)
    assert len(_cycles(graph)) == n_cycles
    assert len(private) == n_private

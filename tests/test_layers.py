"""The folders import downward only, and no module imports itself through others.

Layers, top down: the façade (``fxlora/__init__.py``, ``compiled.py``), ``runtime``,
``passes``, ``compiler`` (the graph toolkit the passes are written with), ``ops`` and
``adapters`` side by side, ``kernels``, ``errors``. Every ``import`` of every module is read
(function-level ones and those under ``TYPE_CHECKING`` too), so a lazy import that reaches up
a layer, or closes a cycle, fails here as surely as one at the top."""

import ast
from pathlib import Path

import fxlora

ROOT = Path(fxlora.__file__).parent

# Higher numbers may import lower ones, never the reverse. ops and adapters sit side by side
# and do not import each other.
LAYERS = {
    "errors": 0,
    "kernels": 1,  # the Triton kernels, their launchers and launch table
    "ops": 2,  # the fxlora:: ops over them
    "adapters": 2,
    "compiler": 3,  # the graph toolkit and the machinery around the passes
    "passes": 4,  # the passes and the one list that runs them
    "runtime": 5,
    "compiled": 6,
    "__init__": 7,  # the public API
    "testing": 8,  # users of the public API
    "demo": 9,  # the demo uses the testing helpers
    "__main__": 9,
}


def _name(path: Path) -> str:
    """``fxlora/compiler/graph_edit.py`` -> ``fxlora.compiler.graph_edit``; a package's
    ``__init__.py`` -> the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(("fxlora", *(parts[:-1] if parts[-1] == "__init__" else parts)))


MODULES = {_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer_of(module: str) -> str:
    """``fxlora.passes.hoist`` -> ``passes``; ``fxlora`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(module: str) -> set[str]:
    """The fxlora modules ``module`` imports: ``from package import name`` counts as an
    import of the submodule ``package.name`` where there is one, else of the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                above = package.rsplit(".", node.level - 1)[0]
                base = f"{above}.{node.module}" if node.module else above
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {m for m in found if m in MODULES and m != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one node (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_layer_is_known():
    layers = {_layer_of(m) for m in MODULES}
    assert layers <= set(LAYERS), layers - set(LAYERS)


def test_imports_go_down_only():
    wrong = []
    for module in MODULES:
        here = _layer_of(module)
        for imported in _imports(module):
            there = _layer_of(imported)
            if there != here and LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{module} ({here}) imports {imported} ({there})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    found = cycles({m: _imports(m) for m in MODULES})
    assert not found, "modules that import each other round a cycle:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_passes_import_no_other_pass():
    """A pass reads the graph toolkit (``fxlora.compiler``) and the ops; what passes share
    lives there."""
    passes = [m for m in MODULES if m.startswith("fxlora.passes.")]
    wrong = [f"{m} imports {i}" for m in passes for i in _imports(m) if i.startswith("fxlora.passes")]
    assert not wrong, "\n".join(wrong)

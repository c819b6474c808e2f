"""The folders import downward only: façade -> runtime -> compiler -> ops / adapters.

Every ``import`` of every module is read (function-level ones too), so a lazy import that
reaches up a layer fails here as surely as one at the top."""

import ast
from pathlib import Path

import fxlora

ROOT = Path(fxlora.__file__).parent

# Higher numbers may import lower ones, never the reverse. ops and adapters sit side by side
# and do not import each other.
LAYERS = {
    "errors": 0,
    "kernels": 1,  # the Triton kernels and their launchers
    "ops": 2,  # the fxlora:: ops over them
    "adapters": 2,
    "compiler": 3,
    "runtime": 4,
    "compiled": 5,
    "__init__": 6,  # the public API
    "testing": 7,  # users of the public API
    "demo": 8,  # the demo uses the testing helpers
    "__main__": 8,
}


def _layer_of(module: str) -> str:
    """``fxlora.compiler.fuse`` -> ``compiler``; ``fxlora`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    package = ".".join(("fxlora", *path.relative_to(ROOT).with_suffix("").parts))
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level)[0]
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module:
                found.add(node.module)
    return {m for m in found if m == "fxlora" or m.startswith("fxlora.")}


def test_every_layer_is_known():
    layers = {_layer_of(".".join(("fxlora", *p.relative_to(ROOT).with_suffix("").parts))) for p in ROOT.rglob("*.py")}
    assert layers <= set(LAYERS), layers - set(LAYERS)


def test_imports_go_down_only():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _layer_of(".".join(("fxlora", *path.relative_to(ROOT).with_suffix("").parts)))
        for module in _imports(path):
            there = _layer_of(module)
            if there == here:
                continue
            if LAYERS[there] >= LAYERS[here]:
                wrong.append(f"{path.relative_to(ROOT)} ({here}) imports {module} ({there})")
    assert not wrong, "\n".join(wrong)

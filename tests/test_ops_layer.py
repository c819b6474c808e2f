"""The ops are the bottom layer: nothing under fxlora/ops imports the compiler, the runtime or
the façade (the import direction of docs/architecture.md)."""

import ast
from pathlib import Path

import fxlora.ops

HIGHER = ("fxlora.passes", "fxlora.compiler", "fxlora.runtime", "fxlora.compiled")


def _imported(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
            if node.module == "fxlora":  # from fxlora import compiled
                yield from (f"fxlora.{alias.name}" for alias in node.names)


def test_ops_import_nothing_above_them():
    root = Path(fxlora.ops.__file__).parent
    wrong = []
    for path in sorted(root.rglob("*.py")):
        for name in _imported(ast.parse(path.read_text(), str(path))):
            if name == "fxlora" or name.startswith(HIGHER):
                wrong.append(f"{path.relative_to(root.parent)}: {name}")
    assert not wrong, "fxlora/ops imports a higher layer:\n" + "\n".join(wrong)

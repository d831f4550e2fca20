"""Layering: `fastrpe.ops` and `fastrpe.positions` never import each other (issue 15), read
from the source by `ast` (an import inside a function counts too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fastrpe"


def _imported_modules(path: Path) -> list[str]:
    """Absolute dotted names of every module `path` imports, relative imports resolved."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    package = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append(mod)
            names += [f"{mod}.{a.name}" for a in node.names]  # `from fastrpe import positions`
    return names


def _modules(pkg: str) -> list[Path]:
    return sorted((SRC / pkg).rglob("*.py"))


@pytest.mark.parametrize("pkg,forbidden", [("ops", "fastrpe.positions"), ("positions", "fastrpe.ops")])
def test_no_import_between_ops_and_positions(pkg, forbidden):
    bad = [f"{p.relative_to(SRC)} imports {m}" for p in _modules(pkg) for m in _imported_modules(p)
           if m == forbidden or m.startswith(forbidden + ".")]
    assert not bad, "\n".join(bad)


def test_the_check_sees_relative_imports():
    """The parser resolves `from ...positions.base import x` in ops/linear/ to fastrpe.positions.base
    (so the test above can fail)."""
    p = SRC / "ops" / "linear" / "naive.py"
    names = _imported_modules(p)
    assert "fastrpe.ops.common" in names  # `from ..common import ...`
    assert all(n.startswith(("fastrpe", "torch", "__future__")) for n in names)

"""House rules that are cheap to check statically."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "actord"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_only_the_guard_module_imports_llama_cpp():
    offenders = [
        str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
        if "llama_cpp" in _imports(p) and p != PKG / "engine" / "llama.py"
    ]
    assert offenders == []


def test_actors_never_reference_libllama():
    for p in (PKG / "actors").rglob("*.py"):
        assert "engine.llama" not in p.read_text(), p

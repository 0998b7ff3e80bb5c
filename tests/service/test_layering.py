"""House rules that are cheap to check statically."""

from __future__ import annotations

import ast
from pathlib import Path
from tests.test_house import imported, parse

PKG = Path(__file__).resolve().parents[2] / "actord"


def _imports(path: Path) -> set[str]:
    tree = parse(path)
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
    for p in (PKG / "serving").rglob("*.py"):
        assert "engine.llama" not in p.read_text(), p


def _full_imports(path: Path) -> set[str]:
    return set(imported(path))


def test_the_scheduling_core_is_pure_no_anyio_no_threads_no_actors_no_engine_calls():
    banned = ("anyio", "trio", "asyncio", "threading", "sniffio", "llama_cpp", "actord.serving", "actord.engine.engine",
              "actord.engine.thread", "actord.engine.llama", "time")
    for p in (PKG / "serving" / "steps").rglob("*.py"):
        bad = [m for m in _full_imports(p) if m.startswith(banned) and not m.startswith("actord.serving.steps")]
        assert bad == [], (p, bad)


def test_the_system_facade_does_not_import_replay():
    assert not [m for m in _full_imports(PKG / "service" / "system.py") if m.startswith("actord.replay")]

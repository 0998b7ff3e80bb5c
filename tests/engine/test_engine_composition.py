"""The engine is composed, not assembled: no class in actord/engine inherits from two or
more of the project's own classes (issue 36: `Engine` was eight mixins sharing one `self`)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "actord" / "engine"


def _own_classes() -> set[str]:
    """The names of every class defined anywhere in actord."""
    out: set[str] = set()
    for p in ENGINE.parent.rglob("*.py"):
        out.update(n.name for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef))
    return out


def test_no_engine_class_is_assembled_from_two_of_our_classes():
    own = _own_classes()
    assembled = []
    for p in sorted(ENGINE.glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in n.bases]
                if sum(b in own for b in bases) >= 2:
                    assembled.append(f"{p.name}:{n.name}({', '.join(bases)})")
    assert assembled == []

"""The chat package knows no front: it imports nothing from actord.frontends, so a wire's
shapes (OpenAI's tool calls) stay in the front that speaks it."""

from __future__ import annotations

import ast
from pathlib import Path
from tests.test_house import parse

CHAT = Path(__file__).resolve().parents[2] / "actord" / "chat"


def test_the_chat_package_imports_no_front():
    bad = []
    for p in CHAT.rglob("*.py"):
        for node in ast.walk(parse(p)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [(p.name, n) for n in names if n.startswith("actord.frontends")]
    assert bad == []


def test_no_chat_module_is_over_450_lines():
    assert {p.name: n for p in CHAT.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450} == {}

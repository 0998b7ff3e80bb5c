"""The fronts speak to one typed service (actord/service/protocol.py), statically checked:
no front reads a name of the system that `Service` does not list (a private one, its
engine, its actors), assigns into it, or imports the engine or the serving floor; the chat
package, below the façade, reads only what `ChatHost` lists."""

from __future__ import annotations

import ast
from pathlib import Path

from actord.service.protocol import ChatHost, Service
from tests.test_house import imported, parse

PKG = Path(__file__).resolve().parents[2] / "actord"

# The JSON-schema -> GBNF converter runs at decode, on the event loop, in pure Python (no
# libllama call, no engine job): a request's grammar is checked where it is decoded.
PURE_ENGINE_MODULES = {"actord.engine.grammar"}


def _members(proto: type) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("__")} | set(getattr(proto, "__annotations__", {}))
    return {n for n in names if not n.startswith("_abc") and n not in ("_is_protocol", "_is_runtime_protocol")}


def _is_system(node: ast.expr) -> bool:
    """`system`, or `<anything>.system` (a route group's or a server's)."""
    return (isinstance(node, ast.Name) and node.id == "system") or (
        isinstance(node, ast.Attribute) and node.attr == "system")


def _system_uses(path: Path) -> list[tuple[int, str, bool]]:
    """(line, name, stored) for every `system.<name>` in the module."""
    out = []
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Attribute) and _is_system(node.value):
            out.append((node.lineno, node.attr, isinstance(node.ctx, ast.Store)))
    return out


def _imports(path: Path) -> set[str]:
    return set(imported(path))


def test_fronts_read_only_the_service_verbs_and_assign_nothing_into_it():
    allowed = _members(Service)
    bad = [(str(p.relative_to(PKG)), line, name, "stored" if stored else "read")
           for p in (PKG / "frontends").rglob("*.py") for line, name, stored in _system_uses(p)
           if stored or name not in allowed]
    assert bad == []


def test_fronts_import_neither_the_engine_nor_the_serving_floor():
    bad = [(str(p.relative_to(PKG)), m) for p in (PKG / "frontends").rglob("*.py") for m in _imports(p)
           if (m.startswith("actord.engine") and not any(m == e or m.startswith(e + ".") for e in PURE_ENGINE_MODULES))
           or m.startswith("actord.serving")]
    assert bad == []


def test_chat_reads_only_its_host_interface_and_imports_no_actor():
    allowed = _members(ChatHost)
    bad = [(p.name, line, name) for p in (PKG / "chat").rglob("*.py") for line, name, stored in _system_uses(p)
           if stored or name not in allowed]
    assert bad == []
    assert [(p.name, m) for p in (PKG / "chat").rglob("*.py") for m in _imports(p) if m.startswith("actord.serving")] == []


def test_the_actor_system_implements_both_interfaces():
    from actord.service.system import ActorSystem

    system_names = set(dir(ActorSystem)) | {"config", "metrics", "closing", "chat_state", "run_sync",
                                            "memory_sources"}
    assert (_members(Service) | _members(ChatHost)) - system_names == set()

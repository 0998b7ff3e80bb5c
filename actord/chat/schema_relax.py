"""JSON Schema relaxed to what the grammar converter can hold, each relaxation named.

Why: agent CLIs send tool schemas written for a hosted model, which reads them as prose and
never constrains its output with them. Claude Code 2.1's `Workflow` tool has a property with
no `type` (llama-cpp-python's converter asserts "Unrecognized schema") and a `maxLength` of
524,288 (past `MAX_REPEAT`, the bound that keeps a grammar from being written out in
copies). Refusing such a request refuses the whole agent over one tool it may never call, so
the HTTP fronts relax the schema instead and say what they relaxed (the `X-Actord-Degraded`
header, actord/frontends/http/degraded.py), as llama-server's converter quietly accepts a
typeless property as any value.

A relaxation only ever widens the schema (a JSON document valid before stays valid), so the
grammar still holds the output to the schema's shape wherever it can:
- a subschema with no type and nothing the converter reads (only annotations, or an unknown
  `type`) becomes `{}`: any JSON value;
- a count past the bound (`maxLength`, `minItems`, ...) is dropped;
- a `pattern` whose expansion passes the bound is dropped.
What is still refused after that is the caller's to decide (`relaxed` returns the notes; the
front then falls back to any object, and says so). Pure code: no I/O, no libllama.
"""

from __future__ import annotations

from typing import Any

from actord.engine.grammar import MAX_PATTERN_COST, MAX_REPEAT, pattern_cost

_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")
_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
# What the converter reads to pick a rule (its `visit`): a node with none of these is "Unrecognized".
_STRUCTURAL = ("$ref", "anyOf", "oneOf", "allOf", "const", "enum", "properties", "additionalProperties",
               "items", "prefixItems", "pattern", "format")
# Where a subschema sits inside a schema.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAPS = ("properties", "$defs", "definitions", "patternProperties")
MAX_NOTES = 16  # notes kept per schema; more are counted, not listed


def relaxed(schema: Any, where: str = "") -> tuple[Any, list[str]]:
    """(schema, notes): `schema` widened where the converter cannot hold it (see the module
    docstring), and one note per change, naming its path under `where`. A schema that needs
    nothing comes back as the same object with no notes."""
    notes: list[str] = []
    out = _node(schema, where or "schema", notes)
    if len(notes) > MAX_NOTES:
        notes[MAX_NOTES:] = [f"and {len(notes) - MAX_NOTES} more"]
    return out, notes


def _unrecognized(node: dict) -> bool:
    t = node.get("type")
    if isinstance(t, list):
        return not all(x in _TYPES for x in t)
    if t is not None:
        return t not in _TYPES
    return bool(node) and not any(k in node for k in _STRUCTURAL)


def _node(node: Any, path: str, notes: list[str]) -> Any:
    if not isinstance(node, dict):
        return node
    if _unrecognized(node):
        t = node.get("type")
        why = f"type {str(t)[:30]!r} unknown" if t is not None else "no type"
        notes.append(f"{path}: {why}, any JSON value")
        return {}
    out: dict | None = None

    def put(key: str, value: Any) -> None:
        nonlocal out
        if out is None:
            out = dict(node)
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value

    for key in _COUNTS:
        v = node.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_REPEAT):
            notes.append(f"{path}: {key} {str(v)[:20]} dropped (the grammar holds at most {MAX_REPEAT})")
            put(key, _DROP)
    pat = node.get("pattern")
    if isinstance(pat, str) and pattern_cost(pat) > MAX_PATTERN_COST:
        notes.append(f"{path}: pattern {pat[:40]!r} dropped (expands past {MAX_PATTERN_COST} grammar symbols)")
        put("pattern", _DROP)
    for key in _ONE:
        sub = node.get(key)
        if isinstance(sub, dict):
            new = _node(sub, f"{path}.{key}", notes)
            if new is not sub:
                put(key, new)
    for key in _LISTS:
        subs = node.get(key)
        if isinstance(subs, list):
            new_list = [_node(s, f"{path}.{key}[{i}]", notes) for i, s in enumerate(subs)]
            if any(a is not b for a, b in zip(new_list, subs)):
                put(key, new_list)
    for key in _MAPS:
        subs = node.get(key)
        if isinstance(subs, dict):
            new_map = {k: _node(s, f"{path}.{key}.{k}" if key != "properties" else f"{path}.{k}", notes)
                       for k, s in subs.items()}
            if any(new_map[k] is not subs[k] for k in subs):
                put(key, new_map)
    return node if out is None else out


_DROP = object()

"""JSON schemas and JSON mode -> GBNF, with llama-cpp-python's own converter.

Which converter, and why: `llama_cpp.llama_grammar.json_schema_to_gbnf` (0.3.36), the
Python port of llama.cpp's `json_schema_to_grammar.py` that llama-cpp-python keeps in step
with upstream: `$ref`/`$defs`, `allOf`/`anyOf`/`oneOf`, `enum`/`const`, `required` and
optional properties, `additionalProperties`, `prefixItems`, `minItems`/`maxItems`,
`minLength`/`maxLength`, string formats (date, time, date-time, uuid) and `pattern` (an
anchored regex subset); integer `minimum`/`maximum` it accepts but ignores (any integer
passes: its own TODO). JSON mode (`json_object`) is the
same module's `JSON_GBNF` (root ::= object). The converter is pure Python: no libllama call,
so it runs on the event loop, where a bad schema becomes a typed 400 before a request runs.

It is run under bounds, because its output grows with the numbers in a schema: it writes
`minItems: n` out as n copies of the item rule and a pattern's `{m,n}` as nested copies, so
an unbounded `minItems: 1e9` would exhaust memory before any size check. Every repetition
count is capped (`MAX_REPEAT`, llama.cpp's own grammar parser refuses more than 2000), a
pattern's expansion is estimated before conversion (`MAX_PATTERN_COST`), the alternatives
counted (`MAX_ALTERNATIVES`), and the schema's and the grammar's sizes are bounded.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from actord.engine.llama import grammar_lib
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.types import CompletionRequest

MAX_SCHEMA_BYTES = 256 * 1024
MAX_GRAMMAR_BYTES = 1024 * 1024
MAX_REPEAT = 1000
MAX_PATTERN_COST = 20_000
MAX_DEPTH = 64
# Alternatives in one schema, all its `enum`, `anyOf` and `oneOf` entries together: each is
# a parse stack its grammar tests every candidate token against, so sampling under an
# 11,500-string enum stalled a victim 19 s (issue 33).
MAX_ALTERNATIVES = 256

JSON_OBJECT_GBNF: str = grammar_lib.JSON_GBNF
_LOOSE_CHAR = 'char ::= [^"\\\\] |'
_STRICT_CHAR = 'char ::= [^"\\\\\\x7F\\x00-\\x1F] |'
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties")


def _bad(param: str, why: str) -> InvalidParams:
    return InvalidParams(f"{param}: {why}", param=param)


def check_grammar(text: str, param: str = "grammar") -> str:
    """A client's own GBNF: bounded here, parsed by libllama when its sampler is built."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise _bad(param, f"the grammar is over {MAX_GRAMMAR_BYTES} bytes")
    return text


def schema_grammar(schema: Any, param: str = "json_schema") -> str:
    """GBNF whose every sentence is a JSON document valid under `schema` (a JSON schema as
    decoded JSON). A schema the converter cannot take, or over the bounds, is a typed
    InvalidParams naming `param`."""
    if not isinstance(schema, dict):
        raise _bad(param, "a JSON schema is an object")
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as e:
        raise _bad(param, f"not a JSON schema: {e}") from None
    if len(text) > MAX_SCHEMA_BYTES:
        raise _bad(param, f"the schema is over {MAX_SCHEMA_BYTES} bytes")
    _check_bounds(schema, param)
    try:
        gbnf = grammar_lib.json_schema_to_gbnf(text)
    except RecursionError:
        raise _bad(param, "the schema nests too deeply") from None
    except Exception as e:  # the converter raises whatever its code hits (KeyError, assert, ...)
        why = str(e) or type(e).__name__
        raise _bad(param, f"the schema cannot be turned into a grammar: {why[:300]}") from None
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise _bad(param, f"the schema's grammar is over {MAX_GRAMMAR_BYTES} bytes")
    # JSON strings cannot hold raw control characters (RFC 8259; json.loads and pydantic
    # refuse them), which 0.3.36's `char` rule allows; upstream llama.cpp's converter
    # excludes them, as JSON_GBNF does.
    return gbnf.replace(_LOOSE_CHAR, _STRICT_CHAR)


def _check_bounds(schema: Any, param: str) -> None:
    todo: list[tuple[Any, int]] = [(schema, 0)]
    alternatives = 0
    while todo:
        node, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise _bad(param, f"the schema nests deeper than {MAX_DEPTH}")
        if isinstance(node, list):
            todo.extend((x, depth + 1) for x in node)
            continue
        if not isinstance(node, dict):
            continue
        for key in _COUNTS:
            v = node.get(key)
            if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_REPEAT):
                raise _bad(param, f"{key} must be an integer in [0, {MAX_REPEAT}], got {str(v)[:40]}")
        for key in ("enum", "anyOf", "oneOf"):
            v = node.get(key)
            if isinstance(v, list):
                alternatives += len(v)
                if alternatives > MAX_ALTERNATIVES:
                    raise _bad(param, f"the schema's enum, anyOf and oneOf entries are more than {MAX_ALTERNATIVES} "
                                      "together")
        pat = node.get("pattern")
        if isinstance(pat, str) and pattern_cost(pat) > MAX_PATTERN_COST:
            raise _bad(param, f"the pattern {pat[:60]!r} expands past {MAX_PATTERN_COST} grammar symbols")
        todo.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))


def pattern_cost(p: str) -> int:
    """An upper estimate of the symbols a regex's conversion writes out: quantifiers
    {m,n} multiply what they apply to (nested groups multiply in turn)."""
    stack = [0]
    last = 0
    i, n = 0, len(p)
    while i < n:
        c = p[i]
        if c == "\\":
            i += 2
            last = 1
            stack[-1] += 1
        elif c == "[":
            j = i + 1
            while j < n and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            i = j + 1
            last = 1
            stack[-1] += 1
        elif c == "(":
            stack.append(0)
            i += 1
            last = 0
        elif c == ")":
            inner = stack.pop() if len(stack) > 1 else 0
            stack[-1] += inner
            last = inner
            i += 1
        elif c == "{":
            j = p.find("}", i)
            if j < 0:
                return MAX_PATTERN_COST + 1  # unbalanced: the converter would fail anyway
            nums = [x.strip() for x in p[i + 1:j].split(",")]
            try:
                k = max(int(x) for x in nums if x)
            except ValueError:
                return MAX_PATTERN_COST + 1
            if k > MAX_REPEAT:
                return MAX_PATTERN_COST + 1
            k = max(k, 1) + (1 if len(nums) == 2 and not nums[1] else 0)
            stack[-1] += last * (k - 1)
            last *= k
            i = j + 1
            if stack[-1] > MAX_PATTERN_COST:
                return stack[-1]
        else:
            last = 1
            stack[-1] += 1
            i += 1
    return sum(stack)


def compiled(request: CompletionRequest) -> CompletionRequest:
    """`request` under one GBNF: its json_schema converted once (the slot builds its sampler
    from `grammar`), or its grammar checked; a bad one is an InvalidParams naming the field.
    Where a checked request enters (the façade's `complete`, and a front that must refuse
    before its answer starts), after `CompletionRequest.check`."""
    if request.json_schema is not None:
        return msgspec.structs.replace(request, grammar=schema_grammar(request.json_schema, "json_schema"),
                                       json_schema=None)
    if request.grammar:
        check_grammar(request.grammar)
    return request

"""OpenAI's wire shapes of tools and tool calls, to and from actord's (actord.chat.messages).

Why here and not in actord/chat: the chat package plans, constrains and parses tool calls
in actord's own shapes (`Tool`, `ToolCall`, and the `CallMade` events a streamed answer
carries); which JSON a client speaks is a front's business. Chat Completions and the
Responses API read tools and calls through these functions, and write calls and streamed
call deltas with them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from actord.chat.messages import Tool, ToolCall
from actord.vocabulary.errors import InvalidParams


def _bad(param: str, why: str) -> InvalidParams:
    return InvalidParams(f"{param}: {why}", param=param)


def tools_from_openai(v: Any, param: str = "tools", flat: bool = False) -> list[Tool]:
    """OpenAI's `tools` (chat: `{"type": "function", "function": {...}}`; Responses, `flat`:
    `{"type": "function", "name": ..., "parameters": ...}`) as Tools. Other tool types
    (built-in tools, custom grammars) are a 400 naming them."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise _bad(param, "a list of tools")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise _bad(f"{param}[{i}].type", f"only function tools are supported, not {str(kind)[:40]!r}")
        fn = t if flat else t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{i}]", "a function tool needs a function with a name")
        desc = fn.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"{param}[{i}].description", "a string")
        out.append(Tool(name=fn["name"], description=desc, parameters=fn.get("parameters")))
    return out


def functions_from_openai(functions: Any, function_call: Any) -> tuple[list[Tool], Any]:
    """Legacy `functions` / `function_call` as tools and a tool_choice."""
    tools = tools_from_openai([{"type": "function", "function": f} for f in functions]
                              if isinstance(functions, list) else functions, "functions")
    if function_call is None or function_call in ("auto", "none"):
        return tools, function_call or "auto"
    if isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
        return tools, {"type": "function", "function": {"name": function_call["name"]}}
    raise _bad("function_call", 'auto, none, or {"name": ...}')


def calls_from_openai(v: Any, param: str) -> list[ToolCall]:
    """An assistant message's `tool_calls` as the client sends them back."""
    if not isinstance(v, list):
        raise _bad(param, "a list of tool calls")
    out = []
    for j, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{param}[{j}]", 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        if not isinstance(args, str):
            raise _bad(f"{param}[{j}].function.arguments", "the JSON text of an object")
        cid = c.get("id")
        out.append(ToolCall(id=cid if isinstance(cid, str) else f"call_{j}", name=fn["name"], arguments=args))
    return out


def call_to_openai(c: ToolCall) -> dict[str, Any]:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def call_deltas(calls: Iterable[Any] | None) -> list[dict[str, Any]]:
    """A streamed chunk's CallMade events (actord.chat.stream) as OpenAI's `tool_calls`
    deltas: each call whole, its header and its arguments in one delta, by its index within
    the choice."""
    return [{"index": m.index, **call_to_openai(m.call)} for m in calls or ()]

"""Tool calling: the tools in the prompt, a grammar for the call, the format's choice.

Pure code (no I/O, no libllama): a chat turn (actord/chat/turn.py) asks `plan_turn` for
what one turn needs (the messages and tools as the template gets them, the grammar and its
triggers, the control tokens whose text the output must keep) and parses the output with
that turn's `Scanner` (actord/chat/tool_output.py, the parser and the typed stream events),
which the streamed and the whole answer share, so both always agree. The tool and call
shapes are actord.chat.messages'; OpenAI's wire forms of them are the HTTP front's
(actord/frontends/http/openai/tools_wire.py).

Formats, chosen from the chat template's source (`detect_format`, first match wins; the
daemon's `--tool-format` overrides it):

- `hermes` (Hermes 2/3, Qwen 2.5/3, and every template naming `<tool_call>`): the template
  renders `tools`; a call is `<tool_call>{"name": N, "arguments": {...}}</tool_call>`,
  several in a row for parallel calls, free text allowed before them.
- `mistral` (templates naming `[TOOL_CALLS]`): `[TOOL_CALLS][{"name": N, "arguments":
  {...}}, ...]`; call ids are 9 alphanumerics, which Mistral's templates insist on.
- `llama3` (templates naming `<|python_tag|>`, or Llama 3's `<|start_header_id|>` headers
  together with `tools`): a call is the JSON object `{"name": N, "parameters": {...}}`
  opening the answer (optionally after `<|python_tag|>`), several separated by `;`.
- `generic` (anything else, e.g. Gemma 3, whose template knows no tools): the tools are
  described in a system message (merged into the conversation's own first one), the
  template never sees `tools`, and the output is held to a grammar from the first token:
  one JSON object `{"name": N, "arguments": {...}}` per line for a call, or (auto) free
  text that does not open with `{`. History is rewritten for such templates: an assistant
  turn's calls become its text (the same JSON lines), and `tool` results become a user
  turn (consecutive ones merged, so templates that insist on alternating roles take them).

Grammar (GBNF through actord.engine.grammar's converter): the call is one JSON schema,
`anyOf` one object per allowed tool with `name` fixed by `const` and its arguments under
the tool's own `parameters` schema; the format wraps it in its markers. `required` and a
named function apply that grammar from the first token (named: only that tool in the
`anyOf`, and exactly one call, as OpenAI and Anthropic give); `auto` on the native
formats applies it lazily, from the first marker the model writes (`<tool_call>`,
`[TOOL_CALLS]`, `<|python_tag|>`, or a `{` opening a llama3 answer): text before a call
is free, and a call, once begun, is valid JSON under its schema. `none` renders no tools
and parses nothing: the answer is text. `parallel_tool_calls: false` lets the grammar take
one call. The grammar guarantees a call only when generation
ends by itself: a `length` cut leaves an unfinished call, which parses as text.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import msgspec

from actord.chat.messages import Tool, ToolCall
from actord.chat.tool_output import AT_START, OPENERS, Scanner
from actord.vocabulary.errors import InvalidParams
from actord.vocabulary.types import Trigger

FORMATS = ("hermes", "mistral", "llama3", "generic")
MAX_TOOLS = 128


_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _bad(param: str, why: str) -> InvalidParams:
    return InvalidParams(f"{param}: {why}", param=param)


def check_tools(tools: list[Tool], choice: Any, param: str = "tools") -> tuple[str, str]:
    """(mode, name): mode is auto | none | required | named (then `name` is the function).
    Refuses, naming the field, what cannot be honoured."""
    if len(tools) > MAX_TOOLS:
        raise _bad(param, f"{len(tools)} tools, at most {MAX_TOOLS}")
    names = set()
    for i, t in enumerate(tools):
        if not _NAME.match(t.name):
            raise _bad(f"{param}[{i}].function.name", "a function name is 1-64 letters, digits, '_', '.' or '-'")
        if t.name in names:
            raise _bad(f"{param}[{i}].function.name", f"the function {t.name!r} is listed twice")
        names.add(t.name)
        if t.parameters is not None and not isinstance(t.parameters, dict):
            raise _bad(f"{param}[{i}].function.parameters", "a JSON schema is an object")
        _check_schema(msgspec.json.encode(_params(t)), f"{param}[{i}].function.parameters")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _bad("tool_choice", f"{choice[:40]!r} is not auto, none, required or a named function")
        if choice == "required" and not tools:
            raise _bad("tool_choice", "required needs tools")
        return choice, ""
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    if not isinstance(name, str):
        raise _bad("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    if name not in names:
        raise _bad("tool_choice", f"names the function {name[:64]!r}, which is not in tools")
    return "named", name


@functools.lru_cache(maxsize=256)
def _check_schema(schema: bytes, param: str) -> None:
    """A tool's parameters must convert to a grammar (a 400 naming the tool otherwise)."""
    from actord.engine.grammar import schema_grammar

    schema_grammar(json.loads(schema), param)



# -- which format ----------------------------------------------------------------------------


def detect_format(template: str | None) -> tuple[str, str]:
    """(format, why) for a chat template's source (see the module docstring)."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes", "the template names <tool_call>"
    if "[TOOL_CALLS]" in t:
        return "mistral", "the template names [TOOL_CALLS]"
    if "<|python_tag|>" in t:
        return "llama3", "the template names <|python_tag|>"
    if "<|start_header_id|>" in t and "tools" in t:
        return "llama3", "the template has Llama 3 headers and renders tools"
    return "generic", "the template names no tool-call markers"


# -- one turn -----------------------------------------------------------------------------------


_ARG_KEY = {"hermes": "arguments", "mistral": "arguments", "llama3": "parameters", "generic": "arguments"}
_PRESERVE = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]",),
             "llama3": ("<|python_tag|>",), "generic": ()}


def _args_dict(text: str) -> Any:
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v


def _native_message(m: Any, names: dict[str, str]) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        # HF templates write `arguments | tojson`: they want the object, not its text.
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.name, "arguments": _args_dict(c.arguments)}}
                           for c in m.tool_calls]
    if m.role == "tool":
        d["tool_call_id"] = m.tool_call_id or ""
        name = m.name or names.get(m.tool_call_id or "")
        if name:
            d["name"] = name
    elif m.name:
        d["name"] = m.name
    if m.reasoning_content is not None:  # a past thought, for templates that keep them (Qwen3's)
        d["reasoning_content"] = m.reasoning_content
    return d


def call_line(c: ToolCall, key: str = "arguments") -> str:
    return json.dumps({"name": c.name, key: _args_dict(c.arguments)}, ensure_ascii=False)


def generic_system(tools: list[Tool]) -> str:
    """The system text that describes the tools to a template that knows none; it depends on
    the tools only (not on tool_choice), so the prompt's prefix stays the same across turns."""
    lines = ["You can call these functions:"]
    for t in tools:
        lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": _params(t)},
                                ensure_ascii=False))
    lines.append('To call a function, reply with only a JSON object on one line: '
                 '{"name": <function name>, "arguments": <arguments object>} (one line per call). '
                 'The function\'s result comes back in the next message. Otherwise, reply in text.')
    return "\n".join(lines)


def _generic_messages(messages: list[Any], tools: list[Tool] | None) -> list[dict[str, Any]]:
    """History for a template without tool support (see the module docstring)."""
    names = {c.id: c.name for m in messages for c in (m.tool_calls or [])}
    out: list[dict[str, Any]] = []
    from_tool: list[bool] = []
    for m in messages:
        if m.role == "tool":
            name = m.name or names.get(m.tool_call_id or "", "")
            head = f"Result of {name}" if name else "Result"
            if m.tool_call_id:
                head += f" (call {m.tool_call_id})"
            d, tool = {"role": "user", "content": f"{head}:\n{m.content}"}, True
        elif m.role == "assistant" and m.tool_calls:
            body = "\n".join(call_line(c) for c in m.tool_calls)
            d, tool = {"role": "assistant", "content": f"{m.content}\n{body}" if m.content else body}, False
        else:
            d, tool = {"role": m.role, "content": m.content}, False
        if m.role == "assistant" and m.reasoning_content is not None:
            d["reasoning_content"] = m.reasoning_content
        if out and d["role"] == "user" == out[-1]["role"] and (tool or from_tool[-1]):
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + d["content"]}
            from_tool[-1] = True
            continue
        out.append(d)
        from_tool.append(tool)
    if tools:
        text = generic_system(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _params(t: Tool) -> dict:
    return t.parameters if t.parameters else {"type": "object", "properties": {}}


def tools_for_template(tools: list[Tool]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": _params(t)}} for t in tools]


class Turn:
    """What one chat turn with tools needs (built by `plan_turn`)."""

    def __init__(self, fmt: str, mode: str, tools: list[Tool], render: list[dict[str, Any]],
                 template_tools: list[dict[str, Any]] | None, grammar: str, triggers: list[Trigger],
                 preserve: list[str], parallel: bool) -> None:
        self.format, self.mode, self.tools = fmt, mode, tools
        self.render, self.template_tools = render, template_tools
        self.grammar, self.triggers, self.preserve, self.parallel = grammar, triggers, preserve, parallel

    @property
    def parses(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def scanner(self) -> "Scanner":
        return Scanner(self.format, {t.name for t in self.tools} if self.parses else None,
                       max_calls=None if self.parallel else 1)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole output; what the streamed events add up to."""
        sc = self.scanner()
        sc.feed(text)
        sc.finish()
        return sc.content, sc.calls


def plan_turn(fmt: str, messages: list[Any], tools: list[Tool], mode: str, name: str = "",
              parallel: bool = True) -> Turn:
    """A turn's rendering and constraints. `messages` are actord.chat.messages.ChatMessage (with
    `tool_calls`, `tool_call_id`, `name`); `mode`/`name` as `check_tools` returns them."""
    if fmt not in FORMATS:
        raise _bad("tool_format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
    # A named function is one call (OpenAI's and Anthropic's meaning), whatever
    # parallel_tool_calls says: its grammar takes one and the scanner keeps one.
    parallel = parallel and mode != "named"
    active = tools if mode != "none" else []
    if fmt == "generic":
        render = _generic_messages(messages, active)
        template_tools = None
    else:
        names = {c.id: c.name for m in messages for c in (m.tool_calls or [])}
        render = [_native_message(m, names) for m in messages]
        template_tools = tools_for_template(active) if active else None
    grammar, triggers = "", []
    if active:
        allowed = [t for t in active if mode != "named" or t.name == name]
        grammar = call_grammar(fmt, tuple(msgspec.json.encode(t) for t in allowed), mode, parallel)
        if mode == "auto" and fmt != "generic":
            triggers = [Trigger(text=o) for o in OPENERS[fmt]]
            if fmt in AT_START:
                triggers.append(Trigger(text=AT_START[fmt], at_start=True))
    return Turn(fmt, mode, active, render, template_tools, grammar, triggers,
                list(_PRESERVE[fmt]) if active else [], parallel)


# -- the grammar --------------------------------------------------------------------------------------

_ROOT = re.compile(r"(?<![\w-])root(?![\w-])")


@functools.lru_cache(maxsize=64)
def call_grammar(fmt: str, tools: tuple[bytes, ...], mode: str, parallel: bool) -> str:
    """GBNF for the format's call section(s) over `tools` (msgspec-encoded Tools, so the
    result can be cached); a tool's schema the converter cannot take is a 400 naming it."""
    from actord.engine.grammar import schema_grammar

    key = _ARG_KEY[fmt]
    decoded = [msgspec.json.decode(t, type=Tool) for t in tools]
    alts = []
    for t in decoded:
        alts.append({"type": "object", "properties": {"name": {"const": t.name}, key: _params(t)},
                     "required": ["name", key], "additionalProperties": False})
    body = schema_grammar(alts[0] if len(alts) == 1 else {"anyOf": alts}, "tools")
    body = _ROOT.sub("actord-call", body)
    ws = 'actord-ws ::= [ \\n]{0,2}\n'
    more = parallel
    if fmt == "hermes":
        one = '"<tool_call>" actord-ws actord-call actord-ws "</tool_call>"'
        root = f"root ::= {one}" + (f" (actord-ws {one})*" if more else "")
    elif fmt == "mistral":
        root = 'root ::= "[TOOL_CALLS]" actord-ws "[" actord-ws actord-call ' + \
            ('("," actord-ws actord-call)* ' if more else "") + 'actord-ws "]"'
    elif fmt == "llama3":
        calls = "actord-call" + (' (";" actord-ws actord-call)*' if more else "")
        root = f'root ::= "<|python_tag|>" actord-ws actord-calls | actord-calls\nactord-calls ::= {calls}'
    else:
        calls = "actord-call" + (' ("\\n" actord-call)*' if more else "")
        if mode == "auto":
            # A call, or text: text cannot open with '{' (nor whitespace before one).
            root = (f"root ::= actord-calls | actord-text\nactord-calls ::= {calls}\n"
                    'actord-text ::= [^{ \\t\\r\\n] [^\\x00]*')
        else:
            root = f"root ::= {calls}"
    return f"{root}\n{ws}{body}"

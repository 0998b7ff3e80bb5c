"""Tool calling: the tools in the prompt, a grammar for the call, the output parsed back.

Pure code (no I/O, no libllama): `system.chat` asks `plan_turn` for what one turn needs
(the messages and tools as the template gets them, the grammar and its triggers, the
control tokens whose text the output must keep) and parses the output with that turn's
`Scanner`, which the streamed and the whole answer share, so both always agree.

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
`anyOf`); `auto` on the native formats applies it lazily, from the first marker the
model writes (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`, or a `{` opening a llama3
answer): text before a call is free, and a call, once begun, is valid JSON under its
schema. `none` renders no tools and parses nothing: the answer is text. `parallel_tool_calls:
false` lets the grammar take one call. The grammar guarantees a call only when generation
ends by itself: a `length` cut leaves an unfinished call, which parses as text.

Parsing never raises: a call section that is not well-formed JSON, names a function the
request did not offer, or carries non-object arguments is kept as content text; what is
well-formed becomes `tool_calls`, and the rest of the output is content.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import string
from typing import Any, Iterable

import msgspec

from actord.service.types import Trigger
from actord.service.errors import InvalidParams

FORMATS = ("hermes", "mistral", "llama3", "generic")
MAX_TOOLS = 128


# -- shapes ------------------------------------------------------------------------------


class Tool(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One function the model may call (OpenAI's `tools[].function`)."""

    name: str
    description: str = ""
    parameters: dict | None = None


class ToolCall(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One call the model made: `arguments` is the JSON text of an object (OpenAI's)."""

    id: str
    name: str
    arguments: str = "{}"


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


def new_call_id(fmt: str) -> str:
    if fmt == "mistral":  # Mistral's templates refuse any other id
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# -- OpenAI's wire shapes -> these -----------------------------------------------------------


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
_OPENERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",), "generic": ()}
_CLOSER = {"hermes": "</tool_call>"}
_AT_START = {"llama3": "{", "generic": "{"}
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
    """A turn's rendering and constraints. `messages` are actord.chat.template.ChatMessages (with
    `tool_calls`, `tool_call_id`, `name`); `mode`/`name` as `check_tools` returns them."""
    if fmt not in FORMATS:
        raise _bad("tool_format", f"{fmt!r} is not one of {', '.join(FORMATS)}")
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
            triggers = [Trigger(text=o) for o in _OPENERS[fmt]]
            if fmt in _AT_START:
                triggers.append(Trigger(text=_AT_START[fmt], at_start=True))
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


# -- parsing --------------------------------------------------------------------------------------------


_WS = " \t\r\n"


class Scanner:
    """Incremental parser of one output in one format: `feed` text as it streams, `finish`
    at the end; each returns events, ("content", text) or ("call", ToolCall). The content
    and calls so far are in `content` and `calls`. Leading and trailing whitespace of the
    content is dropped (held back until text follows), and text that may be the start of
    a marker is held back until it is not. `names`: the functions offered (None: no tools,
    nothing parses). Work per feed is proportional to the new text (the JSON scan resumes)."""

    def __init__(self, fmt: str, names: set[str] | None, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.names = names
        self.max_calls = max_calls
        self.openers = _OPENERS[fmt] if names is not None else ()
        self.at_start = _AT_START.get(fmt) if names is not None else None
        self.closer = _CLOSER.get(fmt)
        self.buf = ""
        self.pos = 0  # buf[:pos] is consumed
        self.boundary = True  # at the output's start or right after a call: leading whitespace drops
        self.held_ws = ""
        self.section: int | None = None  # buf index where the open section starts
        self.section_opener = ""
        self._json_at = -1  # the JSON value being scanned: where it starts, and the scan's state
        self._scan = (0, 0, False, False)  # next index, depth, in string, after backslash
        self._content: list[str] = []
        self.calls: list[ToolCall] = []

    @property
    def content(self) -> str:
        return "".join(self._content)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._run(final=True)

    # -- internals --

    def _emit_text(self, s: str, out: list[tuple[str, Any]]) -> None:
        if not s:
            return
        if self.boundary:
            s = s.lstrip(_WS)
            if not s:
                return
        stripped = s.rstrip(_WS)
        if not stripped:
            self.held_ws += s
            return
        text = self.held_ws + stripped
        self.held_ws = s[len(stripped):]
        self.boundary = False
        self._content.append(text)
        out.append(("content", text))

    def _run(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while True:
            if self.section is not None:
                if not self._section(final, out):
                    break
                continue
            if not self._text(final, out):
                break
        if final:
            self.held_ws = ""
        return out

    def _text(self, final: bool, out: list[tuple[str, Any]]) -> bool:
        """Text mode: emit what cannot be a marker; True when a section opened."""
        rest = self.buf[self.pos:]
        if not rest:
            return False
        can_call = self.max_calls is None or len(self.calls) < self.max_calls
        if self.boundary and self.at_start and can_call:
            s = rest.lstrip(_WS + (";" if self.calls else ""))
            if not s:
                if final:
                    self.pos = len(self.buf)
                return False
            if s[0] == self.at_start:
                self._open(self.pos + len(rest) - len(s), "")
                return True
        best, which = -1, ""
        if can_call:
            for op in self.openers:
                i = rest.find(op)
                if i >= 0 and (best < 0 or i < best):
                    best, which = i, op
        if best >= 0:
            self._emit_text(rest[:best], out)
            self._open(self.pos + best, which)
            return True
        hold = 0
        if not final and can_call:
            for op in self.openers:
                for k in range(min(len(op) - 1, len(rest)), 0, -1):
                    if rest.endswith(op[:k]):
                        hold = max(hold, k)
                        break
        self._emit_text(rest[:len(rest) - hold], out)
        self.pos = len(self.buf) - hold
        return False

    def _open(self, at: int, opener: str) -> None:
        self.pos = at
        self.section, self.section_opener = at, opener
        self._json_at = -1

    def _fail(self, out: list[tuple[str, Any]]) -> None:
        """The open section is not a call: its opening becomes text, and scanning goes on after it."""
        assert self.section is not None
        head = self.section_opener or self.buf[self.section]
        self.boundary = False if head.strip() else self.boundary
        self._emit_text(head, out)
        self.pos = self.section + len(head)
        self.section = None

    def _section(self, final: bool, out: list[tuple[str, Any]]) -> bool:
        """Section mode: True when the section ended (a call or a failure), False to wait."""
        assert self.section is not None
        j = self.section + len(self.section_opener)
        if self._json_at < 0:
            while j < len(self.buf) and self.buf[j] in _WS:
                j += 1
            if j >= len(self.buf):
                if final:
                    self._fail(out)
                    return True
                return False
            if self.buf[j] not in "{[":
                self._fail(out)
                return True
            self._json_at = j
            self._scan = (j, 0, False, False)
        end = self._scan_json()
        if end is None:
            if final:
                self._fail(out)
                return True
            return False
        if end < 0:
            self._fail(out)
            return True
        calls = self._calls(self.buf[self._json_at:end])
        if calls is None:
            self._fail(out)
            return True
        stop = end
        if self.closer:
            k = end
            while k < len(self.buf) and self.buf[k] in _WS:
                k += 1
            tail = self.buf[k:k + len(self.closer)]
            if tail == self.closer:
                stop = k + len(self.closer)
            elif self.closer.startswith(tail) and not final:
                return False  # the closer may be on its way
            # else: no closer (a model that ends the call with EOS): the call stands.
        for c in calls:
            self.calls.append(c)
            out.append(("call", c))
        self.pos, self.section, self.boundary, self.held_ws = stop, None, True, ""
        return True

    def _scan_json(self) -> int | None:
        """Where the JSON value at `_json_at` ends (exclusive); None: not yet; -1: broken."""
        k, depth, in_str, esc = self._scan
        if depth < 0:
            return k  # found before (a closer was awaited)
        buf, n = self.buf, len(self.buf)
        while k < n:
            c = buf[k]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._scan = (k + 1, -1, False, False)
                    return k + 1
            k += 1
        self._scan = (k, depth, in_str, esc)
        return None

    def _calls(self, text: str) -> list[ToolCall] | None:
        try:
            v = json.loads(text)
        except ValueError:
            return None
        items = v if isinstance(v, list) and self.fmt == "mistral" else [v]
        if not items:
            return None
        calls = []
        for it in items:
            c = self._call(it)
            if c is None:
                return None
            calls.append(c)
        if self.max_calls is not None and len(self.calls) + len(calls) > self.max_calls:
            return None
        return calls

    def _call(self, it: Any) -> ToolCall | None:
        if not isinstance(it, dict) or not isinstance(it.get("name"), str):
            return None
        if self.names is not None and it["name"] not in self.names:
            return None
        args = it.get("arguments", it.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(id=new_call_id(self.fmt), name=it["name"], arguments=json.dumps(args, ensure_ascii=False))


class StreamAdapter:
    """A chat's stream sink seen through a Scanner: each raw chunk goes on with its content
    parsed (text only) and `tool_calls` deltas (OpenAI's shape) when calls completed."""

    def __init__(self, scanner: Scanner, sink: Any) -> None:
        self.scanner, self.sink, self.n_calls = scanner, sink, 0

    def __call__(self, chunk: dict[str, Any]) -> None:
        self._send(chunk, self.scanner.feed(chunk.get("content", "")))

    def finish(self, slot: int) -> None:
        events = self.scanner.finish()
        if events:
            self._send({"slot": slot, "content": "", "tokens": []}, events)

    def _send(self, chunk: dict[str, Any], events: list[tuple[str, Any]]) -> None:
        text, deltas = events_to_deltas(events, self.n_calls)
        self.n_calls += len(deltas)
        if not (text or deltas or chunk.get("logprobs")):
            return  # held back (a marker may be starting, or a call is being written)
        out = {**chunk, "content": text}
        if deltas:
            out["tool_calls"] = deltas
        self.sink(out)


def events_to_deltas(events: Iterable[tuple[str, Any]], first_index: int) -> tuple[str, list[dict[str, Any]]]:
    """Scanner events as one OpenAI chat delta's parts: (content, tool_calls deltas); the
    call indices count on from `first_index`. A call arrives whole: its header and its
    arguments in one delta (a call is sent once its JSON is complete, so a streamed answer
    never holds a call the final parse would refuse)."""
    text, deltas = [], []
    for kind, v in events:
        if kind == "content":
            text.append(v)
        else:
            deltas.append({"index": first_index + len(deltas), "id": v.id, "type": "function",
                           "function": {"name": v.name, "arguments": v.arguments}})
    return "".join(text), deltas

"""A model's output with tool calls, parsed back: the Scanner, and the stream it feeds.

The `Scanner` parses one output in one format (actord/chat/tools.py chooses the format and
constrains the output); the streamed answer and the whole one share it, so both always
agree. `StreamAdapter` puts a Scanner between a chat's completion and its stream sink: each
chunk goes on with its content parsed and the calls it completed as `CallMade` events,
actord's own typed shape. The fronts write them in their wire's shape (the socket and the
OpenAI HTTP front: OpenAI's `tool_calls` deltas; the Responses API: its function_call
items), so nothing here knows a wire.

What each format's output looks like (its call markers, and the call id it wants) is here,
beside the parser that reads it; tools.py reads the same tables to build the grammar.

Parsing never raises: a call section that is not well-formed JSON, names a function the
request did not offer, or carries non-object arguments is kept as content text; what is
well-formed becomes a call, and the rest of the output is content.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from actord.chat.stream import CallMade, carry
from actord.chat.messages import ToolCall

# What opens a call section (free text may come before it), what closes one, and what
# opens a call only at the output's start (or right after a call).
OPENERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3": ("<|python_tag|>",), "generic": ()}
CLOSER = {"hermes": "</tool_call>"}
AT_START = {"llama3": "{", "generic": "{"}


def new_call_id(fmt: str) -> str:
    if fmt == "mistral":  # Mistral's templates refuse any other id
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + secrets.token_hex(12)


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
        self.openers = OPENERS[fmt] if names is not None else ()
        self.at_start = AT_START.get(fmt) if names is not None else None
        self.closer = CLOSER.get(fmt)
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

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The end of the output. `cut`: it ended at its token limit, so a call the limit
        left unwritten (its opener seen, or its opener's first characters) is dropped, not
        shown as text: markup is never content, and the stop reason says the answer was
        cut. A section that opened without a marker (a format whose call is bare JSON)
        stays text: it may be the answer itself."""
        if cut:
            self._run(final=False)  # what cannot be a marker goes out; a marker's start stays held
            written = self._json_at >= 0 and self._scan[1] < 0  # its JSON whole: only the closer is cut
            if self.section is not None and self.section_opener and not written:
                self.pos, self.section = len(self.buf), None
            elif self.section is not None and written and self.closer:
                end = self._scan[0]
                tail = self.buf[end:].lstrip(_WS)
                if self.closer.startswith(tail):  # the closer's first characters: it is the closer
                    self.buf = self.buf[:len(self.buf) - len(tail)] + self.closer
            elif self.section is None:
                self.pos = len(self.buf)
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
    parsed (text only) and, under `calls`, the CallMade events of the calls it completed."""

    def __init__(self, scanner: Scanner, sink: Any) -> None:
        self.scanner, self.sink, self.n_calls = scanner, sink, 0
        self.held: dict[str, Any] = {}  # a held-back chunk's PLACED fields (actord.chat.stream.carry)

    def __call__(self, chunk: dict[str, Any]) -> None:
        if "progress" in chunk:  # the prompt's progress: no text to parse
            self.sink(chunk)
            return
        self._send(chunk, self.scanner.feed(chunk.get("content", "")))

    def finish(self, slot: int, cut: bool = False) -> None:
        events = self.scanner.finish(cut)
        if events:
            self._send({"slot": slot, "content": "", "tokens": []}, events)

    def _send(self, chunk: dict[str, Any], events: list[tuple[str, Any]]) -> None:
        text = "".join(v for kind, v in events if kind == "content")
        calls = [CallMade(index=self.n_calls + i, call=v)
                 for i, v in enumerate(v for kind, v in events if kind == "call")]
        self.n_calls += len(calls)
        if not (text or calls or chunk.get("logprobs") or chunk.get("reasoning")):
            self.held = carry(self.held, chunk)
            return  # held back (a marker may be starting, or a call is being written)
        out = {**self.held, **chunk, "content": text}
        self.held = {}
        if calls:
            out["calls"] = calls
        self.sink(out)

"""What a request asked for that this server answers in a lesser form, and the header saying so.

Why: agent CLIs (Claude Code, Codex CLI) send requests shaped for a hosted model: tool
schemas the grammar cannot hold, hosted tools (`web_search`) no local server runs, tool
`namespace`s, system messages where a strict template refuses them. Refusing any of these
refuses the agent's every turn; ignoring them silently changes the answer without a word.
So the HTTP fronts answer, and name each thing they changed in one response header,
`X-Actord-Degraded` (a list of notes, `; `-separated, bounded in bytes), which a client or
a person reading a trace can see. The changes:

- a tool's schema relaxed where the converter cannot hold it (actord/chat/schema_relax.py);
  one it still cannot take after that becomes "any object" for that tool;
- hosted tools dropped (OpenAI's `web_search`, `file_search`, ...; Anthropic's server tools);
  a Responses `namespace` flattened into its function tools;
- system messages merged into one leading one, and consecutive same-role messages merged,
  only where the model's template refuses the shape (probed once: `template_folds`);
- a `text.format` beside a forced tool call dropped (the call's grammar already holds the
  output); a reasoning item returned to us that this server did not write dropped.

`Degraded` collects the notes of one request; the routes add its header to the answer
(streamed or whole: `streaming.Generation(headers=...)`).
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.chat.folding import merge_runs, merge_systems, runs, stray_systems
from actord.chat.messages import ChatMessage, Tool
from actord.chat.schema_relax import relaxed
from actord.vocabulary.errors import ActordError, ChatTemplateError
from actord.vocabulary.log import get

log = get("actord.frontends.http")

HEADER = "x-actord-degraded"
MAX_HEADER_BYTES = 4096


class Degraded:
    """The notes of one request (see the module docstring)."""

    def __init__(self) -> None:
        self.notes: list[str] = []

    def add(self, note: str) -> None:
        self.notes.append(note)

    def __bool__(self) -> bool:
        return bool(self.notes)

    def header_value(self) -> str:
        """The notes as one header value: ASCII (others escaped), at most MAX_HEADER_BYTES."""
        out, n = [], 0
        for i, note in enumerate(self.notes):
            text = note.replace(";", ",").encode("ascii", "backslashreplace").decode("ascii")
            text = "".join(c if " " <= c <= "~" else " " for c in text)
            if n + len(text) + 2 > MAX_HEADER_BYTES - 32:
                out.append(f"and {len(self.notes) - i} more")
                break
            out.append(text)
            n += len(text) + 2
        return "; ".join(out)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """The answer's extra headers (none when nothing was degraded)."""
        if not self.notes:
            return []
        log.info("http.degraded", notes=self.notes[:16], n=len(self.notes))
        return [(HEADER.encode(), self.header_value().encode("ascii"))]


def unrunnable(t: Any, where: str, degraded: Degraded) -> bool:
    """Whether a wire tool (a JSON object, OpenAI's shapes) is one no local server can call,
    noted as dropped: a hosted tool (`web_search`, `file_search`, `code_interpreter`, ...)
    or a `custom` (freeform) one, whose input is not JSON arguments. Chat Completions and
    the Responses API drop them alike."""
    kind = t.get("type", "function") if isinstance(t, dict) else None
    if kind == "custom":
        custom = t.get("custom")  # Chat Completions nests the tool's fields, Responses does not
        name = t.get("name") or (custom.get("name") if isinstance(custom, dict) else None)
        degraded.add(f"{where}: custom tool {str(name)[:40]!r} dropped: only function tools "
                     "(JSON arguments) are called here")
        return True
    if isinstance(kind, str) and kind not in ("function", "namespace"):
        degraded.add(f"{where}: hosted tool {kind[:40]!r} dropped: this server runs none")
        return True
    return False


def relax_tools(tools: list[Tool], degraded: Degraded, param: str = "tools") -> list[Tool]:
    """Each tool's schema relaxed to what the grammar holds (`relax_tool`)."""
    return [relax_tool(t, f"{param}[{i}]", degraded) for i, t in enumerate(tools)]


def relax_tool(t: Tool, param: str, degraded: Degraded) -> Tool:
    """A tool's schema relaxed to what the grammar holds (notes in `degraded`, naming `param`
    and the tool); a schema still refused after that becomes any object, named. Other
    refusals (names, counts) stay refusals: they are the request's own errors."""
    from actord.chat.tools import _check_schema, _params

    if not isinstance(t.parameters, dict):
        return t
    where = f"{param} ({t.name[:64]})"
    schema, notes = relaxed(t.parameters, where)
    for note in notes:
        degraded.add(note)
    t = t if schema is t.parameters else msgspec.structs.replace(t, parameters=schema)
    try:
        _check_schema(msgspec.json.encode(_params(t)), where)
    except ActordError as e:
        degraded.add(f"{where}: schema not held by the grammar ({e.message[:120]}), any object")
        t = msgspec.structs.replace(t, parameters={"type": "object"})
    return t


def relax_schema(schema: Any, param: str, degraded: Degraded) -> Any:
    """An output format's schema relaxed (notes in `degraded`); the caller's converter still
    refuses what relaxing cannot fix."""
    if not isinstance(schema, dict):
        return schema
    out, notes = relaxed(schema, param)
    for note in notes:
        degraded.add(note)
    return out


class Folds(msgspec.Struct, frozen=True):
    """What the model's template refuses (probed once per front: `probe_folds`)."""

    systems: bool = False  # a second system message, or one after the first turn
    runs: bool = False  # two messages of one role in a row


async def probe_folds(service: Any) -> Folds:
    """Render three small conversations with the model's template and note which it refuses.
    A template that cannot render at all (none, or broken) folds nothing: the turn itself
    reports that; nor does a service that renders no templates here (the cluster's router,
    whose nodes render)."""
    if not hasattr(service, "apply_template"):
        return Folds()

    def m(role: str, text: str) -> ChatMessage:
        return ChatMessage(role=role, content=text)

    async def refuses(msgs: list[ChatMessage]) -> bool | None:
        try:
            await service.apply_template(msgs, None, True, None, None)
        except ChatTemplateError:
            return True
        except ActordError:
            return None
        return False

    plain = await refuses([m("system", "a"), m("user", "b"), m("assistant", "c"), m("user", "d")])
    if plain is not False:
        return Folds()
    systems = (await refuses([m("system", "a"), m("system", "b"), m("user", "c")])
               or await refuses([m("system", "a"), m("user", "b"), m("assistant", "c"), m("system", "d"),
                                 m("user", "e")]))
    run = await refuses([m("user", "a"), m("user", "b")])
    return Folds(systems=bool(systems), runs=bool(run))


def fold(messages: list[ChatMessage], folds: Folds, degraded: Degraded) -> list[ChatMessage]:
    """The conversation folded as the template needs (`Folds`), each fold noted."""
    if folds.systems:
        n = stray_systems(messages)
        if n:
            degraded.add(f"messages: {n} system message(s) merged into the first (the template takes one, first)")
            messages = merge_systems(messages)
    if folds.runs:
        n = runs(messages)
        if n:
            degraded.add(f"messages: {n} message(s) merged into the one before, of the same role "
                         "(the template takes alternating roles)")
            messages = merge_runs(messages)
    return messages


async def fold_for(front: Any, messages: list[ChatMessage], degraded: Degraded) -> list[ChatMessage]:
    """`fold` under what the front's template refuses; a conversation with nothing to fold
    probes nothing."""
    if not (stray_systems(messages) or runs(messages)):
        return messages
    return fold(messages, await front.template_folds(), degraded)

"""A conversation folded into the shape a strict chat template takes.

Why: agents send what hosted models take: Claude Code a `system` message in the middle of
its messages, Codex CLI two developer items and two user items in a row. Templates written
for a chat of alternating turns (Gemma 3's, Llama 2's, Mistral's) refuse that with
`raise_exception`, and the client gets a 400 for a conversation any hosted API answers.
llama-server's chat handling folds what a template cannot take (its template polyfills move
a system message where the template wants it); these functions do the same, and only where
the template refuses the shape (the HTTP front probes it once: actord/frontends/http/degraded.py),
so a template that takes a mid-conversation system message still gets it where it was.

- `merge_systems`: every system message, wherever it is, joins one leading system message,
  in order, blank-line separated (what the model reads first is what came first).
- `merge_runs`: consecutive messages of one role (user after user, an assistant's text
  after its own text) become one, blank-line separated; an assistant's calls are kept, in
  order; tool results stay apart (each answers its own call).

Both are pure and return the input list itself when there is nothing to fold, so a
conversation that needs nothing keeps its message objects (and the prompter's keys).
"""

from __future__ import annotations

import msgspec

from actord.chat.messages import ChatMessage

SEP = "\n\n"


def merge_systems(messages: list[ChatMessage]) -> list[ChatMessage]:
    """One leading system message holding every system message's text (see above)."""
    at = [i for i, m in enumerate(messages) if m.role == "system"]
    if not at or at == [0]:
        return messages
    text = SEP.join(messages[i].content for i in at if messages[i].content)
    rest = [m for m in messages if m.role != "system"]
    return [ChatMessage(role="system", content=text), *rest]


def merge_runs(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Consecutive messages of one role as one (see above)."""
    out: list[ChatMessage] = []
    for m in messages:
        last = out[-1] if out else None
        if last is None or last.role != m.role or m.role == "tool" or last.tool_calls:
            out.append(m)
            continue
        content = SEP.join(t for t in (last.content, m.content) if t)
        thought = [t for t in (last.reasoning_content, m.reasoning_content) if t]
        out[-1] = msgspec.structs.replace(last, content=content, tool_calls=m.tool_calls,
                                          reasoning_content=SEP.join(thought) if thought else last.reasoning_content)
    return out if len(out) != len(messages) else messages


def runs(messages: list[ChatMessage]) -> int:
    """How many messages follow one of their own role (what `merge_runs` would fold)."""
    return sum(1 for a, b in zip(messages, messages[1:])
               if a.role == b.role and a.role != "tool" and not a.tool_calls)


def stray_systems(messages: list[ChatMessage]) -> int:
    """How many system messages are not the leading one (what `merge_systems` would move)."""
    return sum(1 for i, m in enumerate(messages) if m.role == "system" and i > 0)

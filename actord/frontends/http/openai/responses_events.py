"""The Responses API's answer shapes: a turn's output items and usage, and its streaming
events (`Events`), which add up to the same output as the whole answer.

Why a module of its own: the route (responses_api.py) reads requests and runs turns; these
shape what comes back, and are tested without a server (tests/frontends/test_client_shapes.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from actord.chat.messages import ChatMessage
from actord.frontends.http.openai import responses_extras as X
from actord.frontends.http.openai.answers import new_id

_enc = msgspec.json.Encoder()

def _usage(c: Any) -> dict[str, Any]:
    n_out = len(c.tokens)
    return {"input_tokens": c.n_prompt_tokens,
            "input_tokens_details": {"cached_tokens": c.n_cached, "cache_write_tokens": 0},
            "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.n_prompt_tokens + n_out}


class Events:
    """The Responses streaming events of one answer (SSE bytes), and the output items they
    add up to (the final body's `output`, ids included)."""

    def __init__(self, base: dict[str, Any], sealed: bool = False) -> None:
        self.base = base
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._msg: dict[str, Any] | None = None  # the message item open for text
        self._started = False
        self.sealed = sealed  # include asked for the opaque reasoning item (responses_extras.py)
        self._thought: tuple[dict[str, Any], list[str]] | None = None  # the reasoning item open, its text

    def _ev(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _enc.encode(body) + b"\n\n"

    def _lead(self) -> bytes:
        """response.created and response.in_progress, before the first other event."""
        if self._started:
            return b""
        self._started = True
        return self._ev("response.created", response=self.base) + self._ev("response.in_progress", response=self.base)

    def progress(self, p: dict[str, Any], timings: dict[str, Any] | None) -> bytes:
        return self._lead() + self._ev("response.in_progress", response=self.base, prompt_progress=p,
                                       **({"timings": timings} if timings else {}))

    def thought(self, delta: str) -> bytes:
        """A reasoning delta: the reasoning item opened on the first, closed (opaque) when the
        text, a call or the end comes; without `sealed`, nothing."""
        if not self.sealed:
            return b""
        out = self._lead()
        if self._thought is None:
            item = X.reasoning_item(new_id("rs", "_"), "", False)
            self._thought = (item, [])
            self.output.append(item)
            out += self._ev("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
        self._thought[1].append(delta)
        return out

    def _close_thought(self) -> bytes:
        if self._thought is None:
            return b""
        (item, parts), self._thought = self._thought, None
        item.update(X.reasoning_item(item["id"], "".join(parts), True))
        return self._ev("response.output_item.done", output_index=self.output.index(item), item=item)

    def text(self, delta: str, timings: dict[str, Any] | None = None) -> bytes:
        out = self._lead() + self._close_thought()
        if self._msg is None:
            self._msg = {"type": "message", "id": new_id("msg", "_"), "status": "in_progress", "role": "assistant",
                         "content": []}
            i = len(self.output)
            self.output.append(self._msg)
            out += self._ev("response.output_item.added", output_index=i, item=self._msg)
            out += self._ev("response.content_part.added", item_id=self._msg["id"], output_index=i, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []})
            self._msg["content"] = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
        part = self._msg["content"][0]
        part["text"] += delta
        return out + self._ev("response.output_text.delta", item_id=self._msg["id"],
                              output_index=self.output.index(self._msg), content_index=0, delta=delta, logprobs=[],
                              **({"timings": timings} if timings else {}))

    def _close_text(self, status: str) -> bytes:
        if self._msg is None:
            return b""
        m, self._msg = self._msg, None
        m["status"] = status
        i = self.output.index(m)
        part = m["content"][0]
        return (self._ev("response.output_text.done", item_id=m["id"], output_index=i, content_index=0,
                         text=part["text"], logprobs=[])
                + self._ev("response.content_part.done", item_id=m["id"], output_index=i, content_index=0,
                           part={"type": "output_text", "text": part["text"], "annotations": []})
                + self._ev("response.output_item.done", output_index=i, item=m))

    def call(self, c: Any) -> bytes:
        out = self._lead() + self._close_thought() + self._close_text("completed")
        item = {"type": "function_call", "id": new_id("fc", "_"), "call_id": c.id, "name": c.name,
                "arguments": "", "status": "in_progress"}
        i = len(self.output)
        self.output.append(item)
        out += self._ev("response.output_item.added", output_index=i, item=dict(item))
        out += self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                        delta=c.arguments)
        item["arguments"], item["status"] = c.arguments, "completed"
        out += self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                        arguments=c.arguments)
        return out + self._ev("response.output_item.done", output_index=i, item=item)

    def finish(self, body: dict[str, Any], timings: dict[str, Any] | None = None) -> bytes:
        """The last events; `body` is the final response, whose `output` is `self.output`."""
        incomplete = body["status"] == "incomplete"
        out = self._lead() + self._close_thought()
        if not any(item["type"] != "reasoning" for item in self.output):  # no text and no call: an empty message, as the whole answer has
            out += self.text("")
        out += self._close_text("incomplete" if incomplete else "completed")
        return out + self._ev("response.incomplete" if incomplete else "response.completed", response=body,
                              **({"timings": timings} if timings else {}))

    def error(self, status: int, message: str, code: str, param: str | None) -> bytes:
        return self._ev("error", code=code, message=message, param=param)


def output_items(msg: ChatMessage, incomplete: bool, sealed: bool = False) -> list[dict[str, Any]]:
    """A whole answer's `output`: its thought as an opaque reasoning item (`sealed`: include
    asked for it), its text as a message item, then one item per call."""
    items: list[dict[str, Any]] = []
    if sealed and msg.reasoning_content:
        items.append(X.reasoning_item(new_id("rs", "_"), msg.reasoning_content, True))
    if msg.content or not msg.tool_calls:
        items.append({"type": "message", "id": new_id("msg", "_"), "status": "incomplete" if incomplete else "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": msg.content, "annotations": [], "logprobs": []}]})
    for c in msg.tool_calls or []:
        items.append({"type": "function_call", "id": new_id("fc", "_"), "call_id": c.id, "name": c.name,
                      "arguments": c.arguments, "status": "completed"})
    return items

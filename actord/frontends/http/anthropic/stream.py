"""Anthropic's framing of a chat turn (`streaming.Answer`): the whole `message`, or the
streamed events, and its errors.

Why a module of its own: the events are a small state machine (which block is open, at
which index) that the routes need not see. A stream is `event:` + `data:` lines, no `[DONE]`:
message_start (the prompt's usage, from the turn's first chunk: TokenChunk's n_prompt and
n_cached), then content blocks in order, each content_block_start, its deltas
(thinking_delta then a signature_delta, text_delta, input_json_delta), content_block_stop;
then message_delta (stop_reason, stop_sequence, the whole usage) and message_stop. A block
closes when the next opens, as Anthropic's do; a tool call arrives whole (actord's calls are
parsed whole: actord.chat.tool_output), so its block opens, gets its arguments in one
input_json_delta and closes at once. A reply with no block at all gets one empty text block,
so whole and streamed answers have the same blocks. An error once the stream has started is
Anthropic's `error` event; before it, an HTTP status with Anthropic's error object
(streaming.Generation decides which).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import msgspec

from actord.frontends.http.anthropic import wire as W
from actord.frontends.http.responses import HttpError, json_response, status_of
from actord.vocabulary.errors import ActordError

_enc = msgspec.json.Encoder()


def error_object(e: HttpError | ActordError) -> tuple[int, dict[str, Any]]:
    """Anthropic's error object for `e` and its status (every API's: `status_of`)."""
    status = status_of(e)
    return status, W.error_body(status, W.error_message(e, e.message))


def error_response(e: HttpError | ActordError) -> Any:
    status, body = error_object(e)
    return json_response(body, status)


class Events:
    """The SSE bytes of one streamed message, block by block."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base  # the message_start's message, less its usage
        self.started = False
        self.index = -1  # the last block opened
        self.open: str | None = None  # its type while it is open

    @staticmethod
    def _ev(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + _enc.encode({"type": kind, **fields}) + b"\n\n"

    def lead(self, usage: dict[str, int]) -> bytes:
        """message_start, before any other event (once)."""
        if self.started:
            return b""
        self.started = True
        return self._ev("message_start", message={**self.base, "usage": usage})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":  # Anthropic's clients expect a signature before the block ends
            out = self._ev("content_block_delta", index=self.index, delta={"type": "signature_delta", "signature": ""})
        self.open = None
        return out + self._ev("content_block_stop", index=self.index)

    def _start(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + self._ev("content_block_start", index=self.index, content_block=block)

    def thinking(self, delta: str) -> bytes:
        out = b"" if self.open == "thinking" else self._start("thinking", {"type": "thinking", "thinking": ""})
        return out + self._ev("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": delta})

    def text(self, delta: str) -> bytes:
        out = b"" if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        if not delta:
            return out
        return out + self._ev("content_block_delta", index=self.index, delta={"type": "text_delta", "text": delta})

    def call(self, c: Any) -> bytes:
        out = self._start("tool_use", {"type": "tool_use", "id": c.id, "name": c.name, "input": {}})
        out += self._ev("content_block_delta", index=self.index,
                        delta={"type": "input_json_delta", "partial_json": c.arguments})
        return out + self._close()

    def finish(self, body: dict[str, Any]) -> bytes:
        """The last events; `body` is the whole message (its usage and stop)."""
        out = self.lead({**body["usage"], "output_tokens": 0})
        if self.index < 0:
            out += self.text("")
        out += self._close()
        out += self._ev("message_delta", delta={"stop_reason": body["stop_reason"],
                                                 "stop_sequence": body["stop_sequence"]}, usage=body["usage"])
        return out + self._ev("message_stop")

    def error(self, body: dict[str, Any]) -> bytes:
        return b"event: error\ndata: " + _enc.encode(body) + b"\n\n"


class AnthropicAnswer:
    """A turn as Anthropic's Messages API answers it (see the module docstring). `run(on_token)`
    runs the turn (a ChatResult); `stop_word(result)` names the stop sequence that ended it."""

    done = b""
    error_object = staticmethod(error_object)

    def __init__(self, run: Callable[[Any], Awaitable[Any]], stop_word: Callable[[Any], Awaitable[str]],
                 rid: str, model: str) -> None:
        self.run, self.stop_word, self.rid, self.model = run, stop_word, rid, model
        self.events = Events({"id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                              "stop_reason": None, "stop_sequence": None})

    async def _body(self, result: Any) -> dict[str, Any]:
        return W.from_result(self.rid, self.model, result, await self.stop_word(result))

    async def whole(self) -> Any:
        return await self._body(await self.run(None))

    async def streamed(self, on_token: Any) -> list[Any]:
        return [self.events.finish(await self._body(await self.run(on_token)))]

    def first(self) -> Any | None:
        return None  # message_start leads the first chunk's events (it reads the prompt's usage there)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        ev = self.events
        out = ev.lead(W.usage(None, chunk.get("n_prompt"), chunk.get("n_cached")))
        if chunk.get("reasoning"):
            out += ev.thinking(chunk["reasoning"])
        if chunk.get("content"):
            out += ev.text(chunk["content"])
        for made in chunk.get("calls") or []:  # actord.chat.stream.CallMade: the call, whole
            out += ev.call(made.call)
        return out  # b"": nothing to send (message_start went, and the chunk held no text)

    def error_event(self, e: HttpError | ActordError) -> bytes:
        return self.events.error(error_object(e)[1])

"""A generation inside an HTTP response, for both fronts that generate: OpenAI's
(/v1/chat/completions, /v1/completions) and llama-server's native /completion.

Driven as an ASGI app is driven (a `receive` that reports `http.disconnect`, a `send` that
records), with a fake run in place of the system, so what is pinned here is the wire: when
the headers go, how an error is answered before and after the first chunk, how a stream
ends, what a client that goes away cancels and how it is counted. No server, no model, no
time: every wait is on an event.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from actord.vocabulary.types import CompletionResult, Timings
from actord.vocabulary.errors import InvalidParams, PromptTooLong

KINDS = ["chat", "text", "native"]


class FakeFront:
    fingerprint = "fp_test"

    def __init__(self) -> None:
        self.gone: list[tuple[str, dict]] = []

    def client_gone(self, phase: str, **fields: Any) -> None:
        self.gone.append((phase, fields))


def _result(content: str = "ab", tokens: tuple[int, ...] = (5, 6)) -> CompletionResult:
    return CompletionResult(content=content, tokens=list(tokens), n_prompt_tokens=3, n_prompt_processed=3,
                            n_cached=0, slot=1, stop_reason="length", timings=Timings(1.0, 2.0, 3.0, 4.0))


def _answer(kind: str, front: FakeFront, run: Any, *, stream: bool, include_usage: bool = False) -> Any:
    """The response a route hands Starlette, for one kind of front."""
    if kind == "native":
        from actord.frontends.http.native.completion import NativeAnswer

        async def finish(i: int, k: int, r: CompletionResult) -> dict:
            return {"index": i, "content": "" if stream else r.content, "stop": True, "tokens_predicted": len(r.tokens)}

        async def job(on_token: Any) -> list[CompletionResult]:  # one prompt's n_cmpl results: one
            return [await run(on_token)]

        return NativeAnswer.response(front, [job], finish, stream=stream)
    from actord.frontends.http.openai.routes import OpenAIAnswer

    return OpenAIAnswer.response(front, run, chat=kind == "chat", model="m", stream=stream,
                                 include_usage=include_usage)


class Wire:
    """One ASGI exchange: what was sent, and a client that hangs up when told to (or, as
    uvicorn reports it, once the answer is complete)."""

    def __init__(self, hang_up_after_bodies: int | None = None) -> None:
        self.sent: list[dict] = []
        self.hang_up_after = hang_up_after_bodies
        self.gone = anyio.Event()

    def hang_up(self) -> None:
        self.gone.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, msg: dict) -> None:
        self.sent.append(msg)
        if msg["type"] == "http.response.body":
            n = sum(1 for m in self.sent if m["type"] == "http.response.body")
            if not msg.get("more_body", False) or (self.hang_up_after is not None and n >= self.hang_up_after):
                self.gone.set()

    async def drive(self, response: Any) -> None:
        await response({"type": "http", "method": "POST", "path": "/", "headers": []}, self.receive, self.send)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(next(m["headers"] for m in self.sent if m["type"] == "http.response.start"))

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    def events(self) -> list[Any]:
        """The SSE `data:` payloads, `[DONE]` as the string."""
        out = []
        for block in self.body.decode().split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                payload = block[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
        return out

    def ended(self) -> bool:
        last = [m for m in self.sent if m["type"] == "http.response.body"][-1]
        return last.get("more_body", False) is False


def _tokens(on_token: Any, pieces: list[tuple[str, int]]) -> None:
    for text, tok in pieces:
        on_token({"slot": 1, "content": text, "tokens": [tok]})


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_answer_is_one_json_body_and_not_a_client_gone(kind):
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        assert on_token is None
        return _result()

    anyio.run(wire.drive, _answer(kind, front, run, stream=False))
    assert wire.status == 200 and wire.headers[b"content-type"] == b"application/json"
    body = json.loads(wire.body)
    if kind == "native":
        assert body == {"index": 0, "content": "ab", "stop": True, "tokens_predicted": 2}
    elif kind == "chat":
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "ab"
        assert body["system_fingerprint"] == "fp_test" and body["model"] == "m"
    else:
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == "ab"
    assert front.gone == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_sends_its_chunks_and_ends_as_its_api_does(kind):
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        _tokens(on_token, [("a", 5)])
        await anyio.lowlevel.checkpoint()  # the writer sends "a" before "b" is made
        _tokens(on_token, [("b", 6)])
        return _result()

    anyio.run(wire.drive, _answer(kind, front, run, stream=True, include_usage=True))
    assert wire.status == 200 and wire.headers[b"content-type"] == b"text/event-stream"
    assert wire.headers[b"cache-control"] == b"no-cache" and wire.headers[b"x-accel-buffering"] == b"no"
    events = wire.events()
    assert wire.ended() and front.gone == []
    if kind == "native":  # llama-server: partial chunks, then the whole result; no [DONE]
        assert events == [
            {"index": 0, "content": "a", "tokens": [5], "stop": False, "id_slot": 1, "tokens_predicted": 1},
            {"index": 0, "content": "b", "tokens": [6], "stop": False, "id_slot": 1, "tokens_predicted": 2},
            {"index": 0, "content": "", "stop": True, "tokens_predicted": 2}]
        assert wire.sent[-1]["body"].endswith(b'"tokens_predicted":2}\n\n')  # the last events end it
        return
    assert events[-1] == "[DONE]" and wire.sent[-1]["body"].endswith(b"data: [DONE]\n\n")
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1 and {c["system_fingerprint"] for c in chunks} == {"fp_test"}
    if kind == "chat":  # the role comes first, alone
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
        assert [c["choices"][0]["delta"].get("content") for c in chunks[:2]] == ["a", "b"]
    else:
        assert [c["choices"][0]["text"] for c in chunks[:2]] == ["a", "b"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"]["completion_tokens"] == 2
    assert len(chunks) == 4


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_error_before_the_first_chunk_is_an_http_status(kind, stream):
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        raise PromptTooLong("prompt of 5000 tokens does not fit n_ctx 4096", n_prompt_tokens=5000, n_ctx=4096)

    anyio.run(wire.drive, _answer(kind, front, run, stream=stream))
    assert wire.status == 400 and wire.headers[b"content-type"] == b"application/json"
    err = json.loads(wire.body)["error"]
    if kind == "native":
        assert err["code"] == 400 and err["type"] == "exceed_context_size_error" and err["n_ctx"] == 4096
        assert err["actord"]["type"] == "PromptTooLong"
    else:
        assert err["code"] == "context_length_exceeded" and "maximum context length is 4096" in err["message"]
    assert front.gone == []


@pytest.mark.parametrize("kind", KINDS)
def test_an_error_after_the_first_chunk_is_an_sse_error_event(kind):
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        _tokens(on_token, [("a", 5)])
        await anyio.lowlevel.checkpoint()  # the first chunk goes out (the status with it) before the error
        raise InvalidParams("the grammar left no token", param="grammar")

    anyio.run(wire.drive, _answer(kind, front, run, stream=True))
    assert wire.status == 200 and wire.ended() and front.gone == []
    events = wire.events()
    if kind == "native":
        assert events[0]["content"] == "a"
        err = events[-1]["error"]
        assert err["code"] == 400 and err["actord"]["param"] == "grammar" and len(events) == 2
    else:
        assert events[-1] == "[DONE]"  # the stream still ends as OpenAI's do
        err = events[-2]["error"]
        assert err["param"] == "grammar" and err["code"] == "InvalidParams" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bug_in_the_run_is_a_500_internal_error_not_a_crash(kind, stream):
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        raise ZeroDivisionError("a bug")

    anyio.run(wire.drive, _answer(kind, front, run, stream=stream))
    assert wire.status == 500
    err = json.loads(wire.body)["error"]
    assert "internal error: ZeroDivisionError" in err["message"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_cancels_the_run_and_is_counted_once(kind, stream):
    front = FakeFront()
    wire = Wire(hang_up_after_bodies=1 if stream else None)
    cancelled = []

    async def run(on_token: Any) -> CompletionResult:
        if stream:
            _tokens(on_token, [("a", 5)])
        else:
            wire.hang_up()
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise
        raise AssertionError("not reached")

    anyio.run(wire.drive, _answer(kind, front, run, stream=stream))
    assert cancelled == [True]
    assert front.gone == [("generation", {"stream": stream})]
    if stream:  # what was sent stays sent; nothing ends the stream: the client is gone
        assert wire.status == 200 and not wire.ended()
    else:
        assert wire.sent == []  # nobody to answer


@pytest.mark.parametrize("kind", KINDS)
def test_a_client_too_slow_to_drain_its_chunks_has_its_generation_ended_and_is_told(kind):
    from actord.frontends.http import streaming

    front, wire = FakeFront(), Wire()
    cancelled = []

    async def run(on_token: Any) -> CompletionResult:
        _tokens(on_token, [("x", 7)] * (streaming.OUTBOX + 1))  # more than the queue holds, unread
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise
        raise AssertionError("not reached")

    anyio.run(wire.drive, _answer(kind, front, run, stream=True))
    assert cancelled == [True] and front.gone == []
    last = wire.sent[-1]  # what was queued, then the reason, and the stream's end
    assert last["type"] == "http.response.body" and not last.get("more_body", False)
    assert b"client_too_slow" in b"".join(m.get("body", b"") for m in wire.sent)


@pytest.mark.parametrize("kind", KINDS)
def test_chunks_are_encoded_by_the_response_and_what_queued_goes_out_in_one_write(kind, monkeypatch):
    from actord.frontends.http import streaming

    encoded_in_sink = []
    real_sse = streaming.sse
    in_sink = [False]

    def sse(obj: Any) -> bytes:
        encoded_in_sink.append(in_sink[0])
        return real_sse(obj)

    monkeypatch.setattr(streaming, "sse", sse)
    front, wire = FakeFront(), Wire()

    async def run(on_token: Any) -> CompletionResult:
        def sink(chunk: Any) -> None:
            in_sink[0] = True
            on_token(chunk)
            in_sink[0] = False

        _tokens(sink, [("x", 7)] * 5000)  # all queued before the response's task runs
        return _result("x" * 5000, (7,) * 5000)

    anyio.run(wire.drive, _answer(kind, front, run, stream=True))
    bodies = [m for m in wire.sent if m["type"] == "http.response.body"]
    assert len(bodies) <= 2 and wire.ended()  # the 5000 chunks in one write; the last events and the end
    assert bodies[0]["body"].count(b"data: ") >= 5000
    assert encoded_in_sink and not any(encoded_in_sink)  # none in the sink: all in the response

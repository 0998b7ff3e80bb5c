"""One generation inside one HTTP response, for every route that generates.

Why it exists: OpenAI's routes (/v1/chat/completions, /v1/completions) and llama-server's
native /completion frame their answers differently (OpenAI's chunks end with `data:
[DONE]`; llama-server's end with the whole result and no `[DONE]`), but what happens around
the answer is the same, and subtle enough to be written once:

- The generation runs inside the response, where the ASGI `receive` channel is at hand: a
  watcher awaits `http.disconnect` beside the work, and a client that goes away cancels
  the work (which the system turns into a slot CancelRequest), streamed or not, and is
  logged and counted once (`front.client_gone("generation", stream=...)`).
- A whole answer is one JSON body, or an error object with the error's status.
- A streamed answer sends its headers only when its first chunk (or its error) is ready,
  so an error found while the prompt is placed or decoded (400 for a prompt over the
  context, 503 overloaded) still arrives as an HTTP status with the API's error object;
  one found later is an SSE `data:` event holding that object, and the stream then ends
  as it always does.
- Chunks are encoded where they are sent, not where they are made: `on_token` runs inside
  a slot's turn, so it only shapes the API's event (`Answer.chunk`: an answer may keep
  state across chunks that its last events read, so shaping stays in order, there) and
  queues it in a bounded memory stream (OUTBOX events). The response's own task takes
  what is queued, frames each event and sends them in one write (one `b"".join`: the
  copying is linear in what is sent, however many events waited). A client too slow to
  drain the queue is cut off, as on the socket. So is a stream whose client takes
  nothing (the response waits in `send`: its transport holds what was sent) while
  `http_stream_ahead_chunks` more chunks come, and one whose address or key holds its
  share of queued chunks (frontends/shares.py): its generation is cancelled, which frees its slot,
  and the stream ends with a `client_too_slow` error event after what was queued. Before,
  a never-reading stream generated on into its outbox (8,192 chunks) and held its slot
  and engine time for its whole n_predict. (The Responses API's answer still frames
  its events as it shapes them, in `Answer.chunk`: those are encoded in the sink.)
- The http.disconnect uvicorn reports once a response is complete is the end of an answer,
  not a client that went away.
- A bug in one request (an exception that is not a typed error) is logged and answered
  500 `internal_error`; it never takes its peers down.
- One client address has at most `http_max_generations_per_peer` generations in flight
  (running or queued for a slot), and with several API keys one key at most
  `http_max_generations_per_key`; past that, a generation waits its turn in the front's
  line (at most `http_max_waiting_per_peer` of the address's or key's), and one more is
  answered 429 in the API's shape (frontends/shares.py). The count is taken from the request head
  by its route's guard (app.py `HttpFront.guard`), handed to the Generation as its
  `ticket` and released when the answer ends.

What differs between the APIs is an `Answer`: how the whole body, a chunk, the final
events and an error are shaped, and what ends a stream. An event is a JSON object sent as
`data: JSON`, or bytes the answer framed itself, sent as they are (b"": nothing): the
Responses API (`openai/responses_api.py`) names each event (`event:` lines), a chunk may be several
of its events or none, and its stream's error is its own `error` event (`error_event`).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Protocol, TypeVar

import anyio
import msgspec
from starlette.responses import Response

from actord.vocabulary.errors import ActordError
from actord.frontends.http.bounds import KEY
from actord.frontends.http.responses import HttpError, for_client, json_response
from actord.frontends.shares import Ticket, peer_of
from actord.vocabulary.log import get

log = get("actord.frontends.http")

OUTBOX = 8192  # queued chunks per streamed answer before the client counts as too slow
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
DONE = b"data: [DONE]\n\n"  # OpenAI's end of a stream
_enc = msgspec.json.Encoder()
T = TypeVar("T")


def sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def frame(event: Any) -> bytes:
    """An Answer's event on the wire: bytes as the answer framed them, else `data: JSON`."""
    return event if isinstance(event, bytes) else sse(event)


async def until_disconnect(receive: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def guarded(run: Callable[[], Awaitable[T]]) -> T:
    """`run()`, with any exception but a typed error turned into a logged 500."""
    try:
        return await run()
    except (ActordError, HttpError):
        raise
    except Exception as e:  # a bug in one request must not take down its peers
        log.exception("http.internal_error", error=repr(e))
        raise HttpError(500, f"internal error: {type(e).__name__}", "internal_error") from None


OnToken = Callable[[dict[str, Any]], None]


class Answer(Protocol):
    """What one API makes of a generation (see the module docstring)."""

    done: bytes  # written last in a stream that ended (b"": nothing more)

    def error_object(self, e: HttpError | ActordError) -> tuple[int, dict[str, Any]]:
        """The API's error object for `e`, and its HTTP status."""

    async def whole(self) -> Any:
        """Run to the end; the answer's JSON body."""

    async def streamed(self, on_token: OnToken) -> list[Any]:
        """Run to the end, each chunk to `on_token`; the events that end the stream."""

    def first(self) -> Any | None:
        """An event sent with the headers, before any chunk (None: none)."""

    def chunk(self, chunk: dict[str, Any]) -> Any:
        """The event for one chunk of generated text (the system's stream chunk)."""

    # Optional: `error_event(e) -> bytes`, a stream's error event once it has started
    # (without it: `data:` and the error object).


class Generation(Response):
    """Runs one generation in the response, so a disconnect can cancel it."""

    def __init__(self, front: Any, answer: Answer, *, stream: bool,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.front, self.answer, self.stream = front, answer, stream
        self.extra = headers or []  # on the answer, not on an error (degraded.py's X-Actord-Degraded)
        self.background = None
        # Its client's share, taken at its head by its route's guard (app.py `guard`, which
        # every route that answers with a Generation is behind with `generates`); None: a
        # front that counts none (a test's).
        self.ticket: Ticket | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self._run(scope, receive, send)
        finally:
            if self.ticket is not None:
                self.ticket.release()

    async def _run(self, scope: Any, receive: Any, send: Any) -> None:
        if self.stream:
            await self._streamed(scope, receive, send)
        else:
            await self._whole(scope, receive, send)

    def _error(self, e: HttpError | ActordError) -> Response:
        status, body = self.answer.error_object(for_client(e))
        return json_response(body, status)

    def _error_event(self, e: HttpError | ActordError) -> bytes:
        e = for_client(e)
        own = getattr(self.answer, "error_event", None)
        return own(e) if own is not None else sse(self.answer.error_object(e)[1])

    async def _whole(self, scope: Any, receive: Any, send: Any) -> None:
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            async def work() -> None:
                try:
                    outcome["result"] = await guarded(self.answer.whole)
                except (ActordError, HttpError) as e:
                    outcome["error"] = e
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            await until_disconnect(receive)
            if not outcome:  # the work was still running: the client is gone
                self.front.client_gone("generation", stream=False)
            tg.cancel_scope.cancel()
        if "error" in outcome:
            response = self._error(outcome["error"])
        elif "result" in outcome:
            response = json_response(outcome["result"])
            response.raw_headers.extend(self.extra)
        else:
            return  # the client went away: nothing to answer
        await response(scope, receive, send)

    def _framed(self, event: Any) -> bytes:
        return self._error_event(event.error) if isinstance(event, _Failed) else frame(event)

    async def _streamed(self, scope: Any, receive: Any, send: Any) -> None:
        answer = self.answer
        tx, rx = anyio.create_memory_object_stream[Any](OUTBOX)  # events, a _Failed last
        # Set before the answer's last write: from then on, the http.disconnect that
        # uvicorn reports once a response is complete is the end of a stream, not a client
        # that went away.
        finished = False
        shares = getattr(self.front, "shares", None)
        peer = peer_of(scope)
        key = scope.get(KEY)
        ahead = getattr(self.front, "stream_ahead", OUTBOX)
        queued = 0  # chunks on_token queued that the sender has not taken yet
        sending = False  # the sender waits in `send`: its transport holds what the client has not read
        cut: list[str] = []  # why the stream's generation was ended for its client (at most one)
        work_scope = anyio.CancelScope()

        async with anyio.create_task_group() as tg:
            def stop(why: str) -> None:
                if not cut:
                    cut.append(why)
                    log.info("http.client_too_slow", reason=why, client=peer)
                    refused = getattr(self.front, "refused", None)
                    if refused is not None:
                        refused("stream_output")
                work_scope.cancel()  # the generation ends (its slot free); the stream ends after what is queued

            def on_token(chunk: dict[str, Any]) -> None:  # in a slot's turn: shape and queue, no more
                nonlocal queued
                event = answer.chunk(chunk)
                if (isinstance(event, bytes) and not event) or cut:  # no event for this chunk, or cut already
                    return
                if sending and queued >= ahead:
                    stop(f"the client took nothing while its stream ran {ahead} chunks ahead "
                         "(http_stream_ahead_chunks)")
                    return
                if shares is not None and not shares.queue(peer, key):
                    stop("this client's streams hold the most output they may have waiting "
                         "(http_max_queued_chunks_per_peer, http_max_queued_chunks_per_key)")
                    return
                try:
                    tx.send_nowait(event)
                    queued += 1
                    return
                except anyio.WouldBlock:
                    stop(f"the client left {OUTBOX} chunks unread")
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass
                if shares is not None:
                    shares.taken(peer, key, 1)

            async def work() -> None:
                async with tx:
                    with work_scope:
                        try:
                            final = await guarded(lambda: answer.streamed(on_token))
                        except (ActordError, HttpError) as e:
                            await tx.send(_Failed(e))
                            return
                        for event in final:
                            await tx.send(event)

            async def watch() -> None:
                await until_disconnect(receive)
                if not finished:
                    self.front.client_gone("generation", stream=True)
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            tg.start_soon(watch)
            started = False
            try:
                async with rx:
                    while not finished:
                        events, ended = await _available(rx)
                        took = min(queued, len(events))  # on_token's chunks come first: finals follow them
                        queued -= took
                        if shares is not None:
                            shares.taken(peer, key, took)
                        if ended and cut:  # the client did not keep up: the stream says so as it ends
                            events.append(_Failed(HttpError(429, cut[0], "client_too_slow")))
                        if not started:
                            if not events:
                                break  # nothing was ever queued: nothing to answer
                            if isinstance(events[0], _Failed):  # before the first chunk: still an HTTP status
                                finished = True
                                await self._error(events[0].error)(scope, receive, send)
                                break
                            await send({"type": "http.response.start", "status": 200,
                                        "headers": SSE_HEADERS + self.extra})
                            started = True
                            first = answer.first()
                            if first is not None:
                                events.insert(0, first)
                        parts = [self._framed(e) for e in events]
                        if ended:
                            finished = True
                            parts.append(answer.done)
                        sending = True
                        try:
                            await send({"type": "http.response.body", "body": b"".join(parts), "more_body": not ended})
                        finally:
                            sending = False
            finally:
                if shares is not None:
                    shares.taken(peer, key, queued)  # what was queued and never taken
                    queued = 0
            tg.cancel_scope.cancel()


class _Failed:
    """A typed error in the event stream: its answer's error event (or, before the first
    chunk, its HTTP status)."""

    __slots__ = ("error",)

    def __init__(self, error: HttpError | ActordError) -> None:
        self.error = error


async def _available(rx: Any) -> tuple[list[Any], bool]:
    """What is queued (waiting for one event if none is), and whether the stream ended. A
    _Failed is the last event: work sends nothing after one."""
    try:
        events = [await rx.receive()]
    except anyio.EndOfStream:
        return [], True
    while True:
        try:
            events.append(rx.receive_nowait())
        except anyio.WouldBlock:
            return events, False
        except anyio.EndOfStream:
            return events, True

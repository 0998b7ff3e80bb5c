"""The OpenAI-compatible HTTP front: Starlette routes served by uvicorn in the daemon's loop.

Why Starlette + uvicorn: Starlette is a small ASGI toolkit (routing, requests, responses)
built on anyio, like the actor system, so the routes run in the same event loop as the
socket server and await the same `ActorSystem`; uvicorn is the most used ASGI server, and it
can be run as one coroutine inside a loop it did not create (`Server.serve(sockets=...)`),
which is what "same process, same event loop" needs. FastAPI would add pydantic and a
second validation layer beside msgspec; aiohttp brings its own loop conventions and no ASGI.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health,
GET /metrics (Prometheus text). With an API key every route but /health needs
`Authorization: Bearer KEY`.

A generation runs inside the response (`_Generation`), where the ASGI `receive` channel is
at hand: a watcher awaits `http.disconnect` beside the work, and a client that goes away
cancels the awaiting task, which the system turns into a slot CancelRequest (streaming or
not). A streamed answer sends its headers only when its first chunk (or its error) is
ready, so an error found while the prompt is placed or decoded (413 prompt too long, 503
overloaded) still arrives as an HTTP status with OpenAI's error object. A client too slow
to drain its bounded chunk queue is cut off, as on the socket.

The mind is named by the `X-Actord-Mind` header or the body's `user` field; the header
wins, because `user` has an OpenAI meaning of its own (an end-user id) that a client may set
for other reasons, while the header is an explicit instruction to actord. With neither,
a request is placed like llama-server's: the idle slot sharing the longest prefix.
"""

from __future__ import annotations

import contextlib
import hmac
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from actord.api import CompletionRequest
from actord.chat import ChatRequest
from actord.config import Config, http_address
from actord.errors import ActordError, InvalidParams, ModelNotFound
from actord.http import openai as O
from actord.log import get

log = get("actord.http")

OUTBOX = 8192  # queued chunks per streamed answer before the client counts as too slow
_enc = msgspec.json.Encoder()
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def error_response(e: HttpError | ActordError) -> Response:
    if isinstance(e, ActordError):
        status = O.error_status(e)
        return json_response(O.error_body(status, e.message, e.type, e.data.get("param")), status)
    return json_response(O.error_body(e.status, e.message, e.code, e.param), e.status)


def _sse(obj: Any) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def _until_disconnect(receive: Any) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


class _Generation(Response):
    """Runs one generation in the response, so a disconnect can cancel it."""

    def __init__(self, front: "HttpFront", run: Callable[[Any], Awaitable[Any]], *, chat: bool,
                 stream: bool, include_usage: bool) -> None:
        self.front, self.run, self.chat, self.stream = front, run, chat, stream
        self.include_usage = include_usage
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self.stream:
            await self._streamed(scope, receive, send)
        else:
            await self._whole(scope, receive, send)

    async def _run(self, on_token: Any) -> Any:
        try:
            return await self.run(on_token)
        except ActordError:
            raise
        except Exception as e:  # a bug in one request must not take down its peers
            log.exception("http.internal_error", error=repr(e))
            raise HttpError(500, f"internal error: {type(e).__name__}", "internal_error") from None

    async def _whole(self, scope: Any, receive: Any, send: Any) -> None:
        outcome: dict[str, Any] = {}
        async with anyio.create_task_group() as tg:
            async def work() -> None:
                try:
                    outcome["result"] = await self._run(None)
                except (ActordError, HttpError) as e:
                    outcome["error"] = e
                finally:
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            await _until_disconnect(receive)
            self.front.disconnects += 1
            log.info("http.client_gone", stream=False)
            tg.cancel_scope.cancel()
        if "error" in outcome:
            response = error_response(outcome["error"])
        elif "result" in outcome:
            r = outcome["result"]
            created = int(time.time())
            body = (O.chat_completion(O.new_id("chatcmpl"), self.front.model_id, r, created) if self.chat
                    else O.text_completion(O.new_id("cmpl"), self.front.model_id, r, created))
            response = json_response(body)
        else:
            return  # the client went away: nothing to answer
        await response(scope, receive, send)

    async def _streamed(self, scope: Any, receive: Any, send: Any) -> None:
        chunks = O.Chunks(self.chat, self.front.model_id)
        tx, rx = anyio.create_memory_object_stream[tuple[str, Any]](OUTBOX)

        async with anyio.create_task_group() as tg:
            def on_token(chunk: dict[str, Any]) -> None:
                try:
                    tx.send_nowait(("data", _sse(chunks.delta(chunk["content"]))))
                except anyio.WouldBlock:
                    log.warning("http.client_too_slow")
                    tg.cancel_scope.cancel()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    pass

            async def work() -> None:
                async with tx:
                    try:
                        r = await self._run(on_token)
                    except (ActordError, HttpError) as e:
                        await tx.send(("error", e))
                        return
                    await tx.send(("data", _sse(chunks.last(r))))
                    if self.include_usage:
                        await tx.send(("data", _sse(chunks.usage(r))))

            async def watch() -> None:
                await _until_disconnect(receive)
                self.front.disconnects += 1
                log.info("http.client_gone", stream=True)
                tg.cancel_scope.cancel()

            tg.start_soon(work)
            tg.start_soon(watch)
            started = False
            async with rx:
                async for kind, payload in rx:
                    if not started:
                        if kind == "error":
                            await error_response(payload)(scope, receive, send)
                            break
                        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                        started = True
                        first = chunks.first()
                        if first is not None:
                            await send({"type": "http.response.body", "body": _sse(first), "more_body": True})
                    if kind == "error":
                        payload = _sse(msgspec.json.decode(error_response(payload).body))
                    else:  # coalesce what queued while the last write was under way: one write
                        while True:
                            try:
                                more_kind, more = rx.receive_nowait()
                            except (anyio.WouldBlock, anyio.EndOfStream):
                                break
                            if more_kind != "data":
                                payload += _sse(msgspec.json.decode(error_response(more).body))
                                break
                            payload += more
                    await send({"type": "http.response.body", "body": payload, "more_body": True})
                else:
                    if started:
                        await send({"type": "http.response.body", "body": _DONE, "more_body": False})
            tg.cancel_scope.cancel()


class HttpFront:
    def __init__(self, system: Any, config: Config) -> None:
        self.system = system
        self.config = config
        self.model_id = Path(config.model).stem
        self._model_names = {self.model_id, Path(config.model).name, config.model}
        self._key = config.api_key.encode() if config.api_key else None
        self.disconnects = 0
        self.address: str | None = None
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._guard(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/metrics", self._guard(self.metrics), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ])

    # -- plumbing ----------------------------------------------------------------------

    def _guard(self, endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            try:
                self._authorize(request)
                return await endpoint(request)
            except HttpError as e:
                return error_response(e)
            except ActordError as e:
                return error_response(e)
        return guarded

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise HttpError(401, "invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")

    async def _body(self, request: Request, typ: type) -> Any:
        limit = self.config.http_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                            "body_too_large")
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > limit:
                raise HttpError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
        try:
            return msgspec.json.decode(bytes(buf), type=typ)
        except msgspec.ValidationError as e:
            raise HttpError(400, f"invalid request: {e}", "invalid_params") from None
        except msgspec.DecodeError as e:
            raise HttpError(400, f"malformed JSON: {e}", "invalid_json") from None

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self._model_names:
            raise ModelNotFound(f"the model {model!r} does not exist; this daemon serves {self.model_id!r}",
                                param="model")

    @staticmethod
    def _mind(request: Request, user: str | None) -> str | None:
        return request.headers.get("x-actord-mind") or user or None

    # -- routes ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        req: O.ChatCompletionRequest = await self._body(request, O.ChatCompletionRequest)
        self._check_model(req.model)
        O.refuse_unsupported(req)
        if not req.messages:
            raise InvalidParams("messages is empty", param="messages")
        n = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        chat = ChatRequest(
            messages=O.chat_messages(req.messages),
            n_predict=n if n is not None else self.system.props.n_ctx,
            mind=self._mind(request, req.user),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
            stop=O.stops(req.stop), stream=req.stream, genes=req.genes,
        ).check()
        self._precheck(chat.mind, chat.n_predict, chat.temperature, chat.top_k, chat.top_p)

        async def run(on_token: Any) -> Any:
            return (await self.system.chat(chat, on_token=on_token)).completion

        return _Generation(self, run, chat=True, stream=req.stream,
                           include_usage=bool(req.stream_options and req.stream_options.include_usage))

    async def completions(self, request: Request) -> Response:
        req: O.TextCompletionRequest = await self._body(request, O.TextCompletionRequest)
        self._check_model(req.model)
        O.refuse_unsupported(req)
        comp = CompletionRequest(
            prompt=req.prompt, n_predict=req.max_tokens if req.max_tokens is not None else 16,
            mind=self._mind(request, req.user),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
            stop=O.stops(req.stop), stream=req.stream, genes=req.genes,
        ).check()

        async def run(on_token: Any) -> Any:
            return await self.system.complete(comp, on_token=on_token)

        return _Generation(self, run, chat=False, stream=req.stream,
                           include_usage=bool(req.stream_options and req.stream_options.include_usage))

    @staticmethod
    def _precheck(mind: str | None, n_predict: int, temperature: float, top_k: int, top_p: float) -> None:
        # The same checks a completion makes, before any rendering work.
        CompletionRequest(prompt=[0], n_predict=n_predict, mind=mind, temperature=temperature,
                          top_k=top_k, top_p=top_p).check()

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "actord"},
        ]})

    async def metrics(self, request: Request) -> Response:
        return Response(self.system.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def health(self, request: Request) -> Response:
        h = await self.system.health()
        return json_response(h, 200 if h["status"] == "ok" else 503)

    # -- serving -----------------------------------------------------------------------

    def bind(self) -> socket.socket:
        host, port = http_address(self.config.http or "127.0.0.1:0")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise InvalidParams(f"cannot listen on {self.config.http}: {e.strerror}", http=self.config.http) from None
        sock.listen(1024)
        sock.setblocking(False)
        bound = sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        return sock

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then shut down gracefully (close listeners, let answers end)."""
        import uvicorn

        class _InLoopServer(uvicorn.Server):
            # The daemon owns SIGINT/SIGTERM (anyio's signal receiver); uvicorn must not
            # replace those handlers, nor re-raise a signal when it stops.
            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        sock = self.bind()
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=5, server_header=False)
        server = _InLoopServer(config)
        try:
            async with anyio.create_task_group() as tg:
                ended = anyio.Event()

                async def run() -> None:
                    try:
                        with anyio.CancelScope(shield=True):  # stopped by should_exit, not by cancellation
                            await server.serve(sockets=[sock])
                    finally:
                        ended.set()

                tg.start_soon(run)
                while not server.started:
                    if ended.is_set():
                        raise InvalidParams(f"the HTTP front on {self.address} did not start")
                    await anyio.sleep(0.005)
                log.info("http.listening", address=self.address, api_key=self._key is not None)
                task_status.started(self.address)
                try:
                    await anyio.sleep_forever()
                finally:
                    server.should_exit = True
        finally:
            sock.close()

"""The OpenAI-compatible HTTP front: Starlette routes served by uvicorn in the daemon's loop.

Why Starlette + uvicorn: Starlette is a small ASGI toolkit (routing, requests, responses)
built on anyio, like the actor system, so the routes run in the same event loop as the
socket server and await the same `ActorSystem`; uvicorn is the most used ASGI server, and it
can be run as one coroutine inside a loop it did not create (`Server.serve(sockets=...)`),
which is what "same process, same event loop" needs. FastAPI would add pydantic and a
second validation layer beside msgspec; aiohttp brings its own loop conventions and no ASGI.
uvicorn runs its own protocol subclassed with the front's bounds (`bounds.py`: header
bytes and deadline, connections, peers), which it has no settings for.

Routes, as llama-server names them: POST /v1/chat/completions and /chat/completions, POST
/v1/completions, GET /v1/models and /models, GET /v1/models/{id} and /models/{id}; and
llama-server's native API with the seed's page and gene verbs (`native.py`: /completion,
/completions, /tokenize, /detokenize, /apply-template, /props, /slots, /lora-adapters,
/health and /v1/health, /metrics), whose errors are llama-server's error object.
With an API key every route but the health ones needs `Authorization: Bearer KEY`; without
one, only this uid (and --allow-uid/--allow-gid) is served (`bounds.py`). Every answer of
an OpenAI route that is not a 200 is OpenAI's error object, unknown routes included. A
request carrying an `Origin` header (a browser) is refused unless `--cors-origin` allows
that origin: a page on
any website could otherwise drive a loopback daemon through its user's browser, which runs
as the daemon's own uid.

A generation runs inside the response (`_Generation`), where the ASGI `receive` channel is
at hand: a watcher awaits `http.disconnect` beside the work, and a client that goes away
cancels the awaiting task, which the system turns into a slot CancelRequest (streaming or
not). A streamed answer sends its headers only when its first chunk (or its error) is
ready, so an error found while the prompt is placed or decoded (400
context_length_exceeded, 503 overloaded) still arrives as an HTTP status with OpenAI's error
object. A client too slow to drain its bounded chunk queue is cut off, as on the socket.

The mind is named by the `X-Actord-Mind` header (used as given: it must be a valid mind
name), else by `prompt_cache_key`, else by `user`, both free-form and mapped to a mind name
through a digest (`openai.mind_for`). The header wins, because it is an explicit
instruction to actord; `prompt_cache_key` beats `user` because it is OpenAI's field for
exactly this (cache routing), while `user` is an end-user id a client may set for other
reasons. With none, a request is placed like llama-server's: the idle slot sharing the
longest prefix.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import socket
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from actord.api import CompletionRequest
from actord.chat import ChatRequest
from actord.config import Config, http_address
from actord.errors import ActordError, InvalidParams, ModelNotFound
from actord.http import openai as O
from actord.http.bounds import Gate, bounded_protocol
from actord.log import get
from actord.rpc.peers import PeerPolicy, check_tcp_peers

log = get("actord.http")

OUTBOX = 8192  # queued chunks per streamed answer before the client counts as too slow
_enc = msgspec.json.Encoder()
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-accel-buffering", b"no")]


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class _ClientGone(Exception):
    """The client hung up before its request was read: nobody to answer."""

    def __init__(self, phase: str) -> None:
        super().__init__(phase)
        self.phase = phase


class _Silent(Response):
    """The answer to a client that is gone: nothing."""

    def __init__(self) -> None:
        self.background = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        return None


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(_enc.encode(obj), status_code=status, media_type="application/json")


def error_response(e: HttpError | ActordError) -> Response:
    if isinstance(e, ActordError):
        status = O.error_status(e)
        return json_response(O.error_body(status, O.error_message(e), O.error_code(e), e.data.get("param")), status)
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

    def __init__(self, front: "HttpFront", run: Callable[[Any], Awaitable[Any]], *, chat: bool, model: str,
                 stream: bool, include_usage: bool, logprobs: bool = False) -> None:
        self.front, self.run, self.chat, self.model, self.stream = front, run, chat, model, stream
        self.include_usage, self.logprobs = include_usage, logprobs
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
            if not outcome:  # the work was still running: the client is gone
                self.front.client_gone("generation", stream=False)
            tg.cancel_scope.cancel()
        if "error" in outcome:
            response = error_response(outcome["error"])
        elif "result" in outcome:
            r = outcome["result"]
            created = int(time.time())
            fp = self.front.fingerprint
            body = (O.chat_completion(O.new_id("chatcmpl"), self.model, r, created, fp, self.logprobs) if self.chat
                    else O.text_completion(O.new_id("cmpl"), self.model, r, created, fp, self.logprobs))
            response = json_response(body)
        else:
            return  # the client went away: nothing to answer
        await response(scope, receive, send)

    async def _streamed(self, scope: Any, receive: Any, send: Any) -> None:
        chunks = O.Chunks(self.chat, self.model, self.front.fingerprint, self.logprobs)
        tx, rx = anyio.create_memory_object_stream[tuple[str, Any]](OUTBOX)
        # Set before the answer's last write: from then on, the http.disconnect that
        # uvicorn reports once a response is complete is the end of a stream, not a client
        # that went away.
        finished = False

        async with anyio.create_task_group() as tg:
            def on_token(chunk: dict[str, Any]) -> None:
                try:
                    tx.send_nowait(("data", _sse(chunks.delta(chunk["content"], chunk.get("logprobs")))))
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
                if not finished:
                    self.front.client_gone("generation", stream=True)
                    tg.cancel_scope.cancel()

            tg.start_soon(work)
            tg.start_soon(watch)
            started = False
            async with rx:
                async for kind, payload in rx:
                    if not started:
                        if kind == "error":
                            finished = True
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
                        finished = True
                        await send({"type": "http.response.body", "body": _DONE, "more_body": False})
            tg.cancel_scope.cancel()


class _OriginGate:
    """Refuses browser requests from origins `--cors-origin` does not list (see the module
    docstring); non-browser clients send no Origin header and pass."""

    def __init__(self, app: Any, front: "HttpFront") -> None:
        self.app, self.front = app, front
        self.allowed = frozenset(front.config.cors_origin)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
            if origin is not None and origin.decode("latin-1") not in self.allowed:
                self.front.refused("origin")
                log.info("http.origin_refused", origin=origin.decode("latin-1")[:200])
                response = json_response(O.error_body(
                    403, "requests from this origin are not allowed (see --cors-origin)", "origin_not_allowed"), 403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _UvicornLog(logging.Handler):
    """uvicorn's own log lines, into structlog: what it warns about is a client's doing
    (a malformed request), info for us; errors stay errors."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno >= logging.ERROR:
                log.error("http.server_error", message=record.getMessage(), exc_info=record.exc_info or None)
            else:
                log.info("http.server", message=record.getMessage())
        except Exception:  # a log line must never take the server down
            pass


def _bridge_uvicorn_logs() -> None:
    lg = logging.getLogger("uvicorn.error")
    if not any(isinstance(h, _UvicornLog) for h in lg.handlers):
        lg.addHandler(_UvicornLog())
    lg.setLevel(logging.WARNING)
    lg.propagate = False


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("actord")
    except Exception:
        return "0"


class HttpFront:
    def __init__(self, system: Any, config: Config) -> None:
        self.config = config
        self.model_id = Path(config.model).stem
        self.names = list(dict.fromkeys([self.model_id, *config.model_alias]))  # listed by /v1/models
        self._known = {*self.names, Path(config.model).name, config.model}
        self._key = config.api_key.encode() if config.api_key else None
        self.disconnects = 0
        self.address: str | None = None
        self.created = int(time.time())
        self.fingerprint = ""
        self._developer: bool | None = None  # whether the chat template names the developer role
        self._sock: socket.socket | None = None
        policy = None if self._key else PeerPolicy(allow_uid=frozenset(config.allow_uid),
                                                    allow_gid=frozenset(config.allow_gid))
        self.gate = Gate(max_connections=config.http_max_connections, max_header_bytes=config.http_max_header_bytes,
                         header_timeout_s=config.http_header_timeout_s, policy=policy,
                         refused=self.refused, opened=self._opened)
        self.system: Any = None
        if system is not None:
            self.attach(system)
        chat = self._guard(self.chat_completions)
        models = self._guard(self.models)
        model = self._guard(self.model)
        middleware = [Middleware(_OriginGate, front=self)]
        if config.cors_origin:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors_origin),
                                         allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"], max_age=600))
        from actord.http.native import Native

        self.app = Starlette(routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/models/{model_id:path}", model, methods=["GET"]),
            # llama-server's native API and the seed's verbs (native.py), /health and
            # /metrics included: llama-server answers those the same on both APIs.
            *Native(self).routes(),
        ], middleware=middleware, exception_handlers={
            HTTPException: self._http_exception, Exception: self._server_error})

    def attach(self, system: Any) -> None:
        """The system this front serves (the daemon binds the front before the model loads)."""
        self.system = system
        props = system.props
        h = hashlib.blake2b(digest_size=6)
        try:
            size = Path(self.config.model).stat().st_size
        except OSError:
            size = -1
        h.update(_enc.encode([_version(), size, getattr(props, "desc", ""), getattr(props, "n_ctx", 0),
                              self.config.slots, getattr(props, "swa_full", False)]))
        # OpenAI's "backend configuration" id: the same code, model and context shape give
        # the same value, so a client can tell when a seed's output may change.
        self.fingerprint = "fp_" + h.hexdigest()

    # -- plumbing ----------------------------------------------------------------------

    @property
    def _metrics(self) -> Any:
        return getattr(self.system, "metrics", None)

    def refused(self, reason: str) -> None:
        m = self._metrics
        if m is not None:
            m.http_refused_total.labels(reason=reason).inc()

    def _opened(self, n: int) -> None:
        m = self._metrics
        if m is not None:
            m.http_connections.set(n)

    def client_gone(self, phase: str, **fields: Any) -> None:
        self.disconnects += 1
        log.info("http.client_gone", phase=phase, **fields)
        m = self._metrics
        if m is not None:
            m.http_client_gone_total.labels(phase=phase).inc()

    def _guard(self, endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def guarded(request: Request) -> Response:
            try:
                self._authorize(request)
                return await endpoint(request)
            except _ClientGone as e:
                self.client_gone(e.phase)
                return _Silent()
            except (HttpError, ActordError) as e:
                return error_response(e)
        return guarded

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        status = exc.status_code
        if status == 404:
            body = O.error_body(404, f"no route {request.method} {request.url.path[:200]}", "not_found")
        elif status == 405:
            body = O.error_body(405, f"method {request.method} is not allowed on {request.url.path[:200]}",
                                "method_not_allowed")
        else:
            body = O.error_body(status, str(exc.detail), "http_error")
        response = json_response(body, status)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    async def _server_error(self, request: Request, exc: Exception) -> Response:
        return json_response(O.error_body(500, f"internal error: {type(exc).__name__}", "internal_error"), 500)

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return  # the connection's peer was checked when it opened (bounds.py)
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key):
            raise HttpError(401, "invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")

    async def _body(self, request: Request, typ: type) -> Any:
        buf = await self.read_body(request)
        try:
            return msgspec.json.decode(buf, type=typ)
        except msgspec.ValidationError as e:
            raise HttpError(400, f"invalid request: {e}", "invalid_params") from None
        except msgspec.DecodeError as e:
            raise HttpError(400, f"malformed JSON: {e}", "invalid_json") from None

    async def read_body(self, request: Request) -> bytes:
        """The request body, held to the front's bounds (size: 413, arrival time: 408)."""
        limit = self.config.http_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                            "body_too_large")
        buf = bytearray()
        timeout = self.config.http_body_timeout_s
        try:
            with anyio.fail_after(timeout):
                async for part in request.stream():
                    buf += part
                    if len(buf) > limit:
                        raise HttpError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
        except ClientDisconnect:
            raise _ClientGone("body") from None
        except TimeoutError:
            self.refused("body_timeout")
            log.info("http.body_timeout", received=len(buf), timeout_s=timeout)
            raise HttpError(408, f"the request body did not arrive within {timeout:g} s", "body_timeout") from None
        return bytes(buf)

    @staticmethod
    def _mind(request: Request, req: O._Common) -> str | None:
        header = request.headers.get("x-actord-mind")
        if header:
            return header  # as given: CompletionRequest.check refuses a name that is not one
        if req.prompt_cache_key:
            return O.mind_for("k", req.prompt_cache_key)
        if req.user:
            return O.mind_for("u", req.user)
        return None

    async def _template_names_developer(self) -> bool:
        """Whether the chat template handles the `developer` role itself (it names it)."""
        if self._developer is None:
            source: str | None = None
            try:
                if self.config.chat_template_file:
                    source = await anyio.Path(self.config.chat_template_file).read_text()
                else:
                    from actord.engine.jobs import ChatInfo

                    source = (await self.system.engine.run(ChatInfo())).template
            except (OSError, UnicodeDecodeError, AttributeError, ActordError):
                source = None  # the chat itself reports a template it cannot read
            self._developer = bool(source) and "developer" in source  # type: ignore[operator]
        return self._developer

    # -- routes ------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        req: O.ChatCompletionRequest = await self._body(request, O.ChatCompletionRequest)
        O.refuse_unsupported(req)
        fields = O.sampling(req, self.system.props.n_vocab)
        if not req.messages:
            raise InvalidParams("messages is empty", param="messages")
        developer = any(m.role == "developer" for m in req.messages) and await self._template_names_developer()
        n = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if n is None:
            n = min(self.config.http_default_max_tokens, self.system.props.n_ctx)
        chat = ChatRequest(
            messages=O.chat_messages(req.messages, developer_is_system=not developer),
            n_predict=n, mind=self._mind(request, req),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
            stop=O.stops(req.stop), stream=req.stream, genes=req.genes, **fields,
        ).check()
        self._precheck(chat.mind, chat.n_predict, chat.temperature, chat.top_k, chat.top_p, fields)

        async def run(on_token: Any) -> Any:
            return (await self.system.chat(chat, on_token=on_token)).completion

        return _Generation(self, run, chat=True, model=req.model or self.model_id, stream=req.stream,
                           include_usage=bool(req.stream_options and req.stream_options.include_usage),
                           logprobs=fields["logprobs"])

    async def completions(self, request: Request) -> Response:
        req: O.TextCompletionRequest = await self._body(request, O.TextCompletionRequest)
        O.refuse_unsupported(req)
        fields = O.sampling(req, self.system.props.n_vocab)
        comp = CompletionRequest(
            prompt=O.text_prompt(req.prompt), n_predict=req.max_tokens if req.max_tokens is not None else 16,
            mind=self._mind(request, req),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
            stop=O.stops(req.stop), stream=req.stream, genes=req.genes, **fields,
        ).check()

        async def run(on_token: Any) -> Any:
            return await self.system.complete(comp, on_token=on_token)

        return _Generation(self, run, chat=False, model=req.model or self.model_id, stream=req.stream,
                           include_usage=bool(req.stream_options and req.stream_options.include_usage),
                           logprobs=fields["logprobs"])

    @staticmethod
    def _precheck(mind: str | None, n_predict: int, temperature: float, top_k: int, top_p: float,
                  fields: dict[str, Any]) -> None:
        # The same checks a completion makes, before any rendering work.
        CompletionRequest(prompt=[0], n_predict=n_predict, mind=mind, temperature=temperature,
                          top_k=top_k, top_p=top_p, **fields).check()

    def _model_object(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "actord"}

    async def models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": [self._model_object(n) for n in self.names]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model_id"]
        if name not in self._known:
            # Requests may name any model (they are all served by this one), but a lookup
            # answers only for the names /v1/models lists, so the list and lookups agree.
            raise ModelNotFound(f"the model {name[:200]!r} does not exist; this daemon lists {self.names!r}",
                                param="model")
        return json_response(self._model_object(name))

    # -- serving -----------------------------------------------------------------------

    def bind(self) -> socket.socket:
        """Listen (the daemon calls this before the model loads, so a refusal is quick)."""
        if self._sock is not None:
            return self._sock
        spec = self.config.http or "127.0.0.1:0"
        host, port = http_address(spec)
        if self._key is None:
            why = check_tcp_peers(host)
            if why is not None:
                raise InvalidParams(f"--http {spec} without --api-key serves this uid only, and {why}: "
                                    f"set --api-key", http=spec)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            raise InvalidParams(f"cannot listen on {spec}: {e.strerror}", http=spec) from None
        sock.listen(1024)
        sock.setblocking(False)
        bound = sock.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        self._sock = sock
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
        _bridge_uvicorn_logs()
        protocol, extra = bounded_protocol(self.gate)
        # proxy_headers off: no proxy stands in front by design, and a client's
        # X-Forwarded-For must not rewrite who it is. ws off: no route speaks WebSocket.
        config = uvicorn.Config(self.app, http=protocol, ws="none", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=5, server_header=False,
                                proxy_headers=False, timeout_keep_alive=self.config.http_idle_timeout_s,  # type: ignore[arg-type]
                                **extra)
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
                log.info("http.listening", address=self.address, api_key=self._key is not None,
                         peers="checked" if self._key is None else "key")
                task_status.started(self.address)
                try:
                    await anyio.sleep_forever()
                finally:
                    server.should_exit = True
        finally:
            sock.close()
            self._sock = None

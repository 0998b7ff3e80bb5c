"""The HTTP front (`actord serve --http`): one Starlette app, served by uvicorn in the
daemon's own event loop, for both APIs.

Why this module: it is what both APIs' routes stand behind, and nothing of either: the
app's assembly, who may use it (the key, the peer policy, the origin gate), the body's
bounds, the fallback error answers, and the server's lifecycle (bind before the model
loads, serve until cancelled, shut down gracefully). The routes are elsewhere:
`openai/routes.py` (OpenAI's; its Responses API in `openai/responses_api.py`, embeddings in
`embeddings.py`), `anthropic/routes.py` (Anthropic's Messages API), `native/` (llama-server's native API and the seed's
page and gene verbs) and `dashboard.py` (the memory page); a generation runs inside its
response (`streaming.py`).

Why Starlette + uvicorn: Starlette is a small ASGI toolkit (routing, requests, responses)
built on anyio, like the actor system, so the routes run in the same event loop as the
socket server and await the same `ActorSystem`; uvicorn is the most used ASGI server, and it
can be run as one coroutine inside a loop it did not create (`Server.serve(sockets=...)`),
which is what "same process, same event loop" needs. FastAPI would add pydantic and a
second validation layer beside msgspec; aiohttp brings its own loop conventions and no ASGI.
uvicorn runs its own protocol subclassed with the front's bounds (`bounds.py`: header
bytes and deadline, connections, peers), which it has no settings for.

With an API key every route but the health ones and the UI page's (dashboard.py) needs
`Authorization: Bearer KEY` (or, without that header, Anthropic's `x-api-key: KEY`, as
llama-server takes it); without one, only this uid (and --allow-uid/--allow-gid) is
served (`bounds.py`). Every answer of an OpenAI route that is not a 200 is OpenAI's error
object, unknown routes included; the native routes answer with llama-server's
(`native/base.py`). Browsers (requests with an `Origin` header) are treated as llama-server
treats them (`cors.py`: without `--cors-origin` any origin is served, with a list only
those, others refused 403). A daemon on loopback without a key is then reachable by any
page its user's browser opens: list the origins (`--cors-origin localhost`) or set
`--api-key` where that matters. Every header name goes out in its canonical case
(bounds.py). `--http` may name several addresses, all served by this one app; under
Google Vertex AI its prediction route is added (`vertex.py`). A body is held to
`--http-max-body-bytes` (413) and `--http-body-timeout-s` (408) as it arrives (`read_body`);
its JSON nesting is bounded before it is decoded, a large one decoded on a worker thread,
and its entry counts checked before any work (`decode_json`, costs.py). Without a key, a
Host that is not the daemon's own is refused 403 (DNS rebinding: `cors.HostGate`).
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
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from actord.service import tenancy
from actord.vocabulary.config import Config, http_addresses, is_loopback, split_names
from actord.vocabulary.errors import ActordError, InvalidParams
from actord.frontends.http.openai import wire as O
from actord.frontends.http import costs
from actord.frontends.shares import Shares, Ticket, paced, peer_of
from actord.frontends.http.streaming import Generation
from actord.frontends.http.bounds import GONE, KEY, ControlRoom, Gate, bounded_protocol
from actord.frontends.http.cors import Cors, HostGate, OriginGate
from actord.frontends.http.dashboard import Dashboard, MindLabels
from actord.frontends.http.anthropic.routes import AnthropicRoutes
from actord.frontends.http.openai.embeddings import Embeddings
from actord.frontends.http.native.routes import Native
from actord.frontends.http.openai.routes import OpenAIRoutes
from actord.frontends.http.openai.responses_api import Responses
from actord.frontends.http.vertex import Vertex
from actord.frontends.http.responses import ClientGone, HttpError, Silent, error_response, for_client, json_response
from actord.vocabulary.log import get
from actord.service.protocol import Service
from actord.frontends.rpc.peers import PeerPolicy, check_tcp_peers

log = get("actord.frontends.http")
_enc = msgspec.json.Encoder()


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


def _name(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("actord")
    except Exception:
        return "0"


# How long connections still open at a stop may take to end by themselves (an answer's last
# bytes being read) before they are closed: by then every generation has ended (the
# system's shutdown grace came first), so what is left is a client not reading its answer or
# not sending its body, which uvicorn would wait on (timeout_graceful_shutdown) and then
# cancel, logging an error and a traceback for an ordinary stop.
STOP_LINGER_S = 1.0


async def _end_connections(server: Any, ended: anyio.Event) -> None:
    """Once the server was told to exit: its connections end by themselves within
    STOP_LINGER_S, or are aborted, so its handlers see the client gone and end quietly."""
    with anyio.move_on_after(STOP_LINGER_S):
        await ended.wait()
    if ended.is_set():
        return
    for conn in list(server.server_state.connections):
        transport = getattr(conn, "transport", None)
        if transport is not None:
            transport.abort()
    log.info("http.connections_closed_at_stop", after_s=STOP_LINGER_S)


class HttpFront:
    def __init__(self, system: Service | None, config: Config, shares: Shares | None = None) -> None:
        """`shares`: the daemon's one count of generations, which its socket is given too
        (frontends/shares.py); None: this front's own."""
        self.config = config
        # llama-server's naming: the model is listed once, its id the first alias in sorted
        # order (its aliases are a std::set), else the file's stem; any of them is served.
        self.aliases = sorted(set(split_names(config.model_alias)))
        self.tags = sorted(set(split_names(config.model_tags)))
        self.model_id = self.aliases[0] if self.aliases else Path(config.model).stem
        self.names = [self.model_id]  # listed by /v1/models
        self.known = {self.model_id, *self.aliases, Path(config.model).stem, Path(config.model).name, config.model}
        keys = [k.encode() for k in config.api_keys()]
        self._key = keys[0] if keys else None  # None: no key asked for
        # Each key and the tenant it serves (service/tenancy.py): with several keys, each is
        # its own, and reuse of cells never crosses them.
        self._keys = [(k, "" if config.share_across_tenants else tenancy.of_key(k, len(keys))) for k in keys]
        self.disconnects = 0
        self.address: str | None = None
        self.created = int(time.time())
        self.fingerprint = ""
        self.version = _version()
        self._developer: bool | None = None  # whether the chat template names the developer role
        self._folds: Any = None  # what the chat template refuses (degraded.Folds), probed once
        self.mind_labels = MindLabels()  # digest-named minds' names as clients gave them (dashboard.py)
        self._socks: list[socket.socket] = []
        self._lane: anyio.CapacityLimiter | None = None  # parse lanes (costs.py)
        self.bodies = costs.BodyBytes(config.http_max_body_bytes_in_flight or 4 * config.http_max_body_bytes)
        # Generations in flight and chunks queued, per client (frontends/shares.py).
        self.shares = shares if shares is not None else Shares.from_config(config)
        self.stream_ahead = config.http_stream_ahead_chunks
        policy = None if self._key else PeerPolicy(allow_uid=frozenset(config.allow_uid),
                                                    allow_gid=frozenset(config.allow_gid))
        self.gate = Gate(max_connections=config.http_max_connections, max_header_bytes=config.http_max_header_bytes,
                         header_timeout_s=config.http_header_timeout_s, policy=policy,
                         refused=self.refused, opened=self._opened,
                         max_per_peer=config.http_max_connections_per_peer, control=config.http_control_connections,
                         write_timeout_s=config.http_write_timeout_s,
                         key_of=self.key_name if len(self._keys) > 1 else None,
                         max_per_key=config.http_max_connections_per_key or config.http_max_connections_per_peer)
        self.system: Service | None = None
        if system is not None:
            self.attach(system)
        middleware = [Middleware(ControlRoom, refused=self.refused), Middleware(HostGate, front=self),
                      Middleware(OriginGate, front=self), Middleware(Cors, front=self)]
        routes = self.routes()
        if config.vertex:  # Vertex AI's prediction route (vertex.py), which must not hide one of ours
            taken = {getattr(r, "path", "") for r in routes}
            if config.aip_predict_route in taken or config.aip_health_route in taken - {"/health"}:
                raise InvalidParams(f"AIP_PREDICT_ROUTE {config.aip_predict_route} (or AIP_HEALTH_ROUTE) "
                                    "names one of the front's own routes")
            routes += Vertex(self).routes()
        self.app = Starlette(routes=routes, middleware=middleware, exception_handlers={
            HTTPException: self._http_exception, Exception: self._server_error})

    def routes(self) -> list[Route]:
        """The route table (the cluster's front, actord/cluster/front.py, serves its own)."""
        return [
            *OpenAIRoutes(self).routes(),
            *Responses(self).routes(),  # POST /v1/responses, GET/DELETE /v1/responses/{id} (openai/responses_api.py)
            *Embeddings(self).routes(),  # POST /v1/embeddings (embeddings.py)
            *AnthropicRoutes(self).routes(),  # POST /v1/messages, /v1/messages/count_tokens (anthropic/)
            # llama-server's native API and the seed's verbs (native/), /health and
            # /metrics included: llama-server answers those the same on both APIs.
            *Native(self).routes(),
            *Dashboard(self).routes(),  # GET /dashboard and /dashboard/state (dashboard.py)
        ]

    def attach(self, system: Service) -> None:
        """The system this front serves (the daemon binds the front before the model loads)."""
        self.system = system
        metrics = getattr(system, "metrics", None)
        if metrics is not None:
            self.shares.watch(metrics)
        # The Responses API's store (openai/responses_api.py), built with the routes; a
        # system with no memory report (the cluster's router) has no sources to add it to.
        sources = getattr(system, "memory_sources", None)
        if sources is not None:
            sources.add("stored_responses", lambda: getattr(self, "responses_store").held)
        props = system.model_props()
        h = hashlib.blake2b(digest_size=6)
        try:
            size = Path(self.config.model).stat().st_size
        except OSError:
            size = -1
        h.update(_enc.encode([self.version, size, getattr(props, "desc", ""), getattr(props, "n_ctx", 0),
                              self.config.slots, getattr(props, "swa_full", False)]))
        # OpenAI's "backend configuration" id (an opaque string to OpenAI): the same code,
        # model and context shape give the same value, so a client can tell when a seed's
        # output may change. Written as llama-server writes its own, `b<build>-<id>`, so
        # clients that read a llama-server build from it (its tests do) find one.
        self.fingerprint = f"b{self.version}-{h.hexdigest()}"

    @property
    def service(self) -> Service:
        """The system, once attached (a route is served only then)."""
        assert self.system is not None, "the front serves no system yet"
        return self.system

    # -- plumbing ----------------------------------------------------------------------

    @property
    def _metrics(self) -> Any:
        return self.system.metrics if self.system is not None else None

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

    def guard(self, endpoint: Callable[[Request], Awaitable[Response]], *,
              errors: Callable[[Any], Response] = error_response,
              public: bool = False, generates: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """`endpoint` behind the key (unless `public`), its typed errors answered with
        `errors` (OpenAI's object by default), a client gone mid-body answered with nothing.
        A route that `generates` is counted against its client's share from the request
        head, its body unread: it waits its turn past the share, and is answered 429 when
        even the line is full (frontends/shares.py); the count goes with its Generation."""
        async def guarded(request: Request) -> Response:
            ticket: Ticket | None = None
            try:
                if not public:
                    tenancy.enter(self._authorize(request))
                if generates:
                    entered = await self.share_enter(request.scope)
                    if not isinstance(entered, Ticket):
                        response = errors(entered)
                        response.headers["retry-after"] = "1"
                        return response
                    ticket = entered
                response = await endpoint(request)
                if ticket is not None and isinstance(response, Generation):
                    response.ticket, ticket = ticket, None  # counted until the answer ends
                return response
            except ClientGone as e:
                self.client_gone(e.phase)
                return Silent()
            except (HttpError, ActordError) as e:
                return errors(for_client(e))
            finally:
                if ticket is not None:
                    ticket.release()
        return guarded

    async def share_enter(self, scope: Any) -> Ticket | HttpError:
        """A generation counted against its address's (and key's) share, after its turn in
        the line if the share is full; else the 429 for it, counted under its reason and
        sent after the pause (frontends/shares.py `paced`)."""
        peer, key = peer_of(scope), scope.get(KEY)
        entered: Ticket | tuple[str, str] | None = self.shares.admit(peer, key)
        if entered is not None:
            return entered
        gone = scope.get(GONE)
        if gone is None:
            entered = await self.shares.wait_turn(peer, key)
        else:  # it may wait: it leaves the line if its client hangs up meanwhile
            got: list[Ticket | tuple[str, str]] = []
            async with anyio.create_task_group() as tg:
                async def wait() -> None:
                    got.append(await self.shares.wait_turn(peer, key))
                    tg.cancel_scope.cancel()

                tg.start_soon(wait)
                await gone.wait()
                tg.cancel_scope.cancel()
            if not got:
                raise ClientGone("waiting")
            entered = got[0]
        if isinstance(entered, Ticket):
            return entered
        self.refused(entered[1])
        await paced()  # a flood's answers at the daemon's pace (frontends/shares.py)
        return HttpError(429, entered[0], "rate_limit_exceeded")

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
        log.error("http.internal_error", path=request.url.path[:200], error=repr(exc)[:500])
        message = f"internal error: {type(exc).__name__}"
        if request.url.path.startswith("/v1/messages"):  # Anthropic's routes answer in Anthropic's shape
            from actord.frontends.http.anthropic.wire import error_body as anthropic_error

            return json_response(anthropic_error(500, message), 500)
        return json_response(O.error_body(500, message, "internal_error"), 500)

    def _authorize(self, request: Request) -> str:
        """The tenant the request's key serves; HttpError 401 without a key that opens."""
        if self._key is None:
            return ""  # the connection's peer was checked when it opened (bounds.py)
        found = self._key_index(request.headers.get("authorization"), request.headers.get("x-api-key"))
        if found is None:
            raise HttpError(401, "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                            "invalid_api_key")
        return self._keys[found][1]

    def _key_index(self, auth: str | None, x_api_key: str | None) -> int | None:
        """Which of the front's keys the headers present (None: none of them)."""
        if auth is None and x_api_key is not None:  # Anthropic's header, as llama-server takes it
            token = x_api_key
        else:
            scheme, _, token = (auth or "").partition(" ")
            token = token if scheme.lower() == "bearer" else ""
        given = token.strip().encode()
        found = None
        for i, (key, _) in enumerate(self._keys):  # every key compared, in constant time each
            if hmac.compare_digest(given, key) and given:
                found = i
        return found

    def key_name(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The name (`key2`: its place in the configuration, never the key) of the key a
        request head presents, for the per-key bounds (bounds.py, frontends/shares.py)."""
        auth = x_api_key = None
        for k, v in headers:
            if k == b"authorization":
                auth = v.decode("latin-1")
            elif k == b"x-api-key":
                x_api_key = v.decode("latin-1")
        found = self._key_index(auth, x_api_key)
        return None if found is None else f"key{found}"

    async def read_body(self, request: Request) -> bytes:
        """The request body, held to the front's bounds (size: 413, arrival time: 408)."""
        limit = self.config.http_max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise HttpError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                            "body_too_large")
        buf = bytearray()
        timeout = self.config.http_body_timeout_s
        peer = request.client.host if request.client else "?"
        held = 0
        try:
            with anyio.fail_after(timeout):
                async for part in request.stream():
                    if len(buf) + len(part) > limit:
                        raise HttpError(413, f"request body exceeds the limit of {limit} bytes", "body_too_large")
                    self.bodies.add(peer, len(part))  # 503 past the bytes in flight (costs.BodyBytes)
                    held += len(part)
                    buf += part
        except ClientDisconnect:
            raise ClientGone("body") from None
        except TimeoutError:
            self.refused("body_timeout")
            log.info("http.body_timeout", received=len(buf), timeout_s=timeout)
            raise HttpError(408, f"the request body did not arrive within {timeout:g} s", "body_timeout") from None
        except HttpError as e:
            if e.status == 503:
                self.refused("body_bytes")
            raise
        finally:
            self.bodies.release(peer, held)
        return bytes(buf)

    async def decode_json(self, request: Request, typ: Any = None) -> Any:
        """The body read (`read_body`), its depth and values bounded before it is decoded (as
        `typ`, when given; a large one on a parse lane, within its time budget) and its entry
        counts checked before any entry is used (costs.py): each a 4xx naming what is wrong."""
        buf = await self.read_body(request)
        if typ is None and not buf.strip():
            return {}
        cfg = self.config
        if self._lane is None:  # made in the serving loop (a limiter belongs to its loop)
            self._lane = anyio.CapacityLimiter(costs.PARSE_LANES)
        obj = await costs.offload(costs.decode, buf, cfg.http_max_json_depth, typ, cfg.http_max_json_values,
                                  size=len(buf), budget_s=cfg.http_parse_budget_s, field="body", lane=self._lane)
        limits = cfg.request_limits()
        costs.check_entries(obj, limits.max_logit_bias, limits.max_prompt_bytes)
        return obj

    async def template_names_developer(self) -> bool:
        """Whether the chat template handles the `developer` role itself (it names it)."""
        if self._developer is None:
            source: str | None = None
            try:
                if self.config.chat_template:
                    from actord.chat.named_templates import named

                    source = named(self.config.chat_template)
                elif self.config.chat_template_file:
                    source = await anyio.Path(self.config.chat_template_file).read_text()
                else:
                    source = await self.model_chat_template()
            except (OSError, UnicodeDecodeError, AttributeError, ActordError):
                source = None  # the chat itself reports a template it cannot read
            self._developer = bool(source) and "developer" in source  # type: ignore[operator]
        return self._developer

    async def template_folds(self) -> Any:
        """What the chat template refuses, so a conversation is folded before it renders
        (degraded.py): probed on the first chat that could need it, then kept."""
        if self._folds is None:
            from actord.frontends.http.degraded import probe_folds

            self._folds = await probe_folds(self.service)
        return self._folds

    async def model_chat_template(self) -> str | None:
        """The chat template the model ships (None: none)."""
        return (await self.service.chat_info()).template

    # -- serving -----------------------------------------------------------------------

    def bind(self, inherited: socket.socket | None = None) -> socket.socket:
        """Listen on --http's addresses (several, comma-separated, are all served by this one
        front, its bounds counted across them), the daemon calls this before the model loads,
        so a refusal is quick; or serve on `inherited`, a TCP listener systemd bound (socket
        activation), held to the same rules as --http's address: off loopback it needs the
        key. Under Vertex AI (`aip_mode`) every address takes AIP_HTTP_PORT's port, as
        llama-server's. Returns the first listener."""
        if self._socks:
            return self._socks[0]
        if inherited is not None:
            host, port = inherited.getsockname()[:2]
            spec = f"[{host}]:{port}" if inherited.family == socket.AF_INET6 else f"{host}:{port}"
            if not is_loopback(host) and not self._key:
                raise InvalidParams(f"systemd's socket {spec} is not a loopback address: it needs --api-key",
                                    http=spec)
            addrs = [(host, port)]
        else:
            spec = self.config.http or "127.0.0.1:0"
            addrs = http_addresses(spec)
            if self.config.vertex:
                if any(p != self.config.aip_http_port for _, p in addrs):
                    log.warning("http.vertex_port", http=spec, port=self.config.aip_http_port)
                addrs = [(h, self.config.aip_http_port) for h, _ in addrs]
            if len(addrs) > 1 and any(p == 0 for _, p in addrs):
                raise InvalidParams(f"--http {spec}: port 0 is not supported with several addresses", http=spec)
        socks: list[socket.socket] = []
        try:
            for host, port in addrs:
                socks.append(self._listen(host, port, spec, inherited))
        except BaseException:
            for s in socks:
                if s is not inherited:
                    s.close()
            raise
        self.address = ",".join(_name(s) for s in socks)
        self._socks = socks
        return socks[0]

    def _listen(self, host: str, port: int, spec: str, inherited: socket.socket | None) -> socket.socket:
        if self._key is None:
            why = check_tcp_peers(host)
            if why is not None:
                raise InvalidParams(f"--http {spec} without --api-key serves this uid only, and {why}: "
                                    f"set --api-key", http=spec)
        if inherited is not None:
            sock = inherited
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # [::]:P beside 0.0.0.0:P: each its own family
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((host, port))
            except OSError as e:
                sock.close()
                raise InvalidParams(f"cannot listen on {spec}: {e.strerror}", http=spec) from None
            sock.listen(1024)
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        """Close the listeners (the daemon's, when the system fails to start)."""
        for s in self._socks:
            s.close()
        self._socks = []

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, then shut down gracefully (close listeners, let answers end)."""
        import uvicorn

        class _InLoopServer(uvicorn.Server):
            # The daemon owns SIGINT/SIGTERM (anyio's signal receiver); uvicorn must not
            # replace those handlers, nor re-raise a signal when it stops.
            @contextlib.contextmanager
            def capture_signals(self) -> Any:
                yield

        self.bind()
        socks = list(self._socks)
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
                            await server.serve(sockets=socks)
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
                    with anyio.CancelScope(shield=True):
                        await _end_connections(server, ended)
        finally:
            self.close()

"""The HTTP front's own bounds, kept in the connection's protocol, before any request
reaches Starlette.

Why here and not in the ASGI app: the app sees a request only once its head is parsed, so
it cannot bound what parsing costs, nor see a connection that never sends a request. And
uvicorn does not bound these itself: its httptools protocol accumulates a header of any
size (llhttp has no limit and httptools joins the pieces in Python: a 100 MB header froze
the loop for 8.4 s and kept 60-200 MB); it has no deadline for a request head (its
keep-alive timer starts after a first answer and stops at the next byte, so a client
trickling a byte at a time holds a connection for ever); and `limit_concurrency` answers
503 only to a parsed request, so 1,100 silent connections still hold 1,100 fds.
(`h11_max_incomplete_event_size` bounds a head for the pure-Python h11 protocol only.) So
the front runs uvicorn's own protocol, subclassed (`bounded_protocol`):

- header bytes: bytes received while a request head is incomplete are counted; past
  `http_max_header_bytes` the connection gets 431 and nothing more is parsed (memory: the
  limit plus one read of at most 256 KiB);
- header deadline: the head must be complete `http_header_timeout_s` after the connection
  opened, or after its first byte once a keep-alive answer ended; data does not extend it.
  A connection that sent nothing is closed quietly, one with part of a head gets 408;
- idle keep-alive: uvicorn's own `timeout_keep_alive` (`http_idle_timeout_s`);
- connections: beyond `http_max_connections` served at once, a new connection is answered
  503 at once and closed (a refused connection stops counting against the cap: its short
  linger is bounded by MAX_LINGERING instead); the daemon raises its fd limit above both this cap and the
  socket's (`actord/frontends/daemon.py`), so neither kind of client can run the process out of fds;
- connections per peer: one client address holds at most `http_max_connections_per_peer`
  of them; beyond that (or beyond the front's cap), a new connection is served only in the
  control room: `http_control_connections` more, for /health and /metrics alone (any other
  route answers 503), with a one-second head deadline, so a flood of streams from one
  address (300 never-reading chats took every connection for as long as they stayed open)
  leaves the control routes answering and other addresses their share;
- connections per key: with several API keys, a connection counts against the key its
  latest request presented (`Gate.key_of`, which names the key, never holds it); past
  `http_max_connections_per_key`, a request is answered 429 in its API's error shape (the
  control routes aside) and its connection closes, so one key's flood leaves the other
  keys their share (the key is known only once a head is parsed: before, the per-address
  bounds hold);
- write deadline: an answer whose client reads nothing while the transport holds more
  than its high-water mark of output (asyncio's `pause_writing`) for `http_write_timeout_s`
  ends the connection (`abort`): the request sees a disconnect and its generation is
  cancelled, so a client that does not read holds neither its slot nor its connection (the
  kernel's send buffer is set to SNDBUF_BYTES: autotuned, it absorbed a whole stream of
  several MB, and the stall never reached the protocol);
- peers: without an API key, the client socket's owner (`actord.frontends.rpc.peers.tcp_peer`) must
  pass the socket's `PeerPolicy`, else 403, decided once per connection when it opens
  (like SO_PEERCRED, which the kernel takes at connect).

Header names go out in their canonical case (`Content-Type`, `Access-Control-Allow-Origin`),
as llama-server writes them: HTTP says names are case-insensitive, but clients built on it
read them from a plain dict (its own test suite does). Starlette and uvicorn lowercase
every name, so each request's answer head is rewritten as it is written (`canonical_head`),
one pass over the head's lines, and sent with the answer's first body bytes (one send, not
two: `_CanonicalHead`); the body is never touched, streamed or not.

A refusal writes one whole HTTP answer (OpenAI's error object, `connection: close`),
half-closes, and discards input for a moment (at most LINGER_S and LINGER_BYTES, for at
most MAX_LINGERING connections at once) so that a client still sending reads the answer
rather than a reset; past those bounds the connection is closed at once.
"""

from __future__ import annotations

import asyncio
import functools
import http
import socket
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from actord.frontends.http.openai import wire as O
from actord.vocabulary.log import get
from actord.frontends.rpc.peers import PeerPolicy, tcp_peer

log = get("actord.frontends.http")

LINGER_S = 0.5
LINGER_BYTES = 1 << 20
MAX_LINGERING = 64


@dataclass
class Gate:
    """What all connections of one front share: the bounds and the counts against them."""

    max_connections: int
    max_header_bytes: int
    header_timeout_s: float
    policy: PeerPolicy | None  # None: an API key guards the front instead
    refused: Callable[[str], None] = lambda reason: None  # counts a refusal (metrics)
    opened: Callable[[int], None] = lambda n: None  # reports the open count (metrics)
    max_per_peer: int = 1 << 30  # connections one client address may hold
    control: int = 0  # connections beyond the caps, for the control routes alone
    write_timeout_s: float = 1e9  # output not drained for this long ends the connection
    # With several API keys: the key a request head presents (its name, never the key; None:
    # no key of this front), and the connections one key may hold (`Shares` says why per key).
    key_of: Callable[[list[tuple[bytes, bytes]]], str | None] | None = None
    max_per_key: int = 1 << 30
    per_key: dict[str, int] = field(default_factory=dict)
    open: int = 0
    control_open: int = 0
    per_peer: dict[str, int] = field(default_factory=dict)
    lingering: int = 0
    full: bool = False  # at the cap now: warn once per episode, not per connection
    warned: set[int | None] = field(default_factory=set)  # peers refused: warn once per uid, not per connection


def answer(status: int, message: str, code: str, *, retry_after: int | None = None) -> bytes:
    """One whole HTTP/1.1 answer carrying OpenAI's error object, closing the connection."""
    body = msgspec.json.encode(O.error_body(status, message, code))
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


SNDBUF_BYTES = 64 << 10  # a connection's kernel send buffer (Linux doubles it), so a write deadline can see a stall
CONTROL_PATHS = frozenset({"/health", "/v1/health", "/metrics"})  # what the control room serves
CONTROL_HEAD_S = 1.0  # a control-room connection's head deadline (at most the front's)
CONTROL_ONLY = "actord.control_only"  # the scope key of a request on a control-room connection
KEY = "actord.key"  # the scope key holding the name of the API key a request presented (several keys)
# The scope key of an asyncio.Event set when the request's connection is lost: a generation
# waiting in the front's line (frontends/shares.py) leaves it then, not once it is let in.
GONE = "actord.gone"
KEY_FULL = "actord.key_full"  # the scope key of a request whose key holds its share of connections

_SPECIAL = {b"etag": b"ETag", b"www-authenticate": b"WWW-Authenticate", b"te": b"TE"}


@functools.lru_cache(maxsize=256)  # the names are the app's own few: one dict lookup each, per answer
def canonical_name(name: bytes) -> bytes:
    """`access-control-allow-origin` -> `Access-Control-Allow-Origin` (a few names by their
    registered spelling)."""
    low = name.lower()
    return _SPECIAL.get(low) or b"-".join(part[:1].upper() + part[1:] for part in low.split(b"-"))


def canonical_head(head: bytes) -> bytes:
    """An answer head (status line, header lines, blank line) with canonical names."""
    lines = head.split(b"\r\n")
    for i in range(1, len(lines)):
        name, sep, rest = lines[i].partition(b":")
        if sep:
            lines[i] = canonical_name(name) + sep + rest
    return b"\r\n".join(lines)


class _CanonicalHead:
    """A request cycle's transport: its first answer head (an interim `100 Continue` aside)
    goes out with canonical header names, held back until the answer's first body write so
    that both leave in one send. Why: uvloop sends on every write, and uvicorn writes a head
    and its body apart, so a short answer (a 429, an error, a small JSON) cost two system
    calls, the larger part of what a refused request costs the event loop. The head is held
    no longer than the loop's current turn (`call_soon`: a stream's head goes out even if
    its first chunk is late) and is flushed before the transport closes. Every other write,
    and every other call, passes through unchanged."""

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._t = transport
        self._loop = loop
        self._head_sent = False
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if not self._head_sent and data.startswith(b"HTTP/") and not data.startswith(b"HTTP/1.1 100 "):
            self._head_sent = True
            end = data.find(b"\r\n\r\n")
            self._held = canonical_head(data) if end < 0 else canonical_head(data[:end]) + data[end:]
            self._loop.call_soon(self._flush)
            return
        if self._held is not None:
            held, self._held = self._held, None
            self._t.writelines((held, data))
            return
        self._t.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._t.is_closing():
            self._t.write(held)

    def write_eof(self) -> None:
        self._flush()
        self._t.write_eof()

    def close(self) -> None:
        self._flush()
        self._t.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)


class _Bounds:
    """Mixed in before a uvicorn HTTP protocol class (see `bounded_protocol`)."""

    gate: Gate
    transport: asyncio.Transport
    cycle: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        g = self.gate
        g.open += 1
        g.opened(g.open)
        self._b_counted = True
        self._b_in_head = True  # a request head is (or may start) arriving
        self._b_head_bytes = 0
        self._b_timer: asyncio.TimerHandle | None = None
        self._b_linger: asyncio.TimerHandle | None = None
        self._b_wtimer: asyncio.TimerHandle | None = None
        self._b_drain = -1  # >= 0: refused, bytes still to discard before closing
        self._b_control = False  # admitted into the control room: control routes only
        self._b_key: str | None = None  # the API key this connection counts against (its last request's)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:  # the kernel's share of a reader's backlog bounded too (autotuned, it grows to 4 MB)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            except OSError:
                pass
        peer = transport.get_extra_info("peername")
        self._b_peer: str | None = str(peer[0]) if peer else None
        if self._b_peer is not None:
            g.per_peer[self._b_peer] = g.per_peer.get(self._b_peer, 0) + 1
        if g.policy is not None:
            peer = tcp_peer(transport.get_extra_info("sockname"), transport.get_extra_info("peername"),
                            gid=bool(g.policy.allow_gid))
            if not g.policy.allows(peer):
                uid = peer.uid if peer is not None else None
                if uid not in g.warned and len(g.warned) < 1024:
                    g.warned.add(uid)
                    log.warning("http.peer_refused", uid=uid, client=_addr(transport))
                else:
                    log.debug("http.peer_refused", uid=uid, client=_addr(transport))
                self._b_refuse(403, "this daemon serves its own uid and the allowed uids/gids only "
                               "(or set --api-key)", "PeerRefused", "peer")
                return
        mine = g.per_peer.get(self._b_peer, 0) if self._b_peer is not None else 0
        if (g.open > g.max_connections or mine > g.max_per_peer) and g.control_open < g.control:
            g.control_open += 1  # the control room: /health and /metrics answer under any flood
            self._b_control = True
            log.debug("http.control_room", open=g.open, peer_open=mine, client=_addr(transport))
            self._b_arm()
            return
        if mine > g.max_per_peer:
            log.debug("http.peer_connections", open=mine, max=g.max_per_peer, client=_addr(transport))
            self._b_refuse(503, f"one client address holds at most {g.max_per_peer} connections at once",
                           "Overloaded", "peer_connections", retry_after=1)
            return
        if g.open > g.max_connections:
            if not g.full:
                g.full = True
                log.warning("http.too_many_connections", open=g.open - 1, max=g.max_connections)
            else:
                log.debug("http.too_many_connections", open=g.open - 1, max=g.max_connections)
            self._b_refuse(503, f"the HTTP front serves at most {g.max_connections} connections at once",
                           "Overloaded", "connections", retry_after=1)
            return
        if g.full and g.open <= g.max_connections // 2 + 1:
            g.full = False
        self._b_arm()

    def connection_lost(self, exc: Exception | None) -> None:
        g = self.gate
        c = self.cycle
        if c is not None and GONE in c.scope:
            c.scope[GONE].set()
        self._b_uncount()
        self._b_disarm()
        if self._b_wtimer is not None:
            self._b_wtimer.cancel()
            self._b_wtimer = None
        if self._b_linger is not None:
            self._b_linger.cancel()
            self._b_linger = None
            g.lingering -= 1
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._b_drain >= 0:  # refused: read and drop, so the client reads the answer, then close
            self._b_drain -= len(data)
            if self._b_drain < 0:
                self.transport.close()
            return
        if self._b_in_head:
            if self._b_timer is None and not self._b_busy():
                self._b_arm()
            self._b_head_bytes += len(data)
        super().data_received(data)  # type: ignore[misc]
        self._b_parsed()
        if self._b_in_head and self._b_head_bytes > self.gate.max_header_bytes and not self.transport.is_closing():
            log.info("http.header_too_large", received=self._b_head_bytes, max=self.gate.max_header_bytes,
                     client=_addr(self.transport))
            if self._b_busy():  # pipelined behind an answer still running: no room for a second answer
                self.gate.refused("header_bytes")
                self.transport.close()
            else:
                self._b_refuse(431, f"the request line and headers exceed {self.gate.max_header_bytes} bytes",
                               "header_too_large", "header_bytes")

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._b_wtimer is None:
            self._b_wtimer = self.loop.call_later(self.gate.write_timeout_s, self._b_write_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._b_wtimer is not None:
            self._b_wtimer.cancel()
            self._b_wtimer = None

    def _b_write_timeout(self) -> None:
        self._b_wtimer = None
        if self.transport.is_closing():
            return
        self.gate.refused("write_timeout")
        log.info("http.write_timeout", timeout_s=self.gate.write_timeout_s, client=_addr(self.transport),
                 buffered=self.transport.get_write_buffer_size())
        self.transport.abort()  # the request sees a disconnect: its work is cancelled

    # -- hooks the concrete classes call ------------------------------------------------

    def _b_head_done(self) -> None:
        c = self.cycle  # the request's cycle, made as its head was parsed, its task not yet run
        if c is not None and not isinstance(c.transport, _CanonicalHead):
            c.transport = _CanonicalHead(c.transport, self.loop)
        if c is not None:
            c.scope[GONE] = asyncio.Event()
        if c is not None and self._b_control:
            c.scope[CONTROL_ONLY] = True  # answered by `control_room` in the app, before any route
        if c is not None and self.gate.key_of is not None:
            self._b_keyed(c.scope)
        self._b_in_head = False
        self._b_head_bytes = 0
        self._b_disarm()

    def _b_keyed(self, scope: Any) -> None:
        """Count the connection against the key its request presents (a keep-alive connection
        whose next request presents another key moves to it); past the key's share, the
        request is answered 429 by `ControlRoom` and the connection counts no more."""
        g = self.gate
        assert g.key_of is not None
        key = g.key_of(scope.get("headers") or [])
        if key != self._b_key:
            self._b_unkey()
            if key is not None:
                g.per_key[key] = g.per_key.get(key, 0) + 1
                self._b_key = key
        if key is None:
            return
        scope[KEY] = key
        if g.per_key[key] > g.max_per_key and scope.get("path") not in CONTROL_PATHS:
            log.debug("http.key_connections", open=g.per_key[key], max=g.max_per_key, client=_addr(self.transport))
            scope[KEY_FULL] = g.max_per_key
            self._b_unkey()

    def _b_unkey(self) -> None:
        key, self._b_key = self._b_key, None
        if key is not None:
            left = self.gate.per_key.get(key, 1) - 1
            if left > 0:
                self.gate.per_key[key] = left
            else:
                self.gate.per_key.pop(key, None)

    def _b_message_done(self) -> None:
        self._b_in_head = True  # what follows the request's last body byte is the next head
        self._b_head_bytes = 0

    def _b_parsed(self) -> None:
        pass

    # -- plumbing -----------------------------------------------------------------------

    def _b_busy(self) -> bool:
        c = self.cycle
        return c is not None and not c.response_complete

    def _b_arm(self) -> None:
        self._b_disarm()
        t = min(self.gate.header_timeout_s, CONTROL_HEAD_S) if self._b_control else self.gate.header_timeout_s
        self._b_timer = self.loop.call_later(t, self._b_timeout)

    def _b_disarm(self) -> None:
        if self._b_timer is not None:
            self._b_timer.cancel()
            self._b_timer = None

    def _b_timeout(self) -> None:
        self._b_timer = None
        if not self._b_in_head or self.transport.is_closing() or self._b_drain >= 0:
            return
        if self._b_busy():  # an answer is still being written: the next byte after it re-arms
            return
        if self._b_head_bytes == 0:
            log.debug("http.idle_closed", client=_addr(self.transport))
            self.gate.refused("header_timeout")
            self.transport.close()
            return
        log.info("http.header_timeout", received=self._b_head_bytes, client=_addr(self.transport))
        self._b_refuse(408, f"the request head did not arrive within {self.gate.header_timeout_s:g} s",
                       "header_timeout", "header_timeout")

    def _b_uncount(self) -> None:
        self._b_unkey()
        if self._b_counted:
            g = self.gate
            self._b_counted = False
            g.open -= 1
            g.opened(g.open)
            if self._b_control:
                g.control_open -= 1
            if self._b_peer is not None:
                left = g.per_peer.get(self._b_peer, 1) - 1
                if left > 0:
                    g.per_peer[self._b_peer] = left
                else:
                    g.per_peer.pop(self._b_peer, None)

    def _b_refuse(self, status: int, message: str, code: str, reason: str, *, retry_after: int | None = None) -> None:
        g = self.gate
        g.refused(reason)
        # A refused connection no longer takes a served one's place: while it lingers it is
        # bounded by MAX_LINGERING instead (so refused floods cannot fill the cap).
        self._b_uncount()
        self._b_disarm()
        self._b_drain = LINGER_BYTES
        t = self.transport
        if t.is_closing():
            return
        t.write(answer(status, message, code, retry_after=retry_after))
        if g.lingering >= MAX_LINGERING or not t.can_write_eof():
            t.close()  # closes after the answer is flushed
            return
        t.write_eof()
        g.lingering += 1
        self._b_linger = self.loop.call_later(LINGER_S, self._b_linger_end)

    def _b_linger_end(self) -> None:
        if self._b_linger is not None:
            self._b_linger = None
            self.gate.lingering -= 1
        self.transport.close()


class ControlRoom:
    """The app's outermost layer: a request on a control-room connection (`_Bounds`) that
    names any route but the control ones is answered 503 before anything else runs; one
    whose API key holds its share of connections, 429 (in the route's API's error shape)."""

    def __init__(self, app: Any, refused: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.refused = app, refused

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get(CONTROL_ONLY) and scope.get("path") not in CONTROL_PATHS:
            self.refused("connections")  # the cap refused it, from inside the room
            await _refuse(send, 503, "the front is full: only /health and /metrics are served now", "Overloaded")
            return
        if scope.get(KEY_FULL) is not None:
            self.refused("key_connections")
            await _refuse(send, 429, f"one API key holds at most {scope[KEY_FULL]} connections at once "
                          "(http_max_connections_per_key)", "rate_limit_exceeded", anthropic=str(
                              scope.get("path", "")).startswith("/v1/messages"))
            return
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, message: str, code: str, *, anthropic: bool = False) -> None:
    """One whole answer closing its connection, in OpenAI's error shape (Anthropic's on its routes)."""
    if anthropic:
        from actord.frontends.http.anthropic.wire import error_body as anthropic_error

        body = msgspec.json.encode(anthropic_error(status, message))
    else:
        body = msgspec.json.encode(O.error_body(status, message, code))
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def _addr(transport: Any) -> str | None:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else None


def bounded_protocol(gate: Gate) -> tuple[type, dict[str, Any]]:
    """uvicorn's HTTP protocol class with this front's bounds, and the uvicorn.Config
    arguments it needs. httptools (a dependency) is the fast path; h11 is the fallback
    uvicorn itself would take without it."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        HttpToolsProtocol = None  # type: ignore[assignment,misc]
    if HttpToolsProtocol is not None:
        class BoundedHttpTools(_Bounds, HttpToolsProtocol):  # type: ignore[misc,valid-type]
            # A head that arrives whole in one read is measured exactly (request line and
            # header lines as sent), so the limit means the same however the bytes came.
            _b_exact = 0
            _b_oversized = False

            def on_message_begin(self) -> None:
                super().on_message_begin()
                self._b_exact = 0

            def on_url(self, url: bytes) -> None:
                super().on_url(url)
                self._b_exact += len(url) + 16  # the method, the version, the line's spaces and CRLF

            def on_header(self, name: bytes, value: bytes) -> None:
                super().on_header(name, value)
                self._b_exact += len(name) + len(value) + 4  # ": " and CRLF

            def on_headers_complete(self) -> None:
                if self._b_exact > self.gate.max_header_bytes:
                    self._b_oversized = True  # refused after this read (data_received): no request runs
                    return
                super().on_headers_complete()
                self._b_head_done()

            def on_body(self, body: bytes) -> None:
                if not self._b_oversized:
                    super().on_body(body)

            def on_message_complete(self) -> None:
                if self._b_oversized:
                    return
                super().on_message_complete()
                self._b_message_done()

            def _b_parsed(self) -> None:
                if self._b_oversized and not self.transport.is_closing() and self._b_drain < 0:
                    self._b_head_bytes = self._b_exact  # let the common check refuse it

        BoundedHttpTools.gate = gate
        return BoundedHttpTools, {}

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(_Bounds, H11Protocol):  # type: ignore[misc]
        def _b_parsed(self) -> None:
            # h11 holds a head until it is whole: IDLE means the next request's head is
            # still awaited; anything else means it was parsed.
            waiting = self.conn.their_state is h11.IDLE
            if self._b_in_head and not waiting:
                self._b_head_done()
            elif waiting and not self._b_in_head:
                self._b_message_done()

    BoundedH11.gate = gate
    # h11's own bound, set above ours so that ours (431, JSON) answers first.
    # (On h11 a head that arrives whole in one read is bounded by that read, 256 KiB, not
    # measured exactly as on httptools.)
    return BoundedH11, {"h11_max_incomplete_event_size": gate.max_header_bytes + (256 << 10)}

"""The daemon's socket: JSON-RPC 2.0 over a Unix socket, one JSON value per line.

A daemon that many processes share is only as good as its behaviour towards the worst of
them, so every resource a connection can make the daemon hold has a bound from `Config`,
and the bound's answer is either a typed error or, for a client that stops reading, a
disconnect with a logged reason:

- who: each connection's SO_PEERCRED is checked (`peers.py`); at most `max_connections`
  are open; one more is answered `Overloaded` and closed.
- lines: read with an exact limit (`max_line_bytes`, the newline not counted); a longer
  line is discarded as it arrives (never buffered) and answered `RequestTooLarge`.
- requests in flight: at most `max_requests_in_flight` per connection and
  `max_inflight_bytes` of their lines; past either, `TooManyRequests`.
- control work: control calls (everything but completion, chat, props, health, metrics)
  are served at most `max_control_in_flight` at once per connection and
  `max_control_total` at once in all; more wait their turn in arrival order (a FIFO
  semaphore: connections take turns). A waiting call costs a parked task, no actor's
  mailbox and no loop time, so 8 connections x 60 `page.in` calls leave generation its
  share of the event loop and of the scheduler (whose own turns are kept by the actor
  kernel's control lane, serving/kernel/).
- output: everything a connection is sent (answers, streamed chunks) goes through one
  queue, encoded and written in order by one writer task (`outbox.py`: streamed chunks
  are encoded there, not in the slot's turn); when more than `max_outbox_bytes` wait
  encoded the client is not reading: it is disconnected (logged, counted in
  `rpc_disconnects_total{reason="outbox_overflow"}`), and nothing is silently dropped
  while the connection stays open.
- abandoned work: when a connection ends (the peer hangs up, a write fails, or the daemon
  disconnects it) its request tasks are cancelled; `ActorSystem.complete` then tells the
  slot, which ends the request at its next step (`requests_total{outcome="cancelled"}`).
  A peer that only half-closes (shuts down writing, keeps reading) still gets its answers:
  end of input is read as a hang-up only when the socket also reports POLLHUP.

The connection's socket is read and written directly (non-blocking `recv`/`send` after
`anyio.wait_readable`/`wait_writable`), not through anyio's stream: cancelling a stream's
pending receive races with the selector in anyio's asyncio backend (a readiness callback
lands on the cancelled future: "InvalidStateError" from the loop), and a disconnect
cancels exactly such reads.

Malformed input gets a typed JSON-RPC error on that connection and nothing else: the
daemon and the other clients carry on. Log lines about one client are one per event
(a disconnect, a refusal), never one per refused request.
"""

from __future__ import annotations

import os
import select
import socket
from pathlib import Path
from typing import Any

import anyio
import msgspec

from actord.service import tenancy
from actord.vocabulary.config import Config
from actord.vocabulary.errors import (
    ActordError, InvalidParams, METHOD_NOT_FOUND, Overloaded, PeerRefused, RequestTooLarge, TooManyRequests,
)
from actord.vocabulary.log import get
from actord.service.protocol import Service
from actord.frontends.rpc import protocol as P
from actord.frontends.shares import Shares, Ticket, paced, socket_peer
from actord.frontends.rpc.methods import METHODS
from actord.frontends.rpc.outbox import Outbox
from actord.frontends.rpc.peers import Peer, PeerPolicy, SocketClaim, claim_socket, peer_of, raise_fd_limit

log = get("actord.frontends.rpc")

HUP_POLL_S = 0.1  # how often a half-closed connection with work in flight is checked for a hang-up


class RpcServer:
    def __init__(self, system: Service | None, socket_path: str, config: Config | None = None,
                 shares: Shares | None = None) -> None:
        """`system` None: the daemon binds the socket's path before the model loads, and
        sets `system` once it runs (then `config` must be given). `shares`: the daemon's one
        count of generations, which its HTTP front is given too (frontends/shares.py);
        None: this socket's own."""
        self.system = system
        if config is None:
            assert system is not None, "a server without a system is given its config"
            config = system.config
        self.config: Config = config
        self.path = Path(socket_path)
        c = self.config
        self.policy = PeerPolicy(allow_uid=frozenset(c.allow_uid), allow_gid=frozenset(c.allow_gid))
        self.claim: SocketClaim | None = None
        self.inherited: socket.socket | None = None  # systemd's listener (inherit)
        self.open: set[_Connection] = set()
        self.connections = 0  # accepted, ever
        self.lingering = 0  # refused connections being drained
        self.requests = 0  # decoded requests, ever
        self.control = anyio.Semaphore(c.max_control_total)  # FIFO: connections take turns
        self.on_request: Any = None  # trace hook: called with (method, raw params)
        # Each client process has its share of the generations, beside the HTTP front's
        # clients (frontends/shares.py): past it a generation waits its turn.
        self.shares = shares if shares is not None else Shares.from_config(c)
        self.line = c.max_connections * c.max_requests_in_flight  # a client's waiting: held by the bounds

    @property
    def metrics(self) -> Any:
        return self.system.metrics if self.system is not None else None


    def held_bytes(self) -> int:
        """Bytes the open connections hold: lines being read and served, answers not yet written."""
        return sum(len(c.buf) + c.inflight_bytes + c.outbox.out_bytes + c.outbox.sending for c in self.open)

    def count(self, name: str, reason: str) -> None:
        m = self.metrics
        if m is not None:
            getattr(m, name).labels(reason=reason).inc()

    # -- the socket --------------------------------------------------------------------

    def claim_path(self) -> SocketClaim:
        """Take the socket path (lock + live-daemon probe). Start-up calls it before the
        model loads, so a second daemon fails at once; `serve` calls it if nobody did."""
        if self.claim is None:
            self.claim = claim_socket(self.path)
            raise_fd_limit(self.config.max_connections + 256)
        return self.claim

    def inherit(self, listener: socket.socket) -> None:
        """Serve on a listening socket systemd bound (socket activation, `systemd.py`)
        instead of binding the path: its path, mode and lifetime are systemd's, so the
        daemon neither claims nor removes it."""
        self.inherited = listener
        name = listener.getsockname()
        if isinstance(name, str) and name:
            self.path = Path(name)

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        claim = None if self.inherited is not None else self.claim_path()
        try:
            listener = self.inherited if claim is None else self._bind(claim)
            try:
                listener.setblocking(False)
                log.info("rpc.listening", socket=str(self.path), inherited=claim is None)
                async with anyio.create_task_group() as tg:
                    task_status.started()
                    await self._accept_loop(listener, tg)
            finally:
                listener.close()
        finally:
            if claim is not None:
                claim.release()
                self.claim = None

    def _bind(self, claim: SocketClaim) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old = os.umask(0o177)  # the socket is born owner-only: no window with wider access
            try:
                listener.bind(str(self.path))
            finally:
                os.umask(old)
            claim.bound()
            os.chmod(self.path, 0o600)
            listener.listen(min(socket.SOMAXCONN, 4096))
        except BaseException:
            listener.close()
            raise
        return listener

    async def _accept_loop(self, listener: socket.socket, tg: Any) -> None:
        out_of_fds = False
        while True:
            try:
                sock, _ = listener.accept()
            except BlockingIOError:
                await anyio.wait_readable(listener)
                continue
            except OSError as e:  # EMFILE/ENFILE/ENOBUFS: wait for fds to come back, do not die
                if not out_of_fds:
                    log.error("rpc.accept_failed", error=os.strerror(e.errno) if e.errno else repr(e))
                    out_of_fds = True
                await anyio.sleep(0.05)
                continue
            out_of_fds = False
            sock.setblocking(False)
            tg.start_soon(self._connection, sock)

    async def _connection(self, sock: socket.socket) -> None:
        self.connections += 1
        try:
            peer = peer_of(sock)
            if not self.policy.allows(peer):
                log.warning("rpc.peer_refused", pid=peer and peer.pid, uid=peer and peer.uid, gid=peer and peer.gid)
                self.count("rpc_refused_total", "peer")
                await _refuse(self, sock, PeerRefused("this daemon serves its own uid and the allowed uids/gids only",
                                          uid=peer.uid if peer else None))
                return
            if len(self.open) >= self.config.max_connections:
                log.warning("rpc.too_many_connections", open=len(self.open), pid=peer and peer.pid)
                self.count("rpc_refused_total", "connections")
                await _refuse(self, sock, Overloaded(f"the daemon serves at most {self.config.max_connections} "
                                         f"connections", max_connections=self.config.max_connections))
                return
            # Cells are reused only within a tenant: a peer of another uid is its own.
            tenancy.enter("" if self.config.share_across_tenants else tenancy.of_uid(peer and peer.uid, os.geteuid()))
            conn = _Connection(self, sock, peer, socket_peer(peer and peer.pid, self.connections))
            self.open.add(conn)
            if self.metrics is not None:
                self.metrics.rpc_connections.set(len(self.open))
            try:
                await conn.run()
            finally:
                self.open.discard(conn)
                if self.metrics is not None:
                    self.metrics.rpc_connections.set(len(self.open))
        except Exception as e:  # one connection's bug must not end the listener
            log.exception("rpc.connection_failed", error=repr(e))
        finally:
            sock.close()


LINGER_S = 0.5  # how long a refused connection is drained so its client reads the refusal
MAX_LINGERING = 64


async def _refuse(server: "RpcServer", sock: socket.socket, err: ActordError) -> None:
    """Send one error line and close. If the client's request is still unread when the socket
    closes, the kernel resets the connection and the client may lose the answer: so shut
    down writing (the client reads the line, then end of input) and drain its input a moment."""
    try:  # one line into an empty socket buffer: never blocks; if it cannot be sent, so be it
        sock.send(P.error_response(None, err))
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    if server.lingering >= MAX_LINGERING:
        return
    server.lingering += 1
    try:
        with anyio.move_on_after(LINGER_S):
            while True:
                try:
                    if not sock.recv(65536):
                        return
                except BlockingIOError:
                    await anyio.wait_readable(sock)
                except OSError:
                    return
    finally:
        server.lingering -= 1


def _peer_gone(sock: socket.socket) -> bool:
    """The peer closed its end entirely (POLLHUP), not just shut down writing."""
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | getattr(select, "POLLRDHUP", 0))
        return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in p.poll(0))
    except (OSError, ValueError):
        return True


class _Connection:
    """One client connection: its reader, its writer, its requests and their bounds."""

    def __init__(self, server: RpcServer, sock: socket.socket, peer: Peer | None, name: str) -> None:
        self.server = server
        self.name = name  # the client its generations count under (frontends/shares.py)
        self.c = server.config
        self.sock = sock
        self.peer = peer
        self.outbox = Outbox(sock, self.c.max_outbox_bytes, self.disconnect)
        self.inflight = 0
        self.inflight_bytes = 0
        self.scope = anyio.CancelScope()
        self.tg: Any = None
        self.control = anyio.Semaphore(self.c.max_control_in_flight)
        self.buf = bytearray()  # the line being read (held_bytes reads its length)

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self) -> None:
        with self.scope:
            async with anyio.create_task_group() as tg:
                self.tg = tg
                tg.start_soon(self.outbox.writer)
                tg.start_soon(self.outbox.drained)
                await self._reader()
                await self._after_input()
                self.scope.cancel()  # nothing left to do: stop the writer

    def disconnect(self, reason: str, **info: Any) -> None:
        """End the connection now: cancel its requests and its writer (sync: the writer calls
        it when the client stops reading or a write fails)."""
        if self.outbox.closed:
            return
        level = log.warning if reason == "outbox_overflow" else log.info
        level("rpc.disconnect", reason=reason, pid=self.peer and self.peer.pid, in_flight=self.inflight,
              queued_bytes=self.outbox.out_bytes, **info)
        self.server.count("rpc_disconnects_total", reason)
        self.outbox.close()
        self.scope.cancel()

    async def _after_input(self) -> None:
        """The client sent end of input: a hang-up, or a half-close that still reads."""
        if _peer_gone(self.sock):
            if self.inflight or self.outbox.busy:
                self.disconnect("hangup")
            return
        while self.inflight or self.outbox.busy:
            if _peer_gone(self.sock):
                self.disconnect("hangup")
                return
            await anyio.sleep(HUP_POLL_S)

    # -- input ---------------------------------------------------------------------------

    async def _reader(self) -> None:
        limit = self.c.max_line_bytes
        buf = self.buf
        discarding = False
        while True:
            try:
                chunk = self.sock.recv(65536)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            except OSError:
                return
            if not chunk:
                return
            await anyio.lowlevel.checkpoint()  # a client that never pauses does not starve the loop
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                if nl < 0:
                    if not discarding:
                        if len(buf) + len(chunk) - start > limit:
                            discarding = True
                            buf.clear()
                            self._too_long(limit)
                        else:
                            buf += chunk[start:]
                    break
                if discarding:
                    discarding = False
                elif len(buf) + nl - start > limit:
                    buf.clear()
                    self._too_long(limit)
                else:
                    buf += chunk[start:nl]
                    line = bytes(buf)
                    buf.clear()
                    self._dispatch(line)
                start = nl + 1

    def _too_long(self, limit: int) -> None:
        self.server.count("rpc_refused_total", "line")
        err = RequestTooLarge(f"request line over {limit} bytes", max_line_bytes=limit)
        self.outbox.put(P.error_response(None, err))

    def _dispatch(self, line: bytes) -> None:
        if not line.strip():
            return
        n = len(line)
        if self.inflight >= self.c.max_requests_in_flight or self.inflight_bytes + n > self.c.max_inflight_bytes:
            self.server.count("rpc_refused_total", "in_flight")
            answer, rid = P.peek_id(line)
            if answer:
                self.outbox.put(P.error_response(rid, TooManyRequests(
                    f"{self.inflight} requests ({self.inflight_bytes} bytes) already in flight on this connection",
                    max_requests_in_flight=self.c.max_requests_in_flight,
                    max_inflight_bytes=self.c.max_inflight_bytes)))
            return
        self.inflight += 1
        self.inflight_bytes += n
        self.tg.start_soon(self._serve_line, line, n)

    # -- requests ------------------------------------------------------------------------

    async def _serve_line(self, line: bytes, n: int) -> None:
        held = 1
        try:
            if not P.is_batch(line):
                out = await self._serve_one(line)
                if out is not None:
                    self.outbox.put(out + b"\n")
                return
            try:
                items = P.decode_batch(line)
            except P.ProtocolError as e:
                self.outbox.put(P.error_response(None, e))
                return
            if not items:
                self.outbox.put(P.error_response(None, P.ProtocolError(-32600, "invalid request: empty batch")))
                return
            room = self.c.max_requests_in_flight - self.inflight + 1
            if len(items) > room:
                self.server.count("rpc_refused_total", "batch")
                self.outbox.put(P.error_response(None, RequestTooLarge(
                    f"a batch of {len(items)} requests; this connection may have {room} more in flight",
                    max_requests_in_flight=self.c.max_requests_in_flight)))
                return
            self.inflight += len(items) - 1
            held = len(items)
            answers: list[bytes | None] = [None] * len(items)

            async def one(i: int, raw: msgspec.Raw) -> None:
                answers[i] = await self._serve_one(raw)

            async with anyio.create_task_group() as tg:
                for i, raw in enumerate(items):
                    tg.start_soon(one, i, raw)
            parts = [a for a in answers if a is not None]
            if parts:
                self.outbox.put(P.batch_response(parts))
        finally:
            self.inflight -= held
            self.inflight_bytes -= n

    async def _serve_one(self, data: bytes | msgspec.Raw) -> bytes | None:
        """Run one request; its encoded answer (no newline), or None for a notification."""
        try:
            req = P.decode_request(data)
        except P.ProtocolError as e:
            return P.error_response(e.id, e, newline=False)
        rid = req.rid
        try:
            result = await self._call(req)
        except P.ProtocolError as e:
            err: BaseException = e
        except ActordError as e:
            err = e
        except Exception as e:  # a bug in one request must not take down its peers
            log.exception("rpc.internal_error", method=req.method[:64], error=repr(e))
            err = e
        else:
            return None if req.is_notification else P.result_response(rid, result, newline=False)
        return None if req.is_notification else P.error_response(rid, err, newline=False)

    async def _call(self, req: P.Request) -> Any:
        server = self.server
        server.requests += 1
        method = METHODS.get(req.method)
        if method is None:
            raise P.ProtocolError(METHOD_NOT_FOUND, f"method not found: {req.method[:128]}")
        raw = bytes(req.params)
        try:
            if raw.lstrip()[:1] == b"[":
                if P.batch_decoder.decode(raw):
                    raise InvalidParams(f"{req.method} takes its params by name (an object)")
                raw = b"{}"
            params = msgspec.json.decode(raw, type=method.params)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise InvalidParams(f"invalid params for {req.method}: {e}") from None
        except RecursionError:
            raise P.parse_error("params nested too deep") from None
        if server.on_request is not None:
            server.on_request(req.method, raw)
        rid = req.rid

        def stream(chunk: Any) -> None:  # in a slot's turn: queued as it is, the writer encodes it
            self.outbox.put((rid, chunk))

        if not method.control:
            if not method.streams:
                return await method.call(server.system, params, None)
            # Its wait is bounded before this line: each connection's requests in flight
            # (max_requests_in_flight) and the connections (max_connections).
            ticket = await server.shares.enter(self.name, None, server.line)
            if not isinstance(ticket, Ticket):  # past its share, and its line is full
                server.count("rpc_refused_total", "generations")
                await paced()  # a flood's answers at the daemon's pace
                raise TooManyRequests(ticket[0], reason=ticket[1])
            try:
                return await method.call(server.system, params, stream)
            finally:
                ticket.release()
        async with self.control, server.control:  # this connection's turn, then the daemon's
            return await method.call(server.system, params, None)


"""While the router is down, its socket and HTTP address answer a typed `NodeUnavailable`.

Why: the router serves both in its own process, so from a kill -9 until Ray restarted it
(seconds, and more under load) a client got "connection refused" (socket) or a reset
(HTTP): an untyped failure, which a client cannot tell from a wrong address. A node on the
router's machine (node.py `_kick_router`) that sees the router's process gone stands in:

- the socket: a listener bound beside the path and renamed over it (atomic: a client finds
  a listener or the old dead one, never no file), answering every request line with the
  JSON-RPC error of `NodeUnavailable` (`data.router`: true), so a client of one daemon
  (`actord.frontends.client.Client`) raises the typed error;
- the HTTP address: 503 with Retry-After, in OpenAI's error shape (Anthropic's on its
  routes), code `NodeUnavailable`, as the router's own front answers that error.

When the router answers again the stand-in closes (removing the path only if it is still
its own); the router takes its socket back at its next call if the stand-in had replaced
the one it bound first (router.py `ping`), and binds its HTTP address if the stand-in held
it while it started.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from pathlib import Path

import msgspec

from actord.frontends.http.anthropic.wire import error_body as anthropic_error
from actord.frontends.http.bounds import answer as http_answer
from actord.frontends.rpc.protocol import ProtocolError, decode_request, error_response
from actord.vocabulary.errors import NodeUnavailable
from actord.vocabulary.log import get

log = get("actord.cluster.standin")

HEAD_BYTES = 64 << 10  # an HTTP request head read before answering (the body is not read)
HEAD_S = 5.0  # how long a client has to send that head
MESSAGE = "the cluster's router is down (restarting): retry"


def _unavailable() -> NodeUnavailable:
    return NodeUnavailable(MESSAGE, router=True)


def router_process_gone(pid: int) -> bool:
    """Whether the router's process (on this machine) has exited: never a live but busy one,
    whose socket a stand-in must not take."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:  # a zombie, not yet reaped by its parent, is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


class StandIn:
    def __init__(self, socket_path: str | None, http: str | None) -> None:
        self.socket_path, self.http = socket_path, http
        self._unix: asyncio.AbstractServer | None = None
        self._tcp: list[asyncio.AbstractServer] = []
        self._ino: int | None = None

    @property
    def serving(self) -> bool:
        return self._unix is not None or bool(self._tcp)

    async def start(self) -> None:
        if self.socket_path and self._unix is None:
            try:
                await self._start_unix(self.socket_path)
            except OSError as e:
                log.warning("cluster.standin_socket_failed", path=self.socket_path, error=repr(e))
        if self.http and not self._tcp:
            for address in self.http.split(","):  # the front may listen on several
                host, _, port = address.strip().rpartition(":")
                try:
                    self._tcp.append(await asyncio.start_server(self._http, host.strip("[]") or None, int(port),
                                                                reuse_address=True, limit=HEAD_BYTES))
                except OSError as e:  # the router holds it again (or another node's stand-in does)
                    log.debug("cluster.standin_http_busy", http=address, error=repr(e))
        if self.serving:
            log.warning("cluster.router_stand_in", socket=self.socket_path if self._unix else None,
                        http=[s.sockets[0].getsockname() for s in self._tcp if s.sockets])

    async def _start_unix(self, path: str) -> None:
        tmp = f"{path}.standin-{uuid.uuid4().hex[:8]}"
        server = await asyncio.start_unix_server(self._rpc, path=tmp)
        try:
            self._ino = os.stat(tmp).st_ino
            os.replace(tmp, path)  # atomic: the path names a listener throughout
        except OSError:
            server.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._unix = server

    async def close(self) -> None:
        if self._unix is not None:
            self._unix.close()
            self._unix = None
            try:
                if self.socket_path and os.stat(self.socket_path).st_ino == self._ino:
                    os.unlink(self.socket_path)  # still ours: the router binds it afresh
            except OSError:
                pass
        for server in self._tcp:
            server.close()
        self._tcp = []
        log.info("cluster.router_stand_in_closed")

    async def _rpc(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (asyncio.LimitOverrunError, ValueError):
                    break
                if not line:
                    break
                if not line.strip():
                    continue
                try:
                    req = decode_request(line.strip())
                except ProtocolError as e:
                    writer.write(error_response(e.id, e))
                else:
                    if req.is_notification:
                        continue
                    writer.write(error_response(req.rid, _unavailable()))
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_S)
            path = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
            if path.startswith(b"/v1/messages"):
                body = msgspec.json.encode(anthropic_error(503, MESSAGE))
                writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\nRetry-After: 1\r\n"
                             b"Connection: close\r\n\r\n" + body)
            else:
                writer.write(http_answer(503, MESSAGE, "NodeUnavailable", retry_after=1))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()


def loopback_host() -> str:
    """This machine's name, as the router tells it (a stand-in runs only beside the router)."""
    return socket.gethostname()

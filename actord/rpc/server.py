"""The daemon's socket: JSON-RPC 2.0 over a Unix socket, one JSON object per line.

Each connection reads lines and runs each request in its own task, so one client can have
several requests in flight and a slow completion never blocks its `health` call. All
writes of a connection go through one bounded outbox drained by one writer task, so
streamed chunks (notifications) and responses never interleave mid-line; a client too slow
to drain its outbox is disconnected rather than allowed to stall the engine.

Malformed input gets a JSON-RPC error on that connection and nothing else: the daemon and
the other clients carry on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import anyio
import msgspec
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from actord.errors import ActordError, InvalidParams, METHOD_NOT_FOUND
from actord.log import get
from actord.rpc import protocol as P
from actord.rpc.methods import METHODS

log = get("actord.rpc")

OUTBOX = 8192


class RpcServer:
    def __init__(self, system: Any, socket_path: str) -> None:
        self.system = system
        self.path = Path(socket_path)
        self.connections = 0
        self.requests = 0
        self.on_request: Any = None  # trace hook: called with (method, raw params)

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise InvalidParams(f"{self.path} exists and is not a socket")
            self.path.unlink()
        old = os.umask(0o177)  # the socket is born owner-only: no window with wider access
        try:
            listener = await anyio.create_unix_listener(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        log.info("rpc.listening", socket=str(self.path))
        try:
            async with listener:
                task_status.started()
                await listener.serve(self._connection)
        finally:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    async def _connection(self, stream: SocketStream) -> None:
        self.connections += 1
        send, recv = anyio.create_memory_object_stream[bytes](OUTBOX)
        reader = BufferedByteReceiveStream(stream)
        async with stream, anyio.create_task_group() as tg:
            tg.start_soon(self._writer, stream, recv)
            async with send:
                while True:
                    try:
                        line = await reader.receive_until(b"\n", P.MAX_LINE)
                    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                            anyio.ClosedResourceError, ConnectionError):
                        break
                    except anyio.DelimiterNotFound:
                        self._put(send, P.error_response(None, P.ProtocolError(-32600, "request line too long")))
                        break
                    if not line.strip():
                        continue
                    tg.start_soon(self._request, line, send.clone())
            # Reader done: let requests in flight finish and the writer drain, then close.

    async def _writer(self, stream: SocketStream, recv: Any) -> None:
        async with recv:
            async for data in recv:
                try:
                    await stream.send(data)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                    break

    @staticmethod
    def _put(send: Any, data: bytes) -> None:
        try:
            send.send_nowait(data)
        except anyio.WouldBlock:
            log.warning("rpc.client_too_slow")
            send.close()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass

    async def _request(self, line: bytes, send: Any) -> None:
        async with send:
            rid: P.Id = None
            try:
                req = P.decode_request(line)
                rid = None if req.id is msgspec.UNSET else req.id
                self.requests += 1
                method = METHODS.get(req.method)
                if method is None:
                    raise P.ProtocolError(METHOD_NOT_FOUND, f"method not found: {req.method}", rid)
                try:
                    params = msgspec.json.decode(req.params, type=method.params)
                except (msgspec.ValidationError, msgspec.DecodeError) as e:
                    raise InvalidParams(f"invalid params for {req.method}: {e}") from None
                if self.on_request is not None:
                    self.on_request(req.method, bytes(req.params))
                def stream(chunk: Any, _rid: P.Id = rid) -> None:
                    self._put(send, P.notification("completion.chunk", {"id": _rid, **chunk}))

                sink = stream if method.streams else None
                result = await method.call(self.system, params, sink)
                if req.id is not msgspec.UNSET:
                    self._put(send, P.result_response(rid, result))
            except P.ProtocolError as e:
                self._put(send, P.error_response(e.id if e.id is not None else rid, e))
            except ActordError as e:
                self._put(send, P.error_response(rid, e))
            except Exception as e:  # a bug in one request must not take down its peers
                log.exception("rpc.internal_error", error=repr(e))
                self._put(send, P.error_response(rid, e))
